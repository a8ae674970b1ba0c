"""nvidia-smi CSV logs (`--query-gpu=... --format=csv`), with or without a header, units and GPU index."""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from wattgate.errors import InputError
from wattgate.trace import (
    GPU,
    MEM_USED_MIB,
    POWER_W,
    REASON_BITS,
    REASONS,
    SM_CLOCK_MHZ,
    TEMP_C,
    TIME,
    UTIL_GPU,
    UTIL_MEM,
)
from wattgate.power.importers.common import ReadOptions
from wattgate.power.log_parsing import (
    POWER_W_AVG,
    Imported,
    BadLine,
    Lines,
    LocalTimes,
    NUMBER,
    HEADER_CHARS,
    excerpt,
    UNITS,
    unit_factor,
    parse_number,
    parse_iso_time,
    parse_reasons,
    read_log_rows,
    truncated_final,
    MISSING,
)


NAME, BUS_ID = "name", "bus_id"  # the device name and PCI bus id, kept beside a sample's trace columns
SMI_FIELDS = {  # query field -> trace column (power: the instant reading wins over the 1 s average)
    "timestamp": TIME,
    "index": GPU,
    "power.draw.instant": POWER_W,
    "power.draw": POWER_W_AVG,
    "power.draw.average": POWER_W_AVG,
    "utilization.gpu": UTIL_GPU,
    "utilization.memory": UTIL_MEM,
    "memory.used": MEM_USED_MIB,
    "clocks.sm": SM_CLOCK_MHZ,
    "clocks.current.sm": SM_CLOCK_MHZ,
    "temperature.gpu": TEMP_C,
    "name": NAME,
    "gpu_name": NAME,
    "pci.bus_id": BUS_ID,
    "gpu_bus_id": BUS_ID,
    # the reasons bitmask (0x... hex), under the current name and the one before it
    "clocks_event_reasons.active": REASONS,
    "clocks_throttle_reasons.active": REASONS,
}
# one reason per column, "Active" / "Not Active": a log that queried these rather than `.active`
REASON_FLAG = re.compile(r"^clocks_(?:event|throttle)_reasons\.([a-z_]+)$")
SMI_TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S.%f")


def parse_smi_time(text: str, tz, local: LocalTimes | None = None) -> float:
    """nvidia-smi's local time in `tz` (through `local`, where given: a repeated DST hour read in line order)."""
    text = text.strip()
    for fmt in SMI_TIME_FORMATS:
        try:
            naive = dt.datetime.strptime(text, fmt)
        except ValueError:
            continue
        return local.timestamp(naive) if local is not None else naive.replace(tzinfo=tz).timestamp()
    t = parse_iso_time(text, tz, local) if re.match(r"^\d{4}[-/]\d\d[-/]\d\d", text) else None
    if t is None:
        raise BadLine("timestamp", text, "expected e.g. 2025/07/27 00:34:45.155 or 2025-07-27T00:34:45.155Z")
    return t


def looks_like_sample(cells: list[str], tz) -> bool:
    """A noheader log starts with a value: some cell is a timestamp or a number."""
    for c in cells:
        try:
            parse_smi_time(c, tz)
            return True
        except BadLine:
            pass
        if NUMBER.match(c):
            return True
    return False


def smi_header(cells: list[str]) -> list[str]:
    """'power.draw [W]' -> 'power.draw'."""
    return [re.sub(r"\s*\[[^\]]*\]\s*$", "", c).strip().lower() for c in cells]


def smi_header_units(cells: list[str]) -> list[str]:
    """'power.draw [W]' -> 'W'; '' where the header names no unit."""
    return [(m.group(1).strip() if (m := re.search(r"\[([^\]]*)\]\s*$", c)) else "") for c in cells]


def read(path: Path, imported: Imported, lines: Lines, o: ReadOptions) -> None:
    read_nvidia_smi(path, imported, lines, o.host, o.tz, o.fields)


def read_nvidia_smi(
    path: Path, imported: Imported, lines: Lines, host: str, tz, fields: list[str] | None, gpu_offset: int = 0
) -> None:
    rows = [(i, r) for i, r in read_log_rows(path, lines) if r and any(c.strip() for c in r)]
    if not rows:
        raise InputError(f"{path}: empty file")
    first = smi_header(rows[0][1])
    if "timestamp" in first or any(c in SMI_FIELDS for c in first) or not looks_like_sample(rows[0][1], tz):
        header, units, body = first, smi_header_units(rows[0][1]), rows[1:]
        header_line = rows[0][0]
        if fields:
            print(
                f"import-trace: warning: {path}: has a header line; --fields ignored (the header wins)", file=sys.stderr
            )
    elif fields:
        header, units, body = smi_header(fields), smi_header_units(fields), rows
        header_line = 0
    else:
        raise InputError(
            f"{path}: no header line (written with --format=csv,noheader?); pass --fields with the "
            "--query-gpu list it was written with, e.g. --fields timestamp,index,power.draw,"
            "utilization.gpu"
        )
    columns = {SMI_FIELDS[h]: i for i, h in reversed(list(enumerate(header))) if h in SMI_FIELDS}
    for col, i in columns.items():  # a header unit nobody can convert is an error before any line is read
        if col in UNITS and units[i]:
            try:
                unit_factor(col, units[i], header[i], units[i])
            except BadLine as exc:
                where = f"{path}:{header_line}" if header_line else f"{path}: --fields"
                raise InputError(f"{where}: column {header[i]!r}: {str(exc).split(': ', 2)[-1]}") from None
    if TIME not in columns or not ({POWER_W, POWER_W_AVG} & set(columns)):
        raise InputError(
            f"{path}: an nvidia-smi log needs the columns timestamp and power.draw (or "
            f"power.draw.instant); found {excerpt(', '.join(header), HEADER_CHARS)}"
        )
    flags = {
        i: REASON_BITS[m.group(1)]
        for i, h in enumerate(header)
        if (m := REASON_FLAG.match(h)) and m.group(1) in REASON_BITS
    }
    ignored = sorted(set(header) - set(SMI_FIELDS) - {header[i] for i in flags})
    if ignored:
        imported.notes.append(f"{path.name}: ignored columns {', '.join(ignored)}")
    parsed = []
    local = LocalTimes(tz)
    last = body[-1][0] if body else 0
    for lineno, cells in body:
        try:
            if len(cells) != len(header):
                raise BadLine("line", ",".join(cells), f"{len(cells)} fields, header has {len(header)}")
            if cells[0].strip().lower().startswith(header[0]) and smi_header(cells) == header:
                continue  # a repeated header (a log restarted into the same file)
            rec: dict[str, str | float | None] = {TIME: parse_smi_time(cells[columns[TIME]], tz, local)}
            for col, i in columns.items():
                if col in (TIME, NAME, BUS_ID):
                    if col != TIME:
                        rec[col] = cells[i].strip()
                    continue
                if col == REASONS:
                    rec[col] = parse_reasons(header[i], cells[i])
                    continue
                rec[col] = parse_number(header[i], cells[i], col, units[i])
            if flags and rec.get(REASONS) is None:
                rec[REASONS] = reason_flags(header, cells, flags)
            parsed.append((lineno, rec))
        except BadLine as exc:
            lines.bad(path, lineno, exc, truncated_final(path, cells, header, exc, lineno == last))
    if not parsed:
        raise InputError(f"{path}: no readable sample lines")
    imported.notes.extend(local.note(path))
    gpus = assign_smi_gpus(path, [r for _, r in parsed], imported)
    for (lineno, rec), gpu in zip(parsed, gpus):
        power = rec.get(POWER_W) if rec.get(POWER_W) is not None else rec.get(POWER_W_AVG)
        row = {k: rec.get(k) for k in (TIME, UTIL_GPU, UTIL_MEM, MEM_USED_MIB, SM_CLOCK_MHZ, TEMP_C, REASONS)}
        row.update(host=host, gpu=gpu + gpu_offset, power_w=power)
        imported.add(row, path, lineno)
        name = rec.get(NAME)
        if isinstance(name, str) and name:  # the name column's text, stripped
            imported.names[(host, gpu + gpu_offset)] = name
    if POWER_W not in columns:
        imported.notes.append(
            f"{path.name}: power.draw only (a 1 s average on recent GPUs); the instant reading is power.draw.instant"
        )


def reason_flags(header: list[str], cells: list[str], flags: dict[int, int]) -> int | None:
    """The bitmask from one-reason columns ("Active" / "Not Active"); None when none of them holds a value."""
    mask, seen = 0, False
    for i, bit in flags.items():
        text = cells[i].strip().lower()
        if text in MISSING:
            continue
        if text not in ("active", "not active"):
            raise BadLine(header[i], cells[i], "expected Active or Not Active")
        seen = True
        mask |= bit if text == "active" else 0
    return mask if seen else None


def assign_smi_gpus(path: Path, recs: list[dict], imported: Imported) -> list[int]:
    if all(r.get(GPU) is not None for r in recs):  # -1 (the range check's error) for an index that is none
        return [int(r[GPU]) if math.isfinite(r[GPU]) and r[GPU] == int(r[GPU]) else -1 for r in recs]
    if all(r.get(BUS_ID) for r in recs):
        order = {b: i for i, b in enumerate(sorted({r[BUS_ID].lower() for r in recs}))}
        imported.notes.append(f"{path.name}: GPU index from the PCI bus id order (nvidia-smi's default order)")
        return [order[r[BUS_ID].lower()] for r in recs]
    gpus, n, short = infer_burst_positions(np.array([r[TIME] for r in recs]))
    imported.notes.append(
        f"{path.name}: no index column: GPU index inferred from each sampling burst's row "
        f"order ({n} GPU(s); {short} short burst(s))"
    )
    imported.index_inferred = True
    return gpus


def infer_burst_positions(times: np.ndarray) -> tuple[list[int], int, int]:
    """Rows come one per GPU a few ms apart, bursts an interval apart: index = position in the burst.

    A burst ends where the gap to the next row exceeds half the typical interval. The GPU count is the
    most common burst length; shorter bursts (a GPU that did not answer) take the first positions.
    """
    if len(times) == 1:
        return [0], 1, 0
    gaps = np.diff(times)
    large = gaps[gaps >= 0.010]
    if len(large) == 0:
        return list(range(len(times))), len(times), 0
    cut = 0.5 * float(np.median(large))
    starts = np.concatenate([[0], np.nonzero(gaps > cut)[0] + 1])
    lengths = np.diff(np.concatenate([starts, [len(times)]]))
    n = Counter(lengths.tolist()).most_common(1)[0][0]
    positions = np.arange(len(times)) - np.repeat(starts, lengths)
    if (lengths > n).any():  # two bursts run together: wrap positions rather than invent GPUs
        positions = positions % n
    return positions.tolist(), int(n), int((lengths < n).sum())

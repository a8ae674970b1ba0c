"""`wattgate import-trace`: other collectors' logs -> the trace contract.

- nvidia-smi CSV, as `nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits] -l/-lms N`
  writes it: values with or without units ("72.36 W", "0 %"), the markers
  "[N/A]" and "[Not Supported]" (null), timestamps "2025/07/27 00:34:45.155".
  Without an `index` (or `pci.bus_id`) column, nvidia-smi still writes one row
  per GPU in GPU order within each sampling burst (rows a few ms apart, bursts
  an interval apart): the GPU index is inferred from the position in the
  burst, and the trace metadata says so.
- DCGM exporter text (Prometheus exposition format): `DCGM_FI_DEV_*` and
  `DCGM_FI_PROF_*` samples with labels `gpu`, `Hostname`, `modelName`; a
  scrape's time is the samples' trailing timestamp (ms), else a comment line
  holding a time just before it (`# 2025-07-27T00:34:45Z` or `# 1753576485.1`),
  else a unix time in the file name (a file per scrape).
- Zeus power CSV: a time column plus one power column per GPU (`gpu0`,
  `GPU1`, `power_gpu2`, ...; watts, or milliwatts when the header says mW), and
  the legacy `zeus_monitor` form `Time,Power` (milliwatts, one GPU per file).
- Any CSV with a header (`--from csv --columns time=ts,power_w=power_mW:mW,...`): trace fields mapped
  to header names, each with an optional stated unit; time as unix s (or stated ms/us/ns) or ISO-8601.
  An unmapped gpu means one GPU (index 0).
A line that cannot be read is an error naming file:line and the field, or,
with `skip_bad_lines`, a counted skip. A truncated final line in a CSV-like log (fewer fields than the
header, or its last field cut off: what killing the logger leaves) is dropped and noted
(`skipped_lines: {"truncated_final_line": 1}`). ISO-8601 times with `Z` or an offset keep it; naive
times take `--tz` (nvidia-smi, csv) or UTC (Zeus).

Units are kept per value: "350.12 W", "350120 mW" and "0.35 kW" in one column
all read as 350 W. A value without a unit takes its column's unit (the header's
`[mW]`, Zeus's `(mW)`), else the trace unit. An unknown unit is a bad line.
Values that cannot be physical (NaN, +-Inf, negative power, energy, utilization,
clocks or memory; beyond float32 for float32 columns) become null and are
counted per column in the trace metadata under `invalid_values`.
"""

from __future__ import annotations

import gzip
import datetime as dt
import math
import os
import re
import sys
import zlib
from collections import Counter
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path
from wattgate.errors import InputError
from wattgate.trace import TRACE_SCHEMA
from wattgate.power.log_parsing import (
    Imported,
    BadLine,
    Lines,
    NUMBER,
    check_ranges,
    UNITS,
    unit_factor,
    parse_number,
    parse_iso_time,
    open_log,
    log_stem,
    read_log_rows,
    truncated_final,
)

FORMATS = ("nvidia-smi", "dcgm", "zeus", "csv")
# --- nvidia-smi ------------------------------------------------------------------------------------

SMI_FIELDS = {  # query field -> trace column (power: the instant reading wins over the 1 s average)
    "timestamp": "time",
    "index": "gpu",
    "power.draw.instant": "power_w",
    "power.draw": "power_w_avg",
    "power.draw.average": "power_w_avg",
    "utilization.gpu": "util_gpu",
    "utilization.memory": "util_mem",
    "memory.used": "mem_used_mib",
    "clocks.sm": "sm_clock_mhz",
    "clocks.current.sm": "sm_clock_mhz",
    "temperature.gpu": "temp_c",
    "name": "name",
    "gpu_name": "name",
    "pci.bus_id": "bus_id",
    "gpu_bus_id": "bus_id",
}
SMI_TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S.%f")


def parse_smi_time(text: str, tz) -> float:
    text = text.strip()
    for fmt in SMI_TIME_FORMATS:
        try:
            return dt.datetime.strptime(text, fmt).replace(tzinfo=tz).timestamp()
        except ValueError:
            continue
    t = parse_iso_time(text, tz) if re.match(r"^\d{4}[-/]\d\d[-/]\d\d", text) else None
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


def read_nvidia_smi(
    path: Path, imported: Imported, lines: Lines, host: str, tz, fields: list[str] | None, gpu_offset: int = 0
) -> None:
    rows = [(i + 1, r) for i, r in enumerate(read_log_rows(path)) if r and any(c.strip() for c in r)]
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
    if "time" not in columns or not ({"power_w", "power_w_avg"} & set(columns)):
        raise InputError(
            f"{path}: an nvidia-smi log needs the columns timestamp and power.draw (or "
            f"power.draw.instant); found {', '.join(header)}"
        )
    ignored = sorted(set(header) - set(SMI_FIELDS))
    if ignored:
        imported.notes.append(f"{path.name}: ignored columns {', '.join(ignored)}")
    parsed = []
    last = body[-1][0] if body else 0
    for lineno, cells in body:
        try:
            if len(cells) != len(header):
                raise BadLine("line", ",".join(cells), f"{len(cells)} fields, header has {len(header)}")
            if cells[0].strip().lower().startswith(header[0]) and smi_header(cells) == header:
                continue  # a repeated header (a log restarted into the same file)
            rec = {"time": parse_smi_time(cells[columns["time"]], tz)}
            for col, i in columns.items():
                if col in ("time", "name", "bus_id"):
                    if col != "time":
                        rec[col] = cells[i].strip()
                    continue
                rec[col] = parse_number(header[i], cells[i], col, units[i])
            parsed.append((lineno, rec))
        except BadLine as exc:
            lines.bad(path, lineno, exc, truncated_final(path, cells, header, exc, lineno == last))
    if not parsed:
        raise InputError(f"{path}: no readable sample lines")
    gpus = assign_smi_gpus(path, [r for _, r in parsed], imported)
    for (lineno, rec), gpu in zip(parsed, gpus):
        power = rec.get("power_w") if rec.get("power_w") is not None else rec.get("power_w_avg")
        row = {k: rec.get(k) for k in ("time", "util_gpu", "util_mem", "mem_used_mib", "sm_clock_mhz", "temp_c")}
        row.update(host=host, gpu=gpu + gpu_offset, power_w=power)
        imported.add(row, path, lineno)
        if rec.get("name"):
            imported.names[(host, gpu + gpu_offset)] = rec["name"]
    if "power_w" not in columns:
        imported.notes.append(
            f"{path.name}: power.draw only (a 1 s average on recent GPUs); the instant reading is power.draw.instant"
        )


def assign_smi_gpus(path: Path, recs: list[dict], imported: Imported) -> list[int]:
    if all(r.get("gpu") is not None for r in recs):  # -1 (the range check's error) for an index that is none
        return [int(r["gpu"]) if math.isfinite(r["gpu"]) and r["gpu"] == int(r["gpu"]) else -1 for r in recs]
    if all(r.get("bus_id") for r in recs):
        order = {b: i for i, b in enumerate(sorted({r["bus_id"].lower() for r in recs}))}
        imported.notes.append(f"{path.name}: GPU index from the PCI bus id order (nvidia-smi's default order)")
        return [order[r["bus_id"].lower()] for r in recs]
    gpus, n, short = infer_burst_positions(np.array([r["time"] for r in recs]))
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


# --- DCGM exporter --------------------------------------------------------------------------------

DCGM_FIELDS = {  # metric -> (trace column, scale)
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0),
    "DCGM_FI_DEV_POWER_USAGE_INSTANT": ("power_w_instant", 1.0),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("energy_j", 1e-3),  # mJ
    "DCGM_FI_DEV_GPU_UTIL": ("util_gpu", 1.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("util_mem", 1.0),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1.0),
    "DCGM_FI_DEV_FB_USED": ("mem_used_mib", 1.0),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", 1.0),
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active", 100.0),  # ratios 0..1 -> %
    "DCGM_FI_PROF_SM_OCCUPANCY": ("sm_occupancy", 100.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("tensor_active", 100.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_active", 100.0),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": ("nvlink_tx_bps", 1.0),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": ("nvlink_rx_bps", 1.0),
}
SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(?:\s+(-?\d+))?\s*$")
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
TIME_IN_NAME = re.compile(r"(\d{10}(?:\.\d+)?)")


def comment_time(text: str) -> float | None:
    """`# 2025-07-27T00:34:45Z`, `# 2025-07-27 00:34:45.1`, `# 1753576485.1`, `# time=...` -> unix s."""
    s = text.lstrip("#").strip()
    s = s.split("=", 1)[1].strip() if "=" in s and not s.startswith(("HELP", "TYPE")) else s
    if re.fullmatch(r"\d{9,10}(\.\d+)?", s):
        return float(s)
    try:
        t = dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def read_dcgm(path: Path, imported: Imported, lines: Lines, host: str | None) -> None:
    name_time = TIME_IN_NAME.search(path.name)
    block_time = float(name_time.group(1)) if name_time else None
    samples: dict[tuple, dict] = {}
    first_line: dict[tuple, int] = {}  # the sample's first line, for the range check's file:line
    seen_in_block: set = set()
    block = 0
    with open_log(path) as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                t = comment_time(line)
                if t is not None:
                    block_time, seen_in_block, block = t, set(), block + 1
                continue
            m = SAMPLE.match(line)
            if not m:
                lines.bad(path, lineno, BadLine("line", line, "not a Prometheus sample"))
                continue
            metric, labels, value, stamp = m.group(1), dict(LABEL.findall(m.group(3) or "")), m.group(4), m.group(5)
            if metric not in DCGM_FIELDS:
                continue
            try:
                if "gpu" not in labels:
                    raise BadLine("gpu", m.group(2) or "", "no gpu label")
                gpu = int(labels["gpu"])
                v = float(value)  # Prometheus also writes NaN, +Inf, -Inf: the range check nulls and counts them
                if stamp is not None:
                    t = int(stamp) / 1000.0
                elif block_time is not None:
                    key = (metric, gpu, labels.get("Hostname"))
                    if key in seen_in_block:  # the same series again: the next scrape (no time of its own)
                        raise BadLine("timestamp", line, "a second scrape without a time line before it")
                    seen_in_block.add(key)
                    t = block_time
                else:
                    raise BadLine(
                        "timestamp",
                        line,
                        "no trailing timestamp, no time comment before the scrape, no unix time in the file name",
                    )
            except (BadLine, ValueError) as exc:
                lines.bad(path, lineno, exc if isinstance(exc, BadLine) else BadLine(metric, value))
                continue
            h = host or labels.get("Hostname") or path.stem
            col, scale = DCGM_FIELDS[metric]
            samples.setdefault((h, gpu, t), {})[col] = v * scale
            first_line.setdefault((h, gpu, t), lineno)
            if labels.get("modelName"):
                imported.names[(h, gpu)] = labels["modelName"]
    if not samples:
        raise InputError(f"{path}: no DCGM samples (needs DCGM_FI_DEV_POWER_USAGE lines with a gpu label)")
    for (h, gpu, t), cols in samples.items():
        power = cols.pop("power_w_instant", None)
        if power is not None:
            cols["power_w"] = power
        imported.add(dict(cols, time=t, host=h, gpu=gpu), path, first_line[(h, gpu, t)])


# --- Zeus -----------------------------------------------------------------------------------------

ZEUS_TIME = {"time", "timestamp", "t", "unix_time"}
ZEUS_GPU = re.compile(r"^(?:power[_ ]?)?gpu[_ ]?(\d+)(?:[_ ]?power)?(?:\s*\((m?w)\))?$", re.IGNORECASE)


def read_zeus(path: Path, imported: Imported, lines: Lines, host: str, gpu_index: int) -> None:
    rows = [(i + 1, r) for i, r in enumerate(read_log_rows(path)) if r]
    if not rows:
        raise InputError(f"{path}: empty file")
    header = [c.strip() for c in rows[0][1]]
    lower = [c.lower() for c in header]
    time_col = next((i for i, c in enumerate(lower) if c in ZEUS_TIME), None)
    gpus: dict[int, tuple[int, str]] = {}  # column -> (gpu, the unit of values written without one)
    for i, c in enumerate(header):
        m = ZEUS_GPU.match(c)
        if m:
            gpus[i] = (int(m.group(1)), "mW" if (m.group(2) or "").lower() == "mw" or "mw" in c.lower() else "W")
    if not gpus and "power" in lower:  # legacy zeus_monitor: Time,Power in mW, one GPU per file
        gpus[lower.index("power")] = (gpu_index, "mW")
    if time_col is None or not gpus:
        raise InputError(
            f"{path}: a Zeus power CSV needs a time column ({', '.join(sorted(ZEUS_TIME))}) and "
            f"per-GPU power columns (gpu0, gpu1, ... or Power); found {', '.join(header)}"
        )
    no_samples(path, rows)
    last = rows[-1][0]
    for lineno, cells in rows[1:]:
        try:
            if len(cells) != len(header):
                raise BadLine("line", ",".join(cells), f"{len(cells)} fields, header has {len(header)}")
            t = parse_zeus_time(cells[time_col])
            values = {g: parse_number(header[i], cells[i], "power_w", unit) for i, (g, unit) in gpus.items()}
        except BadLine as exc:
            lines.bad(path, lineno, exc, truncated_final(path, cells, header, exc, lineno == last))
            continue
        for g, v in values.items():
            imported.add({"time": t, "host": host, "gpu": g, "power_w": v}, path, lineno)


def no_samples(path: Path, rows: list) -> None:
    """A header and nothing under it is an error, as for nvidia-smi: an empty trace would pass silently."""
    if len(rows) < 2:
        raise InputError(f"{path}: a header line and no sample lines; import the log once its logger has written")


def parse_zeus_time(text: str) -> float:
    s = text.strip()
    try:
        t = float(s)
    except ValueError:
        pass
    else:
        if not math.isfinite(t):
            raise BadLine("time", text, "expected unix seconds or e.g. 2022-07-13 02:07:36.708783")
        return t
    t = parse_iso_time(s, dt.timezone.utc)
    if t is None:
        raise BadLine("time", text, "expected unix seconds or e.g. 2022-07-13 02:07:36.708783")
    return t


# --- any CSV with a header ------------------------------------------------------------------------

CSV_FIELDS = tuple(TRACE_SCHEMA.names)
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
HEADER_UNIT = re.compile(r"^(.*?)(?:\s*[\[(]([^\])]+)[\])]|[_ ]([A-Za-z%°]+))\s*$")


def parse_columns(spec: str | None) -> dict[str, tuple[str, str]]:
    """`time=ts:ms,power_w=power_mW:mW,gpu=gpu_index` -> {field: (header name, stated unit or '')}."""
    if not spec:
        raise InputError("--from csv needs --columns, e.g. --columns time=timestamp,gpu=gpu_index,power_w=power_W")
    mapping: dict[str, tuple[str, str]] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, eq, column = item.partition("=")
        name, column = name.strip(), column.strip()
        if not eq or not column:
            raise InputError(f"--columns {item!r}: expected FIELD=HEADER[:UNIT], e.g. power_w=power_mW:mW")
        if name not in CSV_FIELDS:
            raise InputError(f"--columns {item!r}: unknown trace field {name!r}; known: {', '.join(CSV_FIELDS)}")
        unit = ""
        if ":" in column:
            column, _, unit = column.rpartition(":")
            column, unit = column.strip(), unit.strip()
            known = TIME_UNITS if name == "time" else UNITS.get(name, {})
            if unit not in known:
                raise InputError(
                    f"--columns {item!r}: unknown unit {unit!r} for {name} (expected "
                    f"{', '.join(sorted(known)) or 'no unit'})"
                )
        if name in mapping:
            raise InputError(f"--columns: {name} mapped twice")
        mapping[name] = (column, unit)
    missing = [n for n in ("time", "power_w") if n not in mapping]
    if missing:
        raise InputError(f"--columns: {' and '.join(missing)} must be mapped, e.g. time=timestamp,power_w=power_W")
    return mapping


def header_unit(name: str, column: str) -> str:
    """The unit a header names for a trace field: `power [mW]`, `power (mW)`, `power_mW`; '' if none known."""
    m = HEADER_UNIT.match(column)
    unit = (m.group(2) or m.group(3) or "").strip() if m else ""
    return unit if unit in UNITS.get(name, {}) else ""


def parse_csv_time(text: str, unit: str, tz) -> float:
    s = text.strip()
    try:
        v = float(s)
    except ValueError:
        t = None if unit else parse_iso_time(s, tz)
    else:
        t = v * TIME_UNITS[unit or "s"] if math.isfinite(v) else None
    if t is None:
        raise BadLine(
            "time",
            text,
            "expected unix seconds" + (f" in {unit}" if unit else " or ISO-8601 such as 2025-09-24T03:41:43.487Z"),
        )
    return t


def read_csv(path: Path, imported: Imported, lines: Lines, host: str, tz, mapping: dict[str, tuple[str, str]]) -> None:
    rows = [(i + 1, r) for i, r in enumerate(read_log_rows(path)) if r and any(c.strip() for c in r)]
    if not rows:
        raise InputError(f"{path}: empty file")
    header = [c.strip() for c in rows[0][1]]
    absent = [c for c, _ in mapping.values() if c not in header]
    if absent:
        raise InputError(
            f"{path}: --columns names {', '.join(map(repr, absent))}, not in the header ({', '.join(header)})"
        )
    cols = {
        name: (header.index(c), unit or ("" if name in ("time", "host") else header_unit(name, c)))
        for name, (c, unit) in mapping.items()
    }
    if "gpu" not in cols:
        imported.notes.append(f"{path.name}: no gpu column mapped: one GPU (index 0)")
    no_samples(path, rows)
    last = rows[-1][0]
    for lineno, cells in rows[1:]:
        try:
            if len(cells) != len(header):
                raise BadLine("line", ",".join(cells), f"{len(cells)} fields, header has {len(header)}")
            row = {"host": host, "gpu": 0}
            for name, (i, unit) in cols.items():
                if name == "time":
                    row["time"] = parse_csv_time(cells[i], unit, tz)
                elif name == "host":
                    row["host"] = cells[i].strip() or host
                elif name == "gpu":
                    g = parse_number(header[i], cells[i], "gpu")
                    if g is None or not math.isfinite(g) or g != int(g):
                        raise BadLine(header[i], cells[i], "not a GPU index")
                    row["gpu"] = int(g)
                else:
                    row[name] = parse_number(header[i], cells[i], name, unit)
        except BadLine as exc:
            field_name = exc.field_name if exc.field_name != "time" else header[cols["time"][0]]
            lines.bad(path, lineno, exc, truncated_final(path, cells, header, BadLine(field_name, ""), lineno == last))
            continue
        imported.add(row, path, lineno)


# --- entry point ----------------------------------------------------------------------------------


def import_trace(
    fmt: str,
    files: list[Path],
    host: str | None = None,
    skip_bad_lines: bool = False,
    fields: list[str] | None = None,
    tz_name: str = "UTC",
    gpu_index: int = 0,
    columns: str | None = None,
) -> tuple[pa.Table, dict]:
    """`columns`: the `--columns` mapping of `--from csv` (FIELD=HEADER[:UNIT],...)."""
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if columns and fmt != "csv":
        raise InputError(f"--columns is for --from csv; --from {fmt} reads its own header")
    mapping = parse_columns(columns) if fmt == "csv" else None
    try:
        tz = ZoneInfo(tz_name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InputError(f"--tz {tz_name!r}: not a time zone name (e.g. UTC, Europe/Berlin)") from None
    imported = Imported()
    lines = Lines(imported, skip_bad_lines)
    for path in map(Path, files):
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        name = host or log_stem(path)
        try:
            if fmt == "nvidia-smi":
                read_nvidia_smi(path, imported, lines, name, tz, fields)
            elif fmt == "dcgm":
                read_dcgm(path, imported, lines, host)
            elif fmt == "csv":
                read_csv(path, imported, lines, name, tz, mapping)
            else:
                read_zeus(path, imported, lines, name, gpu_index)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise InputError(f"{path}: damaged gzip stream ({exc}); re-copy or re-compress the log") from None
    check_ranges(imported, lines)
    if imported.invalid:
        imported.notes.append(
            "values that cannot be readings (NaN, Inf, negative) set to null: "
            + ", ".join(f"{name} {n}" for name, n in sorted(imported.invalid.items()))
        )
    hosts = sorted(set(imported.columns["host"]))
    meta = {
        "source": fmt,
        "files": [os.fspath(f) for f in files],
        "hosts": hosts,
        "gpus": [{"host": h, "index": g, "name": n} for (h, g), n in sorted(imported.names.items())],
        "gpu_index_inferred": imported.index_inferred,
        "skipped_lines": dict(imported.skipped),
        "invalid_values": dict(sorted(imported.invalid.items())),
        "notes": imported.notes,
        "power_source": "imported",
    }
    return imported.table(meta), meta


def write_trace(table: pa.Table, out: Path) -> None:
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp)

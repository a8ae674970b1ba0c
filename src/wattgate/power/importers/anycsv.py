"""Any CSV with a header, its columns mapped to trace fields by `--columns` (FIELD=HEADER[:UNIT],...)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from wattgate.errors import InputError
from wattgate.trace import GPU, HOST, POWER_W, REASONS, TIME, TRACE_SCHEMA
from wattgate.power.importers.common import ReadOptions, sample_rows
from wattgate.power.log_parsing import (
    Imported,
    BadLine,
    Lines,
    LocalTimes,
    UNITS,
    HEADER_CHARS,
    excerpt,
    parse_number,
    parse_iso_time,
    parse_reasons,
    read_log_rows,
)


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
            known = TIME_UNITS if name == TIME else UNITS.get(name, {})
            if unit not in known:
                raise InputError(
                    f"--columns {item!r}: unknown unit {unit!r} for {name} (expected "
                    f"{', '.join(sorted(known)) or 'no unit'})"
                )
        if name in mapping:
            raise InputError(f"--columns: {name} mapped twice")
        mapping[name] = (column, unit)
    missing = [n for n in (TIME, POWER_W) if n not in mapping]
    if missing:
        raise InputError(f"--columns: {' and '.join(missing)} must be mapped, e.g. time=timestamp,power_w=power_W")
    return mapping


def header_unit(name: str, column: str) -> str:
    """The unit a header names for a trace field: `power [mW]`, `power (mW)`, `power_mW`; '' if none known."""
    m = HEADER_UNIT.match(column)
    unit = (m.group(2) or m.group(3) or "").strip() if m else ""
    return unit if unit in UNITS.get(name, {}) else ""


def parse_csv_time(text: str, unit: str, tz, local: LocalTimes | None = None) -> float:
    s = text.strip()
    try:
        v = float(s)
    except ValueError:
        t = None if unit else parse_iso_time(s, tz, local)
    else:
        t = v * TIME_UNITS[unit or "s"] if math.isfinite(v) else None
    if t is None:
        raise BadLine(
            TIME,
            text,
            "expected unix seconds" + (f" in {unit}" if unit else " or ISO-8601 such as 2025-09-24T03:41:43.487Z"),
        )
    return t


def read(path: Path, imported: Imported, lines: Lines, o: ReadOptions) -> None:
    assert o.mapping is not None  # import_trace parses --columns for --from csv (or refuses)
    read_csv(path, imported, lines, o.host, o.tz, o.mapping)


def read_csv(path: Path, imported: Imported, lines: Lines, host: str, tz, mapping: dict[str, tuple[str, str]]) -> None:
    rows = [(i, r) for i, r in read_log_rows(path, lines) if r and any(c.strip() for c in r)]
    if not rows:
        raise InputError(f"{path}: empty file")
    header = [c.strip() for c in rows[0][1]]
    absent = [c for c, _ in mapping.values() if c not in header]
    if absent:
        shown = excerpt(", ".join(header), HEADER_CHARS)
        raise InputError(f"{path}: --columns names {', '.join(map(repr, absent))}, not in the header ({shown})")
    cols = {
        name: (header.index(c), unit or ("" if name in (TIME, HOST) else header_unit(name, c)))
        for name, (c, unit) in mapping.items()
    }
    if GPU not in cols:
        imported.notes.append(f"{path.name}: no gpu column mapped: one GPU (index 0)")
    local = LocalTimes(tz)

    def parse(cells: list[str]) -> dict[str, str | int | float | None]:
        row: dict[str, str | int | float | None] = {HOST: host, GPU: 0}
        for name, (i, unit) in cols.items():
            if name == TIME:
                row[TIME] = parse_csv_time(cells[i], unit, tz, local)
            elif name == HOST:
                row[HOST] = cells[i].strip() or host
            elif name == GPU:
                g = parse_number(header[i], cells[i], GPU)
                if g is None or not math.isfinite(g) or g != int(g):
                    raise BadLine(header[i], cells[i], "not a GPU index")
                row[GPU] = int(g)
            elif name == REASONS:  # a bitmask, decimal or 0x hex
                row[name] = parse_reasons(header[i], cells[i])
            else:
                row[name] = parse_number(header[i], cells[i], name, unit)
        return row

    def as_truncated(exc: BadLine) -> BadLine:
        return BadLine(exc.field_name if exc.field_name != TIME else header[cols[TIME][0]], "")

    for lineno, row in sample_rows(path, rows, header, lines, parse, as_truncated):
        imported.add(row, path, lineno)
    imported.notes.extend(local.note(path))

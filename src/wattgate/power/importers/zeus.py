"""Zeus power CSVs: a time column and one power column per GPU, or the legacy zeus_monitor Time,Power."""

from __future__ import annotations

import datetime as dt
import math
import re
from pathlib import Path

from wattgate.errors import InputError
from wattgate.power.importers.common import ReadOptions, sample_rows
from wattgate.power.log_parsing import (
    Imported,
    BadLine,
    Lines,
    HEADER_CHARS,
    excerpt,
    parse_number,
    parse_iso_time,
    read_log_rows,
)
from wattgate.trace import GPU, HOST, POWER_W, TIME


ZEUS_TIME = {"time", "timestamp", "t", "unix_time"}
ZEUS_GPU = re.compile(r"^(?:power[_ ]?)?gpu[_ ]?(\d+)(?:[_ ]?power)?(?:\s*\((m?w)\))?$", re.IGNORECASE)


def read(path: Path, imported: Imported, lines: Lines, o: ReadOptions) -> None:
    read_zeus(path, imported, lines, o.host, o.gpu_index)


def read_zeus(path: Path, imported: Imported, lines: Lines, host: str, gpu_index: int) -> None:
    rows = [(i, r) for i, r in read_log_rows(path, lines) if r]
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
            f"per-GPU power columns (gpu0, gpu1, ... or Power); found {excerpt(', '.join(header), HEADER_CHARS)}"
        )

    def parse(cells: list[str]) -> tuple[float, dict[int, float | None]]:
        values = {g: parse_number(header[i], cells[i], POWER_W, unit) for i, (g, unit) in gpus.items()}
        return parse_zeus_time(cells[time_col]), values

    for lineno, (t, values) in sample_rows(path, rows, header, lines, parse):
        for g, v in values.items():
            imported.add({TIME: t, HOST: host, GPU: g, POWER_W: v}, path, lineno)


def parse_zeus_time(text: str) -> float:
    s = text.strip()
    try:
        t = float(s)
    except ValueError:
        pass
    else:
        if not math.isfinite(t):
            raise BadLine(TIME, text, "expected unix seconds or e.g. 2022-07-13 02:07:36.708783")
        return t
    t = parse_iso_time(s, dt.timezone.utc)
    if t is None:
        raise BadLine(TIME, text, "expected unix seconds or e.g. 2022-07-13 02:07:36.708783")
    return t

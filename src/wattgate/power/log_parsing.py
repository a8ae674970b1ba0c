"""Reading other collectors' logs line by line, shared by every importer (power/importers.py):
the rows being collected and the bad-line policy, numbers with units kept per value, ISO-8601
times, gzip-compressed logs, and the truncated final line a killed logger leaves."""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import itertools
import os
import time
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from wattgate.errors import InputError
from wattgate.trace import (
    ENERGY_J,
    GPU,
    HOST,
    MEM_USED_MIB,
    POWER_W,
    REASONS,
    SM_CLOCK_MHZ,
    TEMP_C,
    TIME,
    TRACE_SCHEMA,
    UTIL_GPU,
    UTIL_MEM,
    invalid_value,
    reasons_value,
    schema_with_meta,
)

MISSING = {
    "",
    "[n/a]",
    "n/a",
    "[not supported]",
    "not supported",
    "[unknown error]",
    "[gpu is lost]",
    "[insufficient permissions]",
}


@dataclass
class Imported:
    columns: dict[str, list] = field(default_factory=lambda: {n: [] for n in TRACE_SCHEMA.names})
    names: dict[tuple[str, int], str] = field(default_factory=dict)  # (host, gpu) -> device name
    skipped: Counter = field(default_factory=Counter)  # reason -> lines
    invalid: Counter = field(default_factory=Counter)  # column -> values made null by the range check
    notes: list[str] = field(default_factory=list)
    index_inferred: bool = False
    files: list[Path] = field(default_factory=list)  # where each row came from, for file:line errors
    row_file: list[int] = field(default_factory=list)  # index into files
    row_line: list[int] = field(default_factory=list)

    def add(self, row: dict, path: Path | None = None, lineno: int = 0) -> None:
        for name, column in self.columns.items():
            v = row.get(name)
            if v is not None and invalid_value(name, v):
                self.invalid[name] += 1
                v = None
            elif v is not None and name == REASONS:
                v = reasons_value(v)  # the int64 bitmask (a parsed 4.0 is 4)
            column.append(v)
        if path is not None and (not self.files or self.files[-1] != path):
            self.files.append(path)
        self.row_file.append(len(self.files) - 1)
        self.row_line.append(lineno)

    def keep(self, mask: np.ndarray) -> None:
        """Only the rows where `mask` is true (rows that failed a range check, with skip_bad_lines)."""
        for name in self.columns:
            self.columns[name] = list(itertools.compress(self.columns[name], mask))
        self.row_file = list(itertools.compress(self.row_file, mask))
        self.row_line = list(itertools.compress(self.row_line, mask))

    def table(self, meta: dict) -> pa.Table:
        t = pa.Table.from_pydict(self.columns, schema=schema_with_meta(meta))
        return t.sort_by([(HOST, "ascending"), (GPU, "ascending"), (TIME, "ascending")])


EXCERPT_CHARS = 80  # of a value shown in an error line: enough to recognise it, never the whole file
HEADER_CHARS = 300  # of a header line shown in an error line: a long nvidia-smi query list fits


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` for an error line: printable (repr escapes control and binary bytes), cut to `limit` characters."""
    shown = repr(text[: limit + 1])[1:-1]
    return shown if len(text) <= limit else shown[:limit] + f"... ({len(text)} chars)"


class BadLine(Exception):
    def __init__(self, field_name: str, value: str, why: str = ""):
        super().__init__(f"field {field_name!r}: cannot read '{excerpt(value)}'{': ' + why if why else ''}")
        self.field_name = field_name


class Lines:
    """Errors name file:line; with skip_bad_lines they are counted instead."""

    def __init__(self, imported: Imported, skip_bad_lines: bool):
        self.imported, self.skip = imported, skip_bad_lines

    def bad(self, path: Path, lineno: int, exc: Exception, truncated: bool = False) -> None:
        """`truncated`: the file's final line, cut short (a killed logger): dropped and noted, not an error."""
        if truncated:
            self.imported.skipped["truncated_final_line"] += 1
            self.imported.notes.append(f"{path.name}:{lineno}: truncated final line dropped ({exc})")
            return
        if not self.skip:
            raise InputError(f"{path}:{lineno}: {exc} (or pass --skip-bad-lines)") from None
        self.imported.skipped[str(getattr(exc, "field_name", "line"))] += 1


NUMBER = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z%/°]*)\s*$")

POWER_W_AVG = "power_w_avg"  # a log's 1 s power average, before it stands in for power_w (no instant reading)
# unit -> factor to the trace column's unit; case matters (mW is not MW)
POWER_UNITS = {"W": 1.0, "w": 1.0, "mW": 1e-3, "mw": 1e-3, "kW": 1e3, "kw": 1e3}
UNITS = {
    POWER_W: POWER_UNITS,
    POWER_W_AVG: POWER_UNITS,
    ENERGY_J: {"J": 1.0, "j": 1.0, "mJ": 1e-3, "mj": 1e-3, "kJ": 1e3, "kj": 1e3, "Wh": 3600.0, "kWh": 3.6e6},
    UTIL_GPU: {"%": 1.0},
    UTIL_MEM: {"%": 1.0},
    MEM_USED_MIB: {"MiB": 1.0, "KiB": 1 / 1024, "GiB": 1024.0, "B": 1 / 2**20},
    SM_CLOCK_MHZ: {"MHz": 1.0, "kHz": 1e-3, "GHz": 1e3},
    TEMP_C: {"C": 1.0, "°C": 1.0},
    GPU: {},
}


def unit_factor(column: str | None, unit: str, name: str, text: str) -> float:
    if not unit:
        return 1.0
    units = UNITS.get(column or "", {})
    if unit not in units:
        known = ", ".join(sorted(set(units))) or "no unit"
        raise BadLine(name, text, f"unknown unit {unit!r} (expected {known})")
    return units[unit]


HEX = re.compile(r"^\s*0[xX]([0-9a-fA-F]{1,16})\s*$")


def parse_reasons(name: str, text: str) -> int | float | None:
    """A clocks-event reasons bitmask as nvidia-smi (`0x0000000000000004`) or DCGM and others (`4`) write it;
    None for a missing-value marker. A value that is no bitmask (negative, fractional) is left to the range
    check, which nulls and counts it."""
    if text.strip().lower() in MISSING:
        return None
    m = HEX.match(text)
    if m:
        return int(m.group(1), 16)
    v = parse_number(name, text)
    return v


def parse_number(name: str, text: str, column: str | None = None, default_unit: str = "") -> float | None:
    """A number in the trace column's unit: the value's own unit wins, else the column's `default_unit`."""
    if text.strip().lower() in MISSING:
        return None
    m = NUMBER.match(text)
    if not m:
        raise BadLine(name, text, "not a number")
    unit = m.group(2) or default_unit
    return float(m.group(1)) * unit_factor(column, unit, name, text)


class LocalTimes:
    """A log's naive local times -> unix s in `tz`, read in line order. In the hour a DST fall-back repeats,
    a local time names two instants (fold 0 before the change, fold 1 after); a logger writes forward in
    time, so the one nearer the latest time read so far is meant."""

    def __init__(self, tz):
        self.tz = tz
        self.latest: float | None = None
        self.second_pass = 0  # lines placed in the repeated hour's second occurrence

    def timestamp(self, naive: dt.datetime) -> float:
        first = naive.replace(tzinfo=self.tz, fold=0).timestamp()
        second = naive.replace(tzinfo=self.tz, fold=1).timestamp()
        t = first
        # second > first only in a repeated hour (in a spring-forward gap fold 1 is the earlier reading)
        if second > first and self.latest is not None and abs(second - self.latest) < abs(first - self.latest):
            t = second
            self.second_pass += 1
        self.latest = t if self.latest is None else max(self.latest, t)
        return t

    def note(self, path: Path) -> list[str]:
        if not self.second_pass:
            return []
        return [
            f"{path.name}: {self.second_pass} line(s) in the hour repeated when {self.tz} set its clocks back "
            "placed after the change, by line order"
        ]


def parse_iso_time(text: str, tz, local: LocalTimes | None = None) -> float | None:
    """ISO-8601 (`2025-09-24T03:41:43.487Z`, `...+02:00`, `2025/09/24 ...`): its own zone wins, else `tz`
    (through `local`, where given: a naive time in a repeated DST hour is read in line order)."""
    s = text.strip().replace("/", "-")
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    frac = re.match(r"^(.*[.,]\d{6})\d+(.*)$", s)  # nanosecond digits: datetime takes microseconds
    if frac:
        s = frac.group(1) + frac.group(2)
    try:
        t = dt.datetime.fromisoformat(s)
    except ValueError:
        return None
    if t.tzinfo:
        return t.timestamp()
    return local.timestamp(t) if local is not None else t.replace(tzinfo=tz).timestamp()


GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


BINARY_PROBE_BYTES = 4096  # a text log has no NUL byte in its first few KiB; Parquet, images, core dumps do


def check_text(path: Path) -> None:
    """A binary file (a Parquet trace given to --from csv) is refused at once, not read as a garbage header."""
    with gzip.open(path, "rb") if is_gzip(path) else open(path, "rb") as f:
        head = f.read(BINARY_PROBE_BYTES)
    if b"\x00" in head:
        what = "a Parquet file (a wattgate trace needs no import)" if head.startswith(b"PAR1") else "binary data"
        raise InputError(f"{path}: not a text log: {what}; import-trace reads text CSV or DCGM exporter logs")


def open_log(path: Path, newline: str | None = None):
    """A log as text, gzip-compressed or not (loggers' files are often rotated to .gz). utf-8-sig: a byte-order
    mark (what Windows tools write first) is not part of the first header name."""
    check_text(path)
    if is_gzip(path):
        return gzip.open(path, "rt", newline=newline, encoding="utf-8-sig", errors="replace")
    return open(path, newline=newline, encoding="utf-8-sig", errors="replace")


def log_stem(path: Path) -> str:
    """'node7.csv.gz' -> 'node7': the default host name of a log."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return Path(name).stem


def read_log_rows(path: Path, lines: Lines) -> list[tuple[int, list[str]]]:
    """(line number, cells) for every CSV row of a log (gzip or plain); a damaged gzip stream is a one-line
    error. A log's row is one line: a stray '"' that would swallow the lines after it into one field is a bad
    line of its own (`lines`), the lines after it read as they are."""
    try:
        rows = _rows_one_per_line(path)
        return rows if rows is not None else _rows_line_by_line(path, lines)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"{path}: damaged gzip stream ({exc}); re-copy or re-compress the log") from None


def _rows_one_per_line(path: Path) -> list[tuple[int, list[str]]] | None:
    """The fast path, one csv reader over the file; None where a row spans lines or overflows the csv field
    limit (an open quote)."""
    rows = []
    with open_log(path, newline="") as f:
        reader = csv.reader(f, skipinitialspace=True)
        try:
            for cells in reader:
                lineno = len(rows) + 1
                if reader.line_num != lineno:
                    return None
                rows.append((lineno, cells))
        except csv.Error:
            return None
    return rows


def _rows_line_by_line(path: Path, lines: Lines) -> list[tuple[int, list[str]]]:
    rows = []
    with open_log(path, newline="") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                rows.append((lineno, next(csv.reader([line], skipinitialspace=True, strict=True), [])))
            except csv.Error as exc:
                lines.bad(path, lineno, BadLine("line", line.rstrip("\r\n"), f"{exc} (a stray '\"' quote?)"))
    return rows


def ends_mid_line(path: Path) -> bool:
    """The file's last line has no line end: the writer stopped mid-line."""
    if is_gzip(path):
        with gzip.open(path, "rb") as g:
            data = g.read()
        return bool(data) and data[-1:] not in (b"\n", b"\r")
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) not in (b"\n", b"\r")


def truncated_final(path: Path, cells: list[str], header: list[str], exc: BadLine, final: bool) -> bool:
    """The last line of a killed logger: fewer fields than the header, or, with no line end, its last field
    unreadable (a number or unit cut off). A complete bad last line is still a bad line."""
    if not final:
        return False
    return len(cells) < len(header) or (
        len(cells) == len(header) and exc.field_name == header[-1] and ends_mid_line(path)
    )


# ---------------------------------------------------------------- times and GPU indexes no log can hold

EARLIEST_S = 0.0  # unix seconds; logs with times from their own start (0, 0.1, ...) are fine
FUTURE_SLACK_S = 86400.0  # hosts' clocks disagree a little; a day ahead of this one is a broken clock
FAR_FROM_REST_S = 30 * 86400.0  # a sample this far from its file's median time (and ...
FAR_SPREADS = 20.0  # ... this many robust spreads of the file's times) is a clock jump, not a sample
MAX_GPU_INDEX = 1023  # NVML and DCGM number a node's GPUs from 0; nothing has a thousand per host


def _far_from_rest(t: np.ndarray) -> np.ndarray:
    """Samples far from their file's other samples: the median and median absolute deviation ignore a few
    wild times (0, -1e12, a year ahead) that would stretch the trace over a span nobody sampled."""
    median = float(np.median(t))
    spread = float(np.median(np.abs(t - median)))
    return np.abs(t - median) > max(FAR_FROM_REST_S, FAR_SPREADS * spread)


def _iso(t: float) -> str:
    try:
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return "no date"


def check_ranges(imported: Imported, lines: Lines) -> None:
    """Every row's time and GPU index within what a log can hold: an error naming file:line (with
    skip_bad_lines, dropped and counted as `time_out_of_range` / `gpu_out_of_range`)."""
    if not imported.row_file:
        return
    t = np.asarray(imported.columns[TIME], np.float64)
    gpu = np.asarray([-1 if g is None else g for g in imported.columns[GPU]], np.float64)
    where = np.asarray(imported.row_file, np.int64)
    bad_time = ~np.isfinite(t) | (t < EARLIEST_S) | (t > time.time() + FUTURE_SLACK_S)
    for f in np.unique(where):
        mine = np.flatnonzero((where == f) & ~bad_time)
        if len(mine) > 2:
            bad_time[mine[_far_from_rest(t[mine])]] = True
    bad_gpu = (gpu < 0) | (gpu > MAX_GPU_INDEX)
    bad = bad_time | bad_gpu
    if not bad.any():
        return
    if not lines.skip:
        i = int(np.flatnonzero(bad)[0])
        path, lineno = imported.files[imported.row_file[i]], imported.row_line[i]
        if bad_time[i]:
            shown = np.format_float_positional(t[i], trim="-")
            what = f"time {shown} ({_iso(t[i])}) is {_time_problem(t[i], t[where == where[i]])}"
        else:
            what = f"GPU index {imported.columns['gpu'][i]} is outside 0..{MAX_GPU_INDEX}"
        raise InputError(f"{path}:{lineno}: {what}; fix or delete that line (or pass --skip-bad-lines)")
    imported.skipped["time_out_of_range"] += int(bad_time.sum())
    imported.skipped["gpu_out_of_range"] += int((bad_gpu & ~bad_time).sum())
    imported.keep(~bad)


def _time_problem(t: float, same_file: np.ndarray) -> str:
    if t < EARLIEST_S:
        return "before 1970"
    if t > time.time() + FUTURE_SLACK_S:
        return "in the future"
    return (
        f"{abs(t - float(np.median(same_file))) / 86400:.0f} days from the file's other samples "
        "(a clock jump: a trace would span time nobody sampled)"
    )

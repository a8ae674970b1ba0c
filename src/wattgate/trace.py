"""The telemetry trace contract: schema, a crash-safe writer, and a reader.

A Parquet file is unreadable until its footer is written, so a sampler that
is SIGKILLed mid-file would lose everything. The writer therefore publishes
complete small Parquet segments every `flush_every_s` (atomic renames) into a
hidden folder beside the final file, merges them into bigger ones as they
pile up, and on a clean stop writes `<host>.parquet` (large row groups) and
removes the segments. A killed sampler leaves only segments; every reader here
accepts either, and the watcher reads the live segments during a run.

Range check: power, energy and the other measured columns cannot be NaN or
+-Inf, nor negative (temperature excepted), and power not above MAX_POWER_W. `read_trace` turns such values into
null and adds their count per column to the metadata's `invalid_values`, so
no stage downstream averages an infinity into a report, and JSON written from
a trace stays strict JSON (`strict_json`: non-finite floats become null).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path, check_file_output, json_safe
from wattgate.errors import InputError
from wattgate.records.base import Where
from wattgate.records.trace_meta import TraceMeta

# The trace's column names (readers index a trace frame or table by these, never by the string)
TIME = "time"
HOST = "host"
GPU = "gpu"
POWER_W = "power_w"
ENERGY_J = "energy_j"
UTIL_GPU = "util_gpu"
UTIL_MEM = "util_mem"
SM_CLOCK_MHZ = "sm_clock_mhz"
MEM_USED_MIB = "mem_used_mib"
TEMP_C = "temp_c"
SM_ACTIVE = "sm_active"
SM_OCCUPANCY = "sm_occupancy"
TENSOR_ACTIVE = "tensor_active"
DRAM_ACTIVE = "dram_active"
NVLINK_TX_BPS = "nvlink_tx_bps"
NVLINK_RX_BPS = "nvlink_rx_bps"
CLOCKS_EVENT_REASONS = "clocks_event_reasons"

TRACE_COLUMNS = [
    (TIME, pa.float64()),
    (HOST, pa.string()),
    (GPU, pa.int32()),
    (POWER_W, pa.float32()),
    (ENERGY_J, pa.float64()),
    (UTIL_GPU, pa.float32()),
    (UTIL_MEM, pa.float32()),
    (SM_CLOCK_MHZ, pa.float32()),
    (MEM_USED_MIB, pa.float32()),
    (TEMP_C, pa.float32()),
]
# Hopper-and-newer GPM metrics (percent, and bytes/s for NVLink); null where not available
EXTRA_COLUMNS = [
    (SM_ACTIVE, pa.float32()),
    (SM_OCCUPANCY, pa.float32()),
    (TENSOR_ACTIVE, pa.float32()),
    (DRAM_ACTIVE, pa.float32()),
    (NVLINK_TX_BPS, pa.float64()),
    (NVLINK_RX_BPS, pa.float64()),
    # NVML's clocks-event reasons (formerly "throttle reasons"): why the SM clock is below its maximum, a bitmask
    # read on the sampler's slow path; null where not recorded (older traces, logs that lack it)
    (CLOCKS_EVENT_REASONS, pa.int64()),
]
TRACE_SCHEMA = pa.schema(TRACE_COLUMNS + EXTRA_COLUMNS)
META_KEY = b"wattgate.trace"
SEGMENT_DIR_SUFFIX = ".segments"
_SEGMENT = re.compile(r"^seg-(\d{10})-(\d{10})\.parquet$")
FINAL_ROW_GROUP = 1 << 20


# measured columns the range check covers; all but temperature must be >= 0
MEASURED = [name for name, typ in TRACE_COLUMNS + EXTRA_COLUMNS if pa.types.is_floating(typ) and name != TIME]
MAY_BE_NEGATIVE = {TEMP_C}
FLOAT32_MAX = 3.4028234663852886e38
# One GPU's board power: the largest accelerators draw ~1.4 kW (GB300), so 5 kW is generous headroom for
# parts to come; a reading above it is a damaged value or a unit slip (mW read as W), never a reading.
MAX_POWER_W = 5000.0
UPPER_BOUNDS = {POWER_W: MAX_POWER_W}  # column -> the largest value a reading can have

REASONS = CLOCKS_EVENT_REASONS
# the clocks-event reason bits (nvml.h nvmlClocksEventReason*, the same values as the older ThrottleReason*),
# by the names nvidia-smi gives them as `clocks_event_reasons.<name>` (formerly `clocks_throttle_reasons.<name>`)
REASON_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
# what slows a GPU down, by the bits that say so (HW slowdown is also set beside a HW thermal or power-brake
# slowdown: the more specific cause wins, in this order)
REASON_CAUSES = {"thermal": 0x20 | 0x40, "power_cap": 0x4, "hw_slowdown": 0x8 | 0x80}
MAX_REASONS = (1 << 63) - 1  # an int64 bitmask: a negative or larger value is no reading


def reasons_value(v) -> int | None:
    """A clocks-event reasons reading as the int bitmask, or None when it cannot be one (negative, fractional,
    not finite, beyond int64)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return v if 0 <= v <= MAX_REASONS else None
    if not math.isfinite(f) or f < 0 or f != int(f) or f >= 2.0**63:
        return None
    return int(f)


def invalid_value(name: str, v) -> bool:
    """True for a value of a measured column that cannot be a reading (NaN, +-Inf, negative, above its
    UPPER_BOUNDS, float32 overflow; a reasons bitmask that is no whole number in int64's range)."""
    if name == REASONS:
        return reasons_value(v) is None
    if name not in MEASURED:
        return False
    v = float(v)
    if not math.isfinite(v) or (v < 0 and name not in MAY_BE_NEGATIVE) or v > UPPER_BOUNDS.get(name, math.inf):
        return True
    return TRACE_SCHEMA.field(name).type == pa.float32() and abs(v) > FLOAT32_MAX


def strict_json(obj, **kwargs) -> str:
    """json.dumps that never writes NaN/Infinity (not JSON): they become null, deliberately."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def empty_columns() -> dict[str, list]:
    return {name: [] for name in TRACE_SCHEMA.names}


def schema_with_meta(meta: dict) -> pa.Schema:
    return TRACE_SCHEMA.with_metadata({META_KEY: strict_json(meta, sort_keys=True).encode()})


def segment_dir(path: Path) -> Path:
    return path.parent / f".{path.name}{SEGMENT_DIR_SUFFIX}"


def expand_host(path: str | os.PathLike, host: str | None = None) -> Path:
    """`telemetry/{host}.parquet` -> this node's file (one sampler per node under Slurm)."""
    return Path(str(path).replace("{host}", host or socket.gethostname()))


class TraceWriter:
    """Buffer rows; publish a complete segment every flush; merge into the final file on close."""

    def __init__(self, path: str | os.PathLike, meta: dict, flush_every_s: float = 2.0, merge_every: int = 32):
        self.path = Path(path)
        self.meta = meta
        self.schema = schema_with_meta(meta)
        self.flush_every_s = flush_every_s
        self.merge_every = merge_every
        self.segments = segment_dir(self.path)
        if self.segments.exists():  # leftovers of a killed sampler on this path: start clean
            shutil.rmtree(self.segments)
        self.segments.mkdir(parents=True)
        self.buffer = empty_columns()
        self.next_seq = 0
        self.small: list[Path] = []
        self.last_flush = time.monotonic()
        self.rows = 0

    def add(self, row: dict) -> None:
        for name, column in self.buffer.items():
            column.append(row.get(name))
        if time.monotonic() - self.last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        n = len(self.buffer[TIME])
        if n == 0:
            return
        table = pa.Table.from_pydict(self.buffer, schema=self.schema)
        self.buffer = empty_columns()
        seq = self.next_seq
        self.next_seq += 1
        self.rows += n
        dest = self.segments / f"seg-{seq:010d}-{seq:010d}.parquet"
        with atomic_path(dest) as tmp:
            pq.write_table(table, tmp)
        self.small.append(dest)
        if len(self.small) >= self.merge_every:
            self._merge_small()

    def _merge_small(self) -> None:
        """One segment covering the small ones' range; readers skip segments a wider one covers."""
        first, last = _segment_range(self.small[0])[0], _segment_range(self.small[-1])[1]
        dest = self.segments / f"seg-{first:010d}-{last:010d}.parquet"
        with atomic_path(dest) as tmp:
            pq.write_table(pa.concat_tables(pq.read_table(p) for p in self.small), tmp)
        for p in self.small:
            p.unlink()
        self.small = []

    def close(self) -> Path:
        """Write the final trace (an empty one with the schema if no rows) and drop the segments."""
        self.flush()
        with atomic_path(self.path) as tmp:
            with pq.ParquetWriter(tmp, self.schema) as writer:
                table = read_segments(self.segments, self.schema)
                writer.write_table(table, row_group_size=FINAL_ROW_GROUP)
        shutil.rmtree(self.segments)
        return self.path


def _segment_range(path: Path) -> tuple[int, int]:
    m = _SEGMENT.match(path.name)
    assert m is not None  # a segment's name: written by flush or _merge_small, or matched by live_segments
    return int(m.group(1)), int(m.group(2))


def live_segments(folder: Path) -> list[Path]:
    """Segments not covered by a wider merged one, in time order (a merge may be mid-way)."""
    segs = sorted((_segment_range(p), p) for p in folder.glob("seg-*.parquet") if _SEGMENT.match(p.name))
    keep = []
    for (a, b), p in segs:
        if any(a2 <= a and b <= b2 and (a2, b2) != (a, b) for (a2, b2), _ in segs):
            continue
        keep.append(p)
    return keep


def read_segments(folder: Path, schema: pa.Schema = TRACE_SCHEMA, since_seq: int = 0) -> pa.Table:
    """The live segments' rows as `schema`. A segment is published by an atomic rename, so one that is there
    but unreadable is damaged (an InputError naming it: dropping it would lose its span's energy silently);
    one that vanished after the listing was merged away, its rows in the wider segment."""
    tables = []
    for p in live_segments(folder):
        if _segment_range(p)[1] < since_seq:
            continue
        try:
            table = pq.read_table(p)
        except (OSError, pa.ArrowInvalid) as exc:
            if not p.exists():
                continue
            why = str(exc).splitlines()[0].replace(f" '{p}'", "")  # pyarrow names the file again
            raise InputError(
                f"{p}: damaged trace segment ({why}); move it aside to read the other segments (its samples are lost)"
            ) from None
        tables.append(_conformed(p, table, schema))
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def _conformed(path: Path, table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A segment as `schema`: the trace columns it must have, an optional one it lacks (a sampler without GPM)
    all null, each cast to the schema's type."""
    _check_columns(path, table.column_names)
    for f in schema:
        if f.name not in table.column_names:
            table = table.append_column(pa.field(f.name, f.type), pa.nulls(len(table), f.type))
    return pa.Table.from_arrays([_cast(path, table, f) for f in schema], schema=schema)


def is_trace_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a Parquet file carrying wattgate's trace metadata (a sampler's or import-trace's)."""
    try:
        return META_KEY in (pq.read_schema(path).metadata or {})
    except (OSError, pa.ArrowException):
        return False


def check_trace_output(path: str | os.PathLike, stage: str) -> None:
    """Refuse (InputError) a trace --out that holds a file other than a wattgate trace (artifacts.check_file_output)."""
    check_file_output(path, stage, is_trace_file)


# metadata keys the stages read, and the JSON type each must have (a trace may carry others)
META_TYPES = {"gpus": list, "hosts": list, "files": list, "notes": list, "invalid_values": dict, "skipped_lines": dict}
GPU_META_TYPES = {"index": int, "power_limit_w": (int, float)}  # per entry of `gpus`; name, uuid: any value


def trace_meta(table_or_schema, path: str | os.PathLike | None = None) -> TraceMeta:
    """The `wattgate.trace` metadata (an empty record if none), its shape checked so no stage meets a list where
    it reads a dict: damaged metadata is an InputError naming `path` (where the caller knows it)."""
    meta = _meta_mapping(table_or_schema, path)
    return TraceMeta.from_json(meta, Where(str(path) if path is not None else "trace metadata"))


def _meta_mapping(table_or_schema, path: str | os.PathLike | None = None) -> dict:
    """trace_meta's mapping, as written (every key kept: a reader that rewrites it loses none)."""
    schema = table_or_schema.schema if hasattr(table_or_schema, "schema") else table_or_schema
    raw = (schema.metadata or {}).get(META_KEY)
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = f"not JSON: {exc}"
    else:
        problem = _meta_problem(meta)
        if not problem:
            return meta
    where = f"{path}: " if path is not None else ""
    raise InputError(
        f"{where}not a wattgate trace: damaged metadata under {META_KEY.decode()!r} ({problem}); "
        "re-import the log with `wattgate import-trace` or sample again"
    )


def _meta_problem(meta) -> str:
    """What is wrong with the shape of decoded trace metadata, '' if nothing."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    for key, typ in META_TYPES.items():
        if key in meta and meta[key] is not None and not isinstance(meta[key], typ):
            return f"{key!r} is a {type(meta[key]).__name__}, not a {typ.__name__}"
    for i, gpu in enumerate(meta.get("gpus") or []):
        if not isinstance(gpu, dict):
            return f"gpus[{i}] is a {type(gpu).__name__}, not an object"
        for key, typ in GPU_META_TYPES.items():
            v = gpu.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, typ)):
                return f"gpus[{i}].{key} is {v!r}, not a number"
    for key in ("invalid_values", "skipped_lines"):
        counts = meta.get(key) or {}
        bad = next((k for k, n in counts.items() if isinstance(n, bool) or not isinstance(n, int)), None)
        if bad is not None:
            return f"{key}[{bad!r}] is {counts[bad]!r}, not a count"
    return ""


def read_trace(path: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """A finished trace, or the segments a killed sampler left beside its path.

    columns: read only these (in this order; the range check and the casts cover only them), host as a
    dictionary column (read that way, never re-encoded), the metadata still the file's. A trace lacking one
    of the TRACE_COLUMNS is refused either way; an optional column it lacks comes back all null."""
    path = Path(path)
    if columns is not None:
        return _read_columns(path, list(columns))
    segs = segment_dir(path)
    if path.is_file():
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise InputError(f"{path}: not a readable Parquet trace ({exc})") from None
    elif segs.is_dir():
        table = read_segments(segs)
        first = next(iter(live_segments(segs)), None)
        if first is not None:
            table = table.replace_schema_metadata(pq.read_schema(first).metadata)
    else:
        raise InputError(f"{path}: no such trace (and no segments of a killed sampler beside it)")
    _check_columns(path, table.column_names)
    trace_meta(table, path)  # damaged metadata is refused here, naming the file, not deep in a stage
    for name, typ in EXTRA_COLUMNS:  # older or foreign traces may lack the optional columns
        if name not in table.column_names:
            table = table.append_column(pa.field(name, typ), pa.nulls(len(table), typ))
    meta = table.schema.metadata
    table = table.select(TRACE_SCHEMA.names)
    columns = [_cast(path, table, f) for f in TRACE_SCHEMA]
    table = pa.Table.from_arrays(columns, schema=TRACE_SCHEMA)
    return _checked(table, meta, path)


def _check_columns(path: Path, names: list[str]) -> None:
    missing = [n for n, _ in TRACE_COLUMNS if n not in names]
    if missing:
        raise InputError(
            f"{path}: not a wattgate trace: missing column(s) {', '.join(missing)}; "
            "convert other collectors' logs with `wattgate import-trace`"
        )


def _cast(path: Path, table: pa.Table, f: pa.Field, keep_dictionary: bool = False) -> pa.ChunkedArray:
    """Column f of table as the trace schema's type (with keep_dictionary, a dictionary column keeps its
    codes and gets string values)."""
    col = table.column(f.name)
    target = f.type
    if keep_dictionary and pa.types.is_dictionary(col.type) and pa.types.is_string(f.type):
        target = pa.dictionary(col.type.index_type, pa.string())
    if col.type == target:
        return col
    try:
        return col.cast(target)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        have = table.schema.field(f.name).type
        what = "unix seconds" if f.name == TIME else f"a {f.type} value"
        raise InputError(
            f"{path}: column {f.name!r} is {have} and cannot be read as {f.type} "
            f"({str(exc).splitlines()[0]}); it must hold {what}: convert other collectors' logs "
            "with `wattgate import-trace`"
        ) from None


def _read_columns(path: Path, columns: list[str]) -> pa.Table:
    """read_trace(path, columns): only those columns read, cast and range-checked; host as a dictionary."""
    unknown = [c for c in columns if c not in TRACE_SCHEMA.names]
    if unknown:
        raise ValueError(f"not trace columns: {', '.join(unknown)}")
    if path.is_file():
        try:
            schema = pq.read_schema(path)
            have = [c for c in columns if c in schema.names]
            table = pq.read_table(path, columns=have, read_dictionary=[HOST] if HOST in have else None)
        except (OSError, pa.ArrowInvalid) as exc:
            raise InputError(f"{path}: not a readable Parquet trace ({exc})") from None
        _check_columns(path, schema.names)
        trace_meta(schema, path)
        meta = schema.metadata
    else:  # a killed sampler's segments (or nothing): the full reader stitches them
        table = read_trace(path)
        meta = table.schema.metadata
        table = table.select(columns)
        if HOST in columns:  # as a file's is read: a dictionary column
            i = table.schema.get_field_index(HOST)
            table = table.set_column(i, HOST, pc.dictionary_encode(table.column(HOST)))
    for name in columns:
        if name not in table.column_names:  # an optional column the trace lacks
            typ = TRACE_SCHEMA.field(name).type
            table = table.append_column(pa.field(name, typ), pa.nulls(len(table), typ))
    table = table.select(columns)
    out = [_cast(path, table, TRACE_SCHEMA.field(c), keep_dictionary=True) for c in columns]
    table = pa.Table.from_arrays(out, names=columns)
    return _checked(table, meta, path)


def read_trace_chunks(
    path: str | os.PathLike, columns: list[str], rows: int, deferred: Sequence[str] = ()
) -> tuple[TraceMeta, Iterator]:
    """read_trace(path, columns) a batch of at most `rows` rows at a time, for a reader that reduces them as
    they come: (the trace's metadata, an iterator of record batches cast as read_trace casts them). The range
    check is the reader's to do (NaN, infinite or negative readings are not readings). A killed sampler's
    segments are stitched whole when the batches are first asked for; the metadata is the first segment's,
    as read_trace gives it.

    `deferred` columns (of `columns`) are not decoded with the batches of a Parquet file: each item is then
    (batch, fetch), fetch() reading those columns of the same rows (a record batch cast the same way), for a
    reader that needs them for a few batches only. Stitched segments give whole batches, as without it."""
    path = Path(path)
    if not path.is_file():
        first = next(iter(live_segments(segment_dir(path))), None) if segment_dir(path).is_dir() else None
        if first is None:  # no trace and no segments: read_trace says so (or gives the empty trace)
            table = read_trace(path, columns=columns)
            return trace_meta(table, path), iter(table.to_batches(max_chunksize=rows))

        def stitched():
            yield from read_trace(path, columns=columns).to_batches(max_chunksize=rows)

        return trace_meta(pq.read_schema(first), path), stitched()
    pf = _open_trace(path, columns)
    now = [c for c in columns if c not in deferred]
    later = [c for c in columns if c in deferred]
    have = [c for c in now if c in pf.schema_arrow.names]

    def batches():
        try:
            # the columns one after another on the thread that asks: a reader that reduces the batches as they
            # come reads on a thread of its own already (power/triage/windows.py), and Arrow's pool on top cost
            # more CPU time than it saved
            at = 0
            for batch in pf.iter_batches(batch_size=rows, columns=have, use_threads=False):
                out = _cast_batch(path, batch, now)
                yield (out, functools.partial(_trace_rows, path, later, at, at + batch.num_rows)) if later else out
                at += batch.num_rows
        except (OSError, pa.ArrowInvalid) as exc:
            raise InputError(f"{path}: not a readable Parquet trace ({exc})") from None

    meta = trace_meta(pf.schema_arrow, path)
    return meta, batches()


def _open_trace(path: Path, columns: list[str]) -> pq.ParquetFile:
    try:
        # mapped, not read into buffers of its own: the row groups are decoded straight from the page cache
        pf = pq.ParquetFile(path, read_dictionary=[HOST] if HOST in columns else None, memory_map=True)
    except (OSError, pa.ArrowInvalid) as exc:
        raise InputError(f"{path}: not a readable Parquet trace ({exc})") from None
    _check_columns(path, pf.schema_arrow.names)
    return pf


def _cast_batch(path: Path, batch: pa.RecordBatch, columns: list[str]) -> pa.RecordBatch:
    """A batch read from a trace with `columns` as the trace schema's types (an optional column the trace lacks:
    nulls)."""
    for name in columns:
        if name not in batch.schema.names:
            typ = TRACE_SCHEMA.field(name).type
            batch = batch.append_column(pa.field(name, typ), pa.nulls(batch.num_rows, typ))
    cast = [_cast(path, batch, TRACE_SCHEMA.field(c), keep_dictionary=True) for c in columns]
    return pa.RecordBatch.from_arrays(cast, names=columns)


def _trace_rows(path: Path, columns: list[str], start: int, stop: int) -> pa.RecordBatch:
    """Rows [start, stop) of a Parquet trace's `columns`, as read_trace_chunks gives them: only the row groups
    that hold them are decoded."""
    try:
        pf = _open_trace(path, columns)
        have = [c for c in columns if c in pf.schema_arrow.names]
        if not have:  # none of them in the trace: every row null
            return _cast_batch(path, pa.RecordBatch.from_pydict({"_": pa.nulls(stop - start)}), columns)
        meta = pf.metadata
        bounds = list(itertools.accumulate((meta.row_group(i).num_rows for i in range(meta.num_row_groups)), initial=0))
        first = bisect.bisect_right(bounds, start) - 1
        last = max(bisect.bisect_left(bounds, stop) - 1, first)
        table = pf.read_row_groups(list(range(first, last + 1)), columns=have, use_threads=False)
    except (OSError, pa.ArrowInvalid) as exc:
        raise InputError(f"{path}: not a readable Parquet trace ({exc})") from None
    (batch,) = table.slice(start - bounds[first], stop - start).combine_chunks().to_batches()
    return _cast_batch(path, batch, columns)


def _checked(table: pa.Table, meta, path: Path) -> pa.Table:
    """Range-check the measured columns, count what was nulled into the metadata's invalid_values."""
    table, invalid = null_invalid_values(table)
    if invalid:
        info = _meta_mapping(pa.schema([], metadata=meta), path)  # every key kept
        counts = dict(trace_meta(pa.schema([], metadata=meta), path).invalid_values or {})
        for name, n in invalid.items():
            counts[name] = counts.get(name, 0) + n
        info = info | {"invalid_values": dict(sorted(counts.items()))}
        meta = dict(meta or {})
        meta[META_KEY] = strict_json(info, sort_keys=True).encode()
    return table.replace_schema_metadata(meta)


def null_invalid_values(table: pa.Table) -> tuple[pa.Table, dict[str, int]]:
    """Measured columns with NaN, +-Inf, negative or above-bound values -> null there, and the count per column.

    Works on any subset of the trace columns (e.g. a reader that loads only time, host, gpu, power_w)."""
    counts = {}
    if REASONS in table.column_names and pa.types.is_signed_integer(table.schema.field(REASONS).type):
        col = table.column(REASONS)
        bad = pc.sum(pc.less(col, 0)).as_py() or 0  # a bitmask is never negative
        if bad:
            counts[REASONS] = int(bad)
            i = table.schema.get_field_index(REASONS)
            keep = pc.greater_equal(col, 0)
            table = table.set_column(i, table.schema.field(i), pc.if_else(keep, col, pa.scalar(None, col.type)))
    for name in MEASURED:
        if name not in table.column_names:
            continue
        col = table.column(name)
        if col.null_count == len(col):
            continue
        # a reading is finite and (but for temperature) >= 0, and within its upper bound; NaN compares false,
        # nulls stay null
        ok = pc.is_finite(col) if name in MAY_BE_NEGATIVE else pc.and_(pc.greater_equal(col, 0), pc.is_finite(col))
        if name in UPPER_BOUNDS:
            ok = pc.and_(ok, pc.less_equal(col, UPPER_BOUNDS[name]))
        n = len(col) - col.null_count - (pc.sum(ok).as_py() or 0)
        if n:
            counts[name] = int(n)
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), pc.if_else(ok, col, pa.scalar(None, col.type)))
    return table, counts


def trace_files(folder: str | os.PathLike) -> list[Path]:
    """Every node's trace in a telemetry folder: finished files and killed samplers' segments."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = {p for p in folder.glob("*.parquet")}
    for segs in folder.glob(f".*.parquet{SEGMENT_DIR_SUFFIX}"):
        found.add(folder / segs.name[1 : -len(SEGMENT_DIR_SUFFIX)])
    return sorted(found)

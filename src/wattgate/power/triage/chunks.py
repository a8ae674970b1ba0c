"""A trace's chunk (a row group) reduced as it is read: its usable rows (time, GPU, power, utilization, the
energy counter, the straggler cause columns), their sums per (GPU, window) cell, and where those cells land in
the GPU-major windows (windows.py holds the windows themselves).

A chunk in the sampler's layout (one time per tick, every GPU's row in one order) is reduced by runs of ticks
(ticks.py); any other by a cell index per sample. Only each sample's power and cell stay, in the general layout,
until the GPUs' levels are known (the bands count samples against them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from wattgate.codes import column_codes
from wattgate.errors import InputError
from wattgate.power import energy as energy_mod
from wattgate.power.triage import causes as causes_mod
from wattgate.power.triage import ticks as ticks_mod
from wattgate.trace import ENERGY_J, GPU, HOST, POWER_W, TIME, TRACE_SCHEMA, UPPER_BOUNDS, UTIL_GPU

CHUNK_ROWS = 1 << 20  # rows reduced at once (the sampler's row group): temporaries stay small and reused

NEEDED = (TIME, HOST, GPU, POWER_W, UTIL_GPU)


# ---------------------------------------------------------------- rows, a chunk at a time


@dataclass
class _Rows:
    """One chunk's usable rows (with a GPU and a finite time) as numpy columns."""

    ids: np.ndarray  # GPU id (_GpuIds, in order of first sight) per row; in the sampler's layout one tick's (head)
    time: np.ndarray  # float64
    power: np.ndarray  # float32, NaN = missing or out of range
    util: np.ndarray  # float32, NaN = missing or out of range
    counter: pa.Array | np.ndarray | None  # the energy counter as read (nulls: none) until asked for; None: no reading
    ngpu: int  # distinct ids in the chunk
    signals: tuple[bool, bool]  # any power, any utilization reading
    causes: dict | None = None  # SM clock, temperature, reasons (causes.chunk_columns); None: none of them
    period: int = 0  # k: the rows are ticks of the same k GPUs in one order (the sampler's layout); 0: not
    shared: bool = False  # ... and share one time per tick, in time order, no power missing (ticks.shared_times)
    fetch_causes: Callable[[], pa.RecordBatch] | None = None  # the cause columns, not read yet (a shared chunk)

    @property
    def energy(self) -> np.ndarray | None:
        """float64 counter readings per row, NaN = none (or not a reading); None: no reading in the chunk."""
        if isinstance(self.counter, pa.Array):
            self.counter = _numbers(self.counter, np.float64, True)
        return self.counter

    def counter_readings(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(row, value) of each counter reading, in row order, without a column of a million NaNs (a chunk in the
        tick layout needs only these); None: no reading in the chunk."""
        col = self.counter
        if col is None:
            return None
        if not isinstance(col, pa.Array):
            at = np.flatnonzero(np.isfinite(col))
            return at, col[at]
        at = pc.indices_nonzero(col.is_valid()).to_numpy().astype(np.int64)
        value = _numbers(col.drop_null(), np.float64, True)  # NaN where energy would read NaN: not a reading
        keep = ~np.isnan(value)
        return (at, value) if keep.all() else (at[keep], value[keep])

    @property
    def head(self) -> np.ndarray:
        """The GPU ids of one tick, in the sampler's layout."""
        return self.ids[: self.period]

    @property
    def gid(self) -> np.ndarray:
        """Every row's GPU id; in the sampler's layout the first tick's repeated, made when first asked for (the
        tick-layout reductions need only the head)."""
        if len(self.ids) != len(self.time):
            self.ids = np.tile(self.ids, len(self.time) // len(self.ids))
        return self.ids


class _GpuIds:
    """(host, gpu) -> an id, in the order first seen; sorted() orders them once all rows are in."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self._id: dict[tuple[str, int], int] = {}

    def of(self, hosts: list[str], host_code: np.ndarray, gpu: np.ndarray) -> tuple[np.ndarray, int]:
        """(the id of every row, ids present) from host codes into `hosts` and GPU indexes (>= 0)."""
        width = int(gpu.max()) + 1
        if len(hosts) == 1:  # one host per file: the GPU is the key
            pair = gpu
        elif len(hosts) * width < 1 << 31:
            pair = host_code * width + gpu
        else:
            pair = host_code.astype(np.int64) * width + gpu
        if len(hosts) * width <= 1 << 20:  # the usual case: a lookup table is faster than a sort
            present = np.flatnonzero(np.bincount(pair, minlength=len(hosts) * width))
            lut = np.zeros(len(hosts) * width, np.int32)
            lut[present] = [self._key_id(hosts[k // width], k % width) for k in present]
            return lut[pair], len(present)
        present, inverse = np.unique(pair, return_inverse=True)  # odd GPU indexes in a foreign trace
        ids = np.array([self._key_id(hosts[k // width], k % width) for k in present], np.int32)
        return ids[inverse], len(present)

    def _key_id(self, host: str, gpu) -> int:
        key = (host, int(gpu))
        if key not in self._id:
            self._id[key] = len(self.seen)
            self.seen.append(key)
        return self._id[key]

    def sorted(self) -> tuple[list[tuple[str, int]], np.ndarray]:
        """(keys sorted by (host, gpu), the sorted position of every id)."""
        order = sorted(range(len(self.seen)), key=self.seen.__getitem__)
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order))
        return [self.seen[i] for i in order], rank


FINITE = float(np.finfo(np.float64).max)  # the largest finite value: above it is +inf


def _numbers(col, dtype, measured: bool, upper: float = np.inf) -> np.ndarray:
    """A numeric arrow column as numpy (null -> NaN); a measured one also NaN where infinite, negative or above
    `upper` (what read_trace nulls: trace.UPPER_BOUNDS)."""
    out = col.to_numpy(zero_copy_only=False)
    if out.dtype != dtype:
        out = out.astype(dtype)
    # two reductions find the usual all-valid chunk without a mask
    # as Python floats: a float32 compared with FINITE would overflow in the cast
    if (
        measured
        and len(out)
        and not (float(np.fmin.reduce(out)) >= 0 and float(np.fmax.reduce(out)) <= min(upper, FINITE))
    ):
        with np.errstate(invalid="ignore"):
            bad = ~(out >= 0) | np.isinf(out) | (out > upper)
        out = out.copy() if not out.flags.writeable else out
        out[bad] = np.nan
    return out


def _host_codes(col) -> tuple[list[str], np.ndarray | None]:
    """(names, code per row) of a host column (dictionary or string); a missing host is "". A chunk of one host
    (a sampler's file) gives None for the codes: every row is names[0], no array of a million zeros."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if col.null_count == 0 and all(pa.types.is_dictionary(c.type) for c in chunks):
        entries = {v for c in chunks for v in c.dictionary.to_pylist()}
        if len(entries) == 1:
            return [str(entries.pop())], None
    values, codes = column_codes(col)
    return ["" if v is None else str(v) for v in values], codes.astype(np.int32)


def _any_value(x: np.ndarray) -> bool:
    """Any reading that is not NaN (fmin passes over NaN: one reduction, no mask)."""
    return len(x) > 0 and not np.isnan(np.fmin.reduce(x))


def _rows(
    batch: pa.RecordBatch | pa.Table, ids: _GpuIds, fetch: Callable[[], pa.RecordBatch] | None = None
) -> _Rows | None:
    """A chunk's usable rows; None when it has none. `fetch` reads the chunk's cause columns when the batch was
    read without them (trace.read_trace_chunks' deferred): a chunk in the sampler's layout keeps it for the few
    chunks whose straggler windows ask for them (ticks.DeferredCauses); any other reads them now."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else None
    if batch is None or batch.num_rows == 0:
        return None
    gpu_col = batch.column(GPU)
    gpu = (pc.fill_null(gpu_col, -1) if gpu_col.null_count else gpu_col).to_numpy(zero_copy_only=False)
    gpu = gpu.astype(np.int32 if gpu.max(initial=0) < 1 << 30 else np.int64, copy=False)
    time_ = _numbers(batch.column(TIME), np.float64, False)
    names, codes = _host_codes(batch.column(HOST))
    power = _numbers(batch.column(POWER_W), np.float32, True, UPPER_BOUNDS[POWER_W])
    util = _numbers(batch.column(UTIL_GPU), np.float32, True)
    has_energy = ENERGY_J in batch.schema.names and batch.column(ENERGY_J).null_count < batch.num_rows
    energy = batch.column(ENERGY_J) if has_energy else None  # numbers when asked for (_Rows.energy)
    signals = (_any_value(power), _any_value(util))
    causes = causes_mod.chunk_columns(batch) if set(causes_mod.COLUMNS) & set(batch.schema.names) else None
    if causes is not None and all(v is None for v in causes.values()):
        causes = None
    ok = None
    if gpu.min() < 0 or not np.isfinite(np.add.reduce(time_)):  # rows without a GPU or a time: dropped
        ok = (gpu >= 0) & np.isfinite(time_)
        if not ok.any():
            return None
        gpu, time_, power, util = gpu[ok], time_[ok], power[ok], util[ok]
        codes = codes[ok] if codes is not None else None
        energy = _numbers(energy, np.float64, True)[ok] if energy is not None else None
        causes = causes_mod.select(causes, ok) if causes is not None else None
    k = ticks_mod.period(gpu, codes)
    if k:  # the sampler's layout: the ids of one tick's GPUs, repeated (no lookup per row)
        gid, ngpu = ids.of(names, codes[:k] if codes is not None else np.zeros(k, np.int32), gpu[:k])
    else:
        gid, ngpu = ids.of(names, codes if codes is not None else np.zeros(len(gpu), np.int32), gpu)
    shared = bool(k) and ticks_mod.shared_times(time_, k, power)
    if fetch is not None and (ok is not None or not shared):  # reduced with the rows: read them now
        causes = causes_mod.chunk_columns(fetch())
        causes = None if all(v is None for v in causes.values()) else causes
        causes = causes_mod.select(causes, ok) if causes is not None and ok is not None else causes
        fetch = None
    return _Rows(gid, time_, power, util, energy, ngpu, signals, causes, k, shared, fetch)


def table_batches(trace) -> Iterator[pa.RecordBatch]:
    """A trace given in memory (a pa.Table, DataFrame or dict of columns) as chunks."""
    if isinstance(trace, pa.Table):
        missing = [c for c in NEEDED if c not in trace.column_names]
        if missing:
            raise InputError(f"trace lacks column(s) {', '.join(missing)}")
        table = trace
    else:
        df = trace if isinstance(trace, pd.DataFrame) else pd.DataFrame({c: trace[c] for c in trace})
        missing = [c for c in NEEDED if c not in df.columns]
        if missing:
            raise InputError(f"trace lacks column(s) {', '.join(missing)}")
        columns = {
            TIME: pa.array(pd.to_numeric(df[TIME]).to_numpy(np.float64)),
            HOST: pa.array(df[HOST].where(df[HOST].notna(), "").astype(str).to_numpy(), pa.string()),
            GPU: pa.array(pd.to_numeric(df[GPU]).fillna(-1).to_numpy().astype(np.int64)),
            POWER_W: pa.array(pd.to_numeric(df[POWER_W]).to_numpy(np.float32, na_value=np.nan)),
            UTIL_GPU: pa.array(pd.to_numeric(df[UTIL_GPU]).to_numpy(np.float32, na_value=np.nan)),
        }
        if ENERGY_J in df.columns:
            columns[ENERGY_J] = pa.array(pd.to_numeric(df[ENERGY_J]).to_numpy(np.float64, na_value=np.nan))
        for name in causes_mod.COLUMNS:  # a straggler's cause, where the frame has them
            if name in df.columns:
                columns[name] = pa.array(df[name], type=TRACE_SCHEMA.field(name).type, from_pandas=True)
        table = pa.table(columns)
    return iter(table.to_batches(max_chunksize=CHUNK_ROWS))


# ---------------------------------------------------------------- sums per (GPU, window)


@dataclass
class _Cells:
    """One chunk's (GPU, window) cells: a grid of them, those with samples, and per power sample its cell and
    power (kept for the bands, which need the GPUs' levels first)."""

    grid: int  # cells in the chunk's grid
    present: np.ndarray  # grid cells with rows
    gid: np.ndarray  # per present cell
    window: np.ndarray  # per present cell: int64 window index
    rows: np.ndarray  # per present cell: rows, with or without power
    n: np.ndarray  # power samples
    psum: np.ndarray
    nu: np.ndarray  # utilization samples (among the power samples)
    usum: np.ndarray
    cell: np.ndarray | None  # per power sample: its grid cell
    power: np.ndarray | None  # per power sample (float32)
    gpu: np.ndarray | None  # per power sample: its GPU id (small ints: a lookup in a tiny table gives its edges)
    causes: causes_mod.ChunkCauses | ticks_mod.DeferredCauses | None = None  # per present cell: clock, temp, reasons
    ticks: ticks_mod.Ticks | None = None  # the sampler's layout: cell, power and gpu are None, this holds them


def _cells(r: _Rows, window_s: float, ngpu_seen: int) -> _Cells:
    if r.shared:
        return _tick_cells(r, ticks_mod.layout(r.time, r.head, r.period, r.power, window_s), ngpu_seen)
    key = r.time / window_s if window_s != 1.0 else r.time.copy()
    np.floor(key, out=key)
    lo, hi = float(key.min()), float(key.max())
    span = int(hi - lo) + 1
    key -= lo  # window - lo, then the cell (window - lo) * GPUs + GPU, in one float64 buffer
    key *= ngpu_seen
    key += r.gid
    key = key.astype(np.int32 if span * ngpu_seen < 1 << 31 else np.int64)
    if span * ngpu_seen <= 4 * len(key) + 65536:  # rows in time order (the sampler's): a dense grid, no sort
        grid = span * ngpu_seen
        rows = np.bincount(key, minlength=grid)
        present = np.flatnonzero(rows)
        rows, cells = rows[present], present
    else:
        cells, key, rows = np.unique(key, return_inverse=True, return_counts=True)
        grid, key = len(cells), key.astype(np.int32)
        present = np.arange(grid)
    chunk_causes = None
    if r.causes is not None:
        chunk_causes = causes_mod.reduce_chunk(r.causes, key, grid, present, r.gid, r.ngpu, r.time)
    valid = ~np.isnan(r.power)
    small = r.gid.astype(np.int8 if ngpu_seen < 1 << 7 else np.int16 if ngpu_seen < 1 << 15 else np.int32)
    if valid.all():
        cell, power, util = key, r.power, r.util
    else:
        cell, power, util, small = key[valid], r.power[valid], r.util[valid], small[valid]

    def per_cell(weights=None, at=None) -> np.ndarray:
        c = cell if at is None else cell[at]
        return np.bincount(c, weights=weights, minlength=grid)[present]

    n = rows if len(cell) == len(key) else per_cell()  # every row has power: the row counts
    psum = per_cell(power.astype(np.float64))
    uvalid = ~np.isnan(util)
    if uvalid.all():
        nu, usum = n, per_cell(util.astype(np.float64))
    else:
        nu, usum = per_cell(at=uvalid), per_cell(util[uvalid].astype(np.float64), uvalid)
    return _Cells(
        grid,
        present,
        (cells % ngpu_seen).astype(np.int64),
        (cells // ngpu_seen).astype(np.int64) + int(lo),
        rows,
        n,
        psum,
        nu,
        usum,
        cell,
        power,
        small,
        chunk_causes,
    )


def _tick_cells(r: _Rows, t: ticks_mod.Ticks, ngpu_seen: int) -> _Cells:
    """_cells of a chunk in the sampler's layout (ticks.py): every (window, GPU) of its window runs."""
    lo = int(t.window[0])
    span = int(t.window[-1]) - lo + 1
    ids = t.head[t.order].astype(np.int64)
    present = ((t.window - lo)[:, None] * ngpu_seen + ids[None, :]).ravel()
    n = np.repeat(t.ticks_in, t.k)
    psum = ticks_mod.sums(t, r.power)
    if np.isfinite(np.add.reduce(r.util, dtype=np.float64)):
        nu, usum = n, ticks_mod.sums(t, r.util)
    else:
        ok = ~np.isnan(r.util)
        nu, usum = ticks_mod.counts(t, ok), ticks_mod.sums(t, np.where(ok, r.util, np.float32(0)))
    if r.fetch_causes is not None:  # read and reduced only if a straggler's windows ask for them
        chunk_causes = ticks_mod.DeferredCauses(t, r.fetch_causes)
    else:
        chunk_causes = ticks_mod.causes(t, r.causes) if r.causes is not None else None
    gid, window = np.tile(ids, len(t.window)), np.repeat(t.window, t.k)
    return _Cells(span * ngpu_seen, present, gid, window, n, n, psum, nu, usum, None, None, None, chunk_causes, t)


def _gpu_major(r: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The chunk's (gid, time, power, energy) grouped by GPU, each GPU's rows in time order (stable)."""
    n, k = len(r.time), r.ngpu
    head = r.head if r.period else r.gid[:k]
    if r.period or n % k == 0 and len(np.unique(head)) == k and bool((r.gid.reshape(-1, k) == head).all()):
        # the sampler's layout, each tick's GPUs in the same order: a transpose groups them, no sort
        def grouped(a):
            return a.reshape(-1, k).T.ravel()

        gid = np.repeat(head, n // k)
    else:
        order = np.argsort(r.gid.astype(np.int16 if r.gid.max() < 1 << 15 else np.int32), kind="stable")

        def grouped(a):
            return a[order]

        gid = grouped(r.gid)
    t = grouped(r.time)
    if bool(((t[1:] < t[:-1]) & (gid[1:] == gid[:-1])).any()):  # a GPU's rows out of time order in the chunk
        order = np.lexsort((r.time, r.gid))

        def grouped(a):
            return a[order]

        gid, t = grouped(r.gid), grouped(r.time)
    return gid, t, grouped(r.power), grouped(r.energy) if r.energy is not None else None


def _energy_segments(r: _Rows) -> energy_mod.Segments:
    if r.shared:  # the sampler's layout with one time per tick: the GPUs share their intervals (energy.py)
        k = r.period
        return energy_mod.summarize_ticks(
            r.head, r.time.reshape(-1, k)[:, 0], r.power.reshape(-1, k), r.counter_readings()
        )
    return energy_mod.summarize_segments(*_gpu_major(r))


class _Place:
    """Where one chunk's cells (in its own order) land in the GPU-major windows: for a chunk in the tick layout
    whose windows follow one another, one run of windows per GPU (a slice each: no index per cell); else a
    position per cell."""

    def __init__(self, c: _Cells, gid: np.ndarray, shift: np.ndarray, rank: np.ndarray):
        t = c.ticks
        self.cells: np.ndarray | None = None
        self.starts: np.ndarray | None = None
        if t is not None:
            ids = rank[t.head[t.order]]  # the sorted id of each column (cells: window run after run, GPU by GPU)
            if int(t.window[-1] - t.window[0]) + 1 == len(t.window):
                self.starts, self.runs, self.k = shift[ids] + t.window[0], len(t.window), t.k
            else:
                self.cells = (t.window[:, None] + shift[ids][None, :]).ravel()
        else:
            self.cells = shift[gid] + c.window

    def add(self, out: np.ndarray, values: np.ndarray) -> None:
        """out[each cell's window] += values (no two of one chunk's cells share a window)."""
        if self.cells is not None:
            out[self.cells] += values
            return
        assert self.starts is not None  # without a position per cell, one run of windows per GPU
        v = values.reshape(self.runs, self.k)
        for j, at in enumerate(self.starts.tolist()):
            out[at : at + self.runs] += v[:, j]

    @property
    def positions(self) -> np.ndarray:
        if self.cells is not None:
            return self.cells
        assert self.starts is not None  # without a position per cell, one run of windows per GPU
        return (np.arange(self.runs)[:, None] + self.starts[None, :]).ravel()

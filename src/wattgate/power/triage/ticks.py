"""The sampler's own layout, reduced without a cell index per row.

A sampler reads every GPU of its node in one tick and stamps the tick's rows with one time, GPU after GPU in
the same order, tick after tick (telemetry/sampler.py). A chunk in that layout is a (ticks x GPUs) table whose
rows of one tick share their window, so per-window sums are sums over runs of whole ticks (numpy's reduceat,
reading memory in order) instead of a scatter of every sample into a (window, GPU) grid, and the band counts
are the same runs over a (ticks x GPUs) comparison with each GPU's edge broadcast along its column. The
figures are the general path's (windows.py) to the last bit: each window's samples are summed in the same
order, in float64. Any other layout (imported logs, a chunk holding a missing reading) takes the general path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from wattgate.power.triage.causes import GROUPS, REDUCE_HZ, ChunkCauses, chunk_columns, clean
from wattgate.trace import REASON_CAUSES, REASONS, SM_CLOCK_MHZ, TEMP_C


def period(gpu: np.ndarray, codes: np.ndarray | None) -> int:
    """k when the rows are ticks of the same k GPUs (host code, index; codes None: one host) in the same order,
    else 0."""
    n = len(gpu)
    if n == 0:
        return 0
    if codes is not None and codes[0] == codes[-1] and int(codes.min()) == int(codes.max()):
        codes = None  # one host: the GPU index is the key
    k = _first_repeat(gpu, codes, n)
    if n % k:
        return 0
    head = gpu[:k]
    if len(np.unique(head if codes is None else head.astype(np.int64) * (1 << 20) + codes[:k])) != k:
        return 0
    if not bool((gpu.reshape(-1, k) == head).all()):
        return 0
    if codes is not None and not bool((codes.reshape(-1, k) == codes[:k]).all()):
        return 0
    return k


def _first_repeat(gpu: np.ndarray, codes: np.ndarray | None, n: int) -> int:
    """The index of the first row after the first that holds the first row's GPU (n: none); looked for in a
    short head first, since a tick holds a few GPUs, not a million."""
    for end in (min(1 << 12, n), n):  # the head, then (no repeat there) the whole chunk
        repeat = gpu[1:end] == gpu[0]
        if codes is not None:
            repeat &= codes[1:end] == codes[0]
        if repeat.any():
            return int(np.argmax(repeat)) + 1
    return n


@dataclass
class Ticks:
    """A chunk as (ticks x k GPUs): its window runs and each column's GPU."""

    k: int
    head: np.ndarray  # GPU id (first sight) of each column
    order: np.ndarray  # the columns in GPU id order: a window's cells are numbered that way
    starts: np.ndarray  # first tick of each run of ticks in one window
    window: np.ndarray  # each run's window (absolute index)
    ticks_in: np.ndarray  # ticks per run
    tick_window: np.ndarray  # each tick's window
    tick_time: np.ndarray
    power: np.ndarray | None  # (ticks, k) float32; None in DeferredCauses' runs, which keep no samples


def shared_times(time_: np.ndarray, k: int, power: np.ndarray) -> bool:
    """Whether rows in ticks of k GPUs (period) also share one time per tick, come in time order and miss no
    power reading: what the reductions by ticks (layout, energy.summarize_ticks) need, checked once a chunk."""
    t2 = time_.reshape(-1, k)
    tick_time = t2[:, 0]
    if k > 1 and not bool((t2 == tick_time[:, None]).all()):
        return False
    if len(tick_time) > 1 and bool((tick_time[1:] < tick_time[:-1]).any()):
        return False
    return bool(np.isfinite(np.add.reduce(power, dtype=np.float64)))  # a missing reading: the general path


def layout(time_: np.ndarray, gid_head: np.ndarray, k: int, power: np.ndarray, window_s: float) -> Ticks:
    """The chunk's Ticks; its rows are ticks with shared_times."""
    tick_time = time_.reshape(-1, k)[:, 0]
    w = np.floor(tick_time / window_s) if window_s != 1.0 else np.floor(tick_time)
    starts = np.flatnonzero(np.r_[True, w[1:] != w[:-1]])
    counts = np.diff(np.r_[starts, len(w)])
    order = np.argsort(gid_head, kind="stable")
    return Ticks(k, gid_head, order, starts, w[starts].astype(np.int64), counts, w, tick_time, power.reshape(-1, k))


def sums(t: Ticks, values: np.ndarray) -> np.ndarray:
    """Per window run and GPU (in GPU id order), the float64 sum of `values` ((ticks, k) or flat)."""
    return np.add.reduceat(values.reshape(-1, t.k), t.starts, axis=0, dtype=np.float64)[:, t.order].ravel()


def counts(t: Ticks, flags: np.ndarray) -> np.ndarray:
    """Per window run and GPU (in GPU id order), how many of the boolean `flags` ((ticks, k) or flat) are set."""
    flags = flags.reshape(-1, t.k)
    lane = _lanes(t.k)
    if lane is None or int(t.ticks_in.max()) > 255:
        return np.add.reduceat(flags, t.starts, axis=0, dtype=np.int64)[:, t.order].ravel()
    # a tick's flags read as a few wide integers, one byte per GPU: adding them adds every GPU's byte at once, and
    # no byte carries into the next while a run has at most 255 ticks
    wide = np.ascontiguousarray(flags).view(np.uint8).view(lane)
    summed = np.add.reduceat(wide[:, 0] if wide.shape[1] == 1 else wide, t.starts, axis=0, dtype=lane)
    return summed.view(np.uint8).reshape(-1, t.k)[:, t.order].astype(np.int64).ravel()


def _lanes(k: int) -> type | None:
    """The widest unsigned integer whose bytes a row of k one-byte flags fills whole, if wider than a byte."""
    for width, dtype in ((8, np.uint64), (4, np.uint32), (2, np.uint16)):
        if k % width == 0:
            return dtype
    return None


def band_counts(t: Ticks, hi_edge: np.ndarray, lo_edge: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per present cell (window run x GPU in id order): samples at or above the GPU's compute edge, and below
    its low edge (float32 edges, one per GPU id)."""
    p = t.power
    assert p is not None  # a chunk's own Ticks (layout), not DeferredCauses' runs
    return counts(t, p >= hi_edge[t.head]), counts(t, p < lo_edge[t.head])


class DeferredCauses:
    """A chunk's ChunkCauses (causes()) made when first asked for: its cause columns read then (`fetch`) and
    reduced by its window runs, the same figures as at once. Most chunks are never asked for (only those with
    a straggler's windows), and their columns are never decoded. Keeps the runs only, not the chunk's rows."""

    def __init__(self, t: Ticks, fetch: Callable[[], pa.RecordBatch]):
        self.runs = Ticks(t.k, t.head, t.order, t.starts, t.window, t.ticks_in, t.tick_window, t.tick_time.copy(), None)
        self.fetch: Callable[[], pa.RecordBatch] | None = fetch
        self.found: ChunkCauses | None = None

    def __call__(self) -> ChunkCauses | None:
        if self.fetch is not None:
            self.found = causes(self.runs, chunk_columns(self.fetch()))
            self.fetch = None
        return self.found


def causes(t: Ticks, columns: dict[str, np.ndarray | None]) -> ChunkCauses | None:
    """ChunkCauses of a chunk in the tick layout: the cause columns summed per window run from about
    REDUCE_HZ ticks a second (the sampler reads them once a second and repeats them between)."""
    if all(v is None for v in columns.values()):
        return None
    # every stride-th tick from the first, as causes.reduce_chunk strides the same chunk on the general path
    span = float(t.tick_time[-1] - t.tick_time[0])
    stride = int(len(t.tick_time) / span / REDUCE_HZ) if span > 0 else 0
    stride = stride if stride >= 2 and len(t.tick_time) >= 4 else 1
    kept_window = t.tick_window[::stride]
    starts = np.flatnonzero(np.r_[True, kept_window[1:] != kept_window[:-1]])
    # runs of kept ticks -> the chunk's window runs (a run with no kept tick stays zero)
    at = np.searchsorted(t.window, kept_window[starts].astype(np.int64))
    cells = len(t.window)

    def per_run(values2d: np.ndarray, dtype) -> np.ndarray:
        out = np.zeros((cells, t.k), dtype)
        out[at] = np.add.reduceat(values2d, starts, axis=0, dtype=dtype)
        return out[:, t.order].ravel()

    kept = np.zeros(cells)
    kept[at] = np.diff(np.r_[starts, len(kept_window)])
    rows = np.repeat(kept, t.k)  # kept ticks per cell, in the cells' order

    def per_gpu(values: np.ndarray) -> np.ndarray:
        """A value per GPU (column) as a value per cell."""
        return np.tile(values[t.order], cells)

    def mean_of(name):
        v = columns[name]
        if v is None:
            return None
        v2 = clean(name, v.reshape(-1, t.k)[::stride])
        first = v2[0]
        if bool((v2 == first).all()):  # each GPU holds one value through the chunk: no runs to sum
            if first.min() == first.max():
                return float(first[0])
            return per_gpu(first.astype(np.float64)) * rows, rows.copy()
        missing = np.isnan(v2)
        if not missing.any():  # every kept tick holds a reading: its count per cell is the kept ticks
            return per_run(v2, np.float64), rows.copy()
        ok = ~missing
        if not ok.any():
            return None
        return per_run(np.where(ok, v2, 0.0), np.float64), per_run(ok, np.float64)

    reasons = columns[REASONS]
    counted = None
    if reasons is not None:
        r2 = reasons.reshape(-1, t.k)[::stride]
        lo = r2[0]
        counted = np.empty((cells * t.k, 4))
        if bool((r2 == lo).all()):  # one bitmask per GPU through the chunk
            have = lo >= 0
            counted[:, 0] = per_gpu(have.astype(np.float64)) * rows
            for i, group in enumerate(GROUPS, start=1):
                flag = have & ((lo & REASON_CAUSES[group]) != 0)
                counted[:, i] = per_gpu(flag.astype(np.float64)) * rows
        else:
            have = r2 >= 0
            counted[:, 0] = per_run(have, np.float64)
            for i, group in enumerate(GROUPS, start=1):
                counted[:, i] = per_run(have & ((r2 & REASON_CAUSES[group]) != 0), np.float64)
    return ChunkCauses(mean_of(SM_CLOCK_MHZ), mean_of(TEMP_C), counted)

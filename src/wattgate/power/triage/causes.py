"""What a slowed GPU's own readings say about why it is slow: SM clock, temperature and the clocks-event reasons,
per (GPU, window), for the straggler analysis (stragglers.py).

They are reduced a chunk at a time with the power (windows.py) and asked for only for the few windows where a
GPU was found lagging, so a run without stragglers pays one reduction per chunk and nothing after. The sampler
reads these columns on its slow path (once a second) and repeats them in between, so a chunk in the sampler's
layout (every GPU's row of one tick, tick after tick) is reduced from about two ticks a second
(REDUCE_HZ): the same per-window figures as from every row, for a fifth of the work at 10 Hz. A chunk whose
column holds one value (or none) costs nothing more.

Reasons are counted per window in three groups (trace.REASON_CAUSES): thermal (SW or HW thermal slowdown),
power cap (SW power cap) and HW slowdown (HW slowdown or HW power brake), beside the samples with any
reasons reading.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from wattgate.trace import REASON_CAUSES, REASONS, SM_CLOCK_MHZ, TEMP_C

COLUMNS = (SM_CLOCK_MHZ, TEMP_C, REASONS)
GROUPS = tuple(REASON_CAUSES)  # thermal, power_cap, hw_slowdown: the reason groups counted, in this order
REDUCE_HZ = 2.0  # ticks a second reduced in the sampler's layout (its slow path refreshes at 1 Hz)


def chunk_columns(batch) -> dict[str, np.ndarray | None]:
    """The cause columns of a record batch as numpy, as stored (no copy where Arrow allows): clock and
    temperature float32 (null: NaN), reasons int64 (null: -1); None for a column the chunk lacks or holds no
    value in. Readings that cannot be readings are made NaN by `clean` on the rows actually reduced."""
    out: dict[str, np.ndarray | None] = {}
    names = batch.schema.names
    for name in COLUMNS:
        if name not in names or batch.column(name).null_count == batch.num_rows:
            out[name] = None
            continue
        col = batch.column(name)
        if name == REASONS:
            values = (pc.fill_null(col, -1) if col.null_count else col).to_numpy(zero_copy_only=False)
            out[name] = values.astype(np.int64, copy=False)
        else:
            out[name] = col.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return out


def clean(name: str, values: np.ndarray) -> np.ndarray:
    """A clock or temperature subsample with the impossible readings (infinite; a negative clock) as NaN."""
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values < 0) if name != TEMP_C else ~np.isfinite(values)
    return np.where(bad, np.float32(np.nan), values) if bad.any() else values


def select(columns: dict[str, np.ndarray | None], ok: np.ndarray) -> dict[str, np.ndarray | None]:
    return {k: (v[ok] if v is not None else None) for k, v in columns.items()}


@dataclass
class ChunkCauses:
    """One chunk's cause figures per present cell (its grid's cells with rows): per column a constant (every
    row holds it), (sum, count) arrays, or None; reasons as (cells, 4) counts of [any reading, thermal,
    power_cap, hw_slowdown]."""

    clock: float | tuple[np.ndarray, np.ndarray] | None
    temp: float | tuple[np.ndarray, np.ndarray] | None
    reasons: np.ndarray | None


def reduce_chunk(
    columns: dict[str, np.ndarray | None],
    key: np.ndarray,
    grid: int,
    present: np.ndarray,
    gid: np.ndarray,
    ngpu: int,
    time_: np.ndarray,
) -> ChunkCauses | None:
    """The chunk's cause figures per present cell; `key` is every row's grid cell, `gid` its GPU id, `ngpu` the
    GPUs in the chunk. None when the chunk holds none of the columns."""
    if all(v is None for v in columns.values()):
        return None
    stride = _tick_stride(gid, ngpu, time_)

    def pick(v):
        return v if stride is None else v.reshape(-1, ngpu)[::stride].ravel()

    k = pick(key)

    def mean_of(name):
        v = columns[name]
        if v is None:
            return None
        v = clean(name, pick(v))
        lo, hi = np.fmin.reduce(v), np.fmax.reduce(v)
        if lo == hi:  # one value throughout (NaN compares unequal): no per-cell work
            return float(lo)
        ok = ~np.isnan(v)
        if not ok.any():
            return None
        kk, vv = (k, v) if ok.all() else (k[ok], v[ok])
        total = np.bincount(kk, weights=vv.astype(np.float64), minlength=grid)[present]
        return total, np.bincount(kk, minlength=grid)[present].astype(np.float64)

    reasons = columns[REASONS]
    counts = None
    if reasons is not None:
        r = pick(reasons)
        lo, hi = int(r.min()), int(r.max())
        if lo == hi:  # one bitmask throughout: each cell's rows all hold it (or none)
            rows = np.bincount(k, minlength=grid)[present].astype(np.float64)
            counts = np.outer(rows, [lo >= 0] + [lo >= 0 and bool(lo & REASON_CAUSES[g]) for g in GROUPS])
        else:
            # one small count per cell and flag: a grid of (cells x 16 codes) is megabytes of fresh pages a chunk
            have = r >= 0
            counts = np.empty((len(present), 4))
            counts[:, 0] = np.bincount(k[have], minlength=grid)[present]
            for i, group in enumerate(GROUPS, start=1):
                flag = have & ((r & REASON_CAUSES[group]) != 0)
                counts[:, i] = np.bincount(k[flag], minlength=grid)[present] if flag.any() else 0.0
    return ChunkCauses(mean_of(SM_CLOCK_MHZ), mean_of(TEMP_C), counts)


def _tick_stride(gid: np.ndarray, ngpu: int, time_: np.ndarray) -> int | None:
    """Every how many ticks to reduce when the chunk is in the sampler's layout (`ngpu` rows per tick, the GPUs
    in the same order in every tick) and sampled faster than REDUCE_HZ; None: every row."""
    n = len(gid)
    if ngpu < 1 or n < 4 * ngpu or n % ngpu:
        return None
    span = float(time_[-1] - time_[0])
    stride = int((n // ngpu) / span / REDUCE_HZ) if span > 0 else 0
    if stride < 2:
        return None
    ticks = gid.reshape(-1, ngpu)
    if len(np.unique(ticks[0])) != ngpu or not bool((ticks == ticks[0]).all()):
        return None
    return stride


@dataclass
class WindowCauses:
    """Cause figures of some windows (in the order asked): mean SM clock and temperature (NaN: none), and
    reasons counts [any reading, thermal, power_cap, hw_slowdown]."""

    clock: np.ndarray
    temp: np.ndarray
    reasons: np.ndarray  # (windows, 4)

    @property
    def has_reasons(self) -> bool:
        return bool(self.reasons[:, 0].sum() > 0)


def window_causes(chunks: list[tuple[np.ndarray, np.ndarray, ChunkCauses | None]], total: int, wanted) -> WindowCauses:
    """Cause figures of the windows at positions `wanted` (of `total`), from each chunk's (cell -> window
    position, rows per cell, ChunkCauses, or a callable giving it when asked)."""
    wanted = np.asarray(wanted, np.int64)
    m = len(wanted)
    lut = np.full(total, -1, np.int64)
    lut[wanted] = np.arange(m)
    sums = {name: np.zeros(m) for name in ("clock", "temp")}
    counts = {name: np.zeros(m) for name in ("clock", "temp")}
    reasons = np.zeros((m, 4))
    for pos, rows, cc in chunks:
        if cc is None:
            continue
        idx = lut[pos]
        sel = idx >= 0
        if not sel.any():
            continue
        if callable(cc):  # deferred (ticks.DeferredCauses): read and reduced now that its windows are wanted
            cc = cc()
            if cc is None:
                continue
        at = idx[sel]
        for name in ("clock", "temp"):
            v = getattr(cc, name)
            if v is None:
                continue
            if isinstance(v, float):
                w = rows[sel].astype(np.float64)
                sums[name] += np.bincount(at, weights=v * w, minlength=m)
                counts[name] += np.bincount(at, weights=w, minlength=m)
            else:
                sums[name] += np.bincount(at, weights=v[0][sel], minlength=m)
                counts[name] += np.bincount(at, weights=v[1][sel], minlength=m)
        if cc.reasons is not None:
            np.add.at(reasons, at, cc.reasons[sel])
    with np.errstate(invalid="ignore", divide="ignore"):
        clock, temp = (np.where(counts[name] > 0, sums[name] / counts[name], np.nan) for name in ("clock", "temp"))
    return WindowCauses(clock, temp, reasons)


def table_causes(table: pa.Table) -> dict[str, np.ndarray | None]:
    """chunk_columns of a whole in-memory table (triage() on a table)."""
    return chunk_columns(table)

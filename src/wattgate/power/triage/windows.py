"""Power triage's windows: a trace's samples cut into per-GPU windows and their features.

Input is a telemetry trace (docs/architecture.md, "Telemetry trace"); output is
phases.parquet: one row per GPU per window. Windows are floor(time /
window_s) on the unix clock, so the windows of all GPUs and hosts line up.
Each GPU gets every window from its first sample to its last. A gap in the
samples shorter than a few sampling periods (GAP_FILL_PERIODS, and always
one of up to GAP_FILL_MIN_WINDOWS windows: the sampler's grid jittering
across a window edge) is not missing data: its empty windows take the values
of the nearest window with samples, so they take the phase around them (with
confidence at most 0.5). A longer gap is `unknown` and takes no part in the
rules: runs of the other windows are measured across it, so it neither splits
nor relabels them; triage.json and the report say how much time it was.

Per window: mean power P, mean utilization U, and the shares of samples in
the high band (>= compute_min_w) and the low band (< low_max_w), against the
GPU's own edges (levels.py): low [0, low_max_w), mid [low_max_w,
compute_min_w), high [compute_min_w, ...).

Samples are read a chunk (a trace's row group) at a time and reduced to sums
per (GPU, window) and per-GPU energy summaries (energy.Segments) as they come
(chunks.py; the sampler's own layout by runs of ticks, ticks.py): a day of 16
GPUs at 10 Hz is 14M rows, and holding them all, with the temporaries each
numpy step makes, cost more than the arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from wattgate.errors import InputError
from wattgate.power import energy as energy_mod
from wattgate.triage_tables import TriageTable
from wattgate.power.triage import causes as causes_mod
from wattgate.power.triage import ticks as ticks_mod
from wattgate.power.triage.arrays import _ranges, gpu_runs
from wattgate.power.triage.chunks import (  # noqa: F401 (CHUNK_ROWS, NEEDED, table_batches: imported from here)
    CHUNK_ROWS,
    NEEDED,
    _Cells,
    _energy_segments,
    _GpuIds,
    _Place,
    _rows,
    _cells,
    table_batches,
)
from wattgate.power.triage.levels import Levels, learn_levels

GAP_FILL_PERIODS = 4.0  # an empty stretch shorter than this many sampling periods takes the phase around it
GAP_FILL_MIN_WINDOWS = 2  # ... and always one of up to this many windows (the sampler's grid jittering at an edge)


@dataclass
class _Ingest:
    """What triage keeps of a trace read chunk by chunk."""

    window_s: float
    ids: _GpuIds = field(default_factory=_GpuIds)
    cells: list[_Cells] = field(default_factory=list)
    segments: list = field(default_factory=list)  # energy.Segments per chunk
    with_energy: bool = True
    power: bool = False  # any power reading
    util: bool = False  # any utilization reading
    sources: list[int] = field(default_factory=list)  # per chunk kept (cells, segments): the file it came from

    def add(self, batch, source: int = 0) -> None:
        """One chunk: a record batch, or (batch, a way to read its cause columns) (trace.read_trace_chunks'
        deferred columns)."""
        batch, fetch = batch if isinstance(batch, tuple) else (batch, None)
        r = _rows(batch, self.ids, fetch)
        if r is None:
            return
        self.sources.append(source)
        self.power |= r.signals[0]
        self.util |= r.signals[1]
        if self.with_energy:
            self.segments.append(_energy_segments(r))
        self.cells.append(_cells(r, self.window_s, len(self.ids.seen)))

    @property
    def empty(self) -> bool:
        return not self.cells


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _each(fn: Callable, items: list) -> list:
    """[fn(x) for x in items], on two threads when there are two cores."""
    if _cores() < 2 or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(fn, items))


def ingest(files: Iterable[Iterable], window_s: float, with_energy: bool = True) -> _Ingest:
    """Every file's chunks (an iterable of record batches per file), in turn; each chunk kept remembers its
    file (the source, by position) for overlapping_files."""
    acc = _Ingest(window_s, with_energy=with_energy)
    tagged = ((source, batch) for source, chunks in enumerate(files) for batch in chunks)
    if not with_energy or _cores() < 2:
        for source, batch in tagged:
            acc.add(batch, source=source)
        return acc
    # a second core decodes the next chunk while this one sums its energy and cuts its windows (Parquet decoding
    # lets go of the GIL); the energy on a third thread as well cost more in contention than it overlapped
    with ThreadPoolExecutor(max_workers=1) as pool:
        for source, batch in _prefetched(tagged, pool):
            acc.add(batch, source)
    return acc


def _prefetched(chunks: Iterator, pool: ThreadPoolExecutor) -> Iterator:
    """The chunks, each read while the one before is being used."""
    done = object()
    ahead = pool.submit(next, chunks, done)
    while (batch := ahead.result()) is not done:
        ahead = pool.submit(next, chunks, done)
        yield batch


@dataclass(frozen=True)
class FileClash:
    """Two files (by position) holding samples of the same host's GPUs over the same time."""

    first: int
    second: int
    host: str
    gpus: list[int]
    start: float  # unix seconds the two files' spans share
    end: float


def overlapping_files(acc: _Ingest, suspect: Callable[[int, int, str], bool]) -> FileClash | None:
    """The first pair of files whose samples of one (host, gpu) overlap in time and that `suspect(file, file,
    host)` says should not, or None. Two nodes' logs imported under one host name would otherwise merge into one
    GPU per index (their windows averaged, the energy halved); a relaunch's traces of the same GPUs follow one
    another and are kept. From the chunks' energy summaries (first and last row time per GPU), so it needs an
    ingest with energy."""
    if len(set(acc.sources)) < 2:
        return None
    spans: dict[tuple[int, int], list[float]] = {}  # (gpu id, file) -> [first, last] row time
    for source, seg in zip(acc.sources, acc.segments):
        for g, t0, t1 in zip(seg.gpu.tolist(), seg.t0.tolist(), seg.t1.tolist()):
            span = spans.setdefault((g, source), [t0, t1])
            span[0], span[1] = min(span[0], t0), max(span[1], t1)
    per_gpu: dict[int, list[tuple[float, float, int]]] = {}
    for (g, source), (t0, t1) in spans.items():
        per_gpu.setdefault(g, []).append((t0, t1, source))
    clashes: dict[tuple[int, int, str], list] = {}  # (file, file, host) -> [gpus, start, end]
    for g, files in per_gpu.items():
        files.sort()
        for (_, a1, a), (b0, b1, b) in zip(files, files[1:]):
            host, gpu = acc.ids.seen[g]
            if b0 < a1 and suspect(a, b, host):  # the later starts before the earlier ends (touching: relaunch)
                found = clashes.setdefault((min(a, b), max(a, b), host), [[], b0, min(a1, b1)])
                found[0].append(gpu)
                found[1], found[2] = min(found[1], b0), max(found[2], min(a1, b1))
    if not clashes:
        return None
    (first, second, host), (gpus, start, end) = min(clashes.items())
    return FileClash(first, second, host, sorted(gpus), start, end)


def ingest_energy(acc: _Ingest, reread: Callable[[], Iterable]) -> dict:
    """triage.json's "energy" (energy.records) from the chunks' summaries; a GPU whose rows of two chunks
    overlap in time (interleaved files of one node, or a file's rows out of time order across its row groups)
    is summed again from its rows sorted together (reread)."""
    if acc.empty:
        return {}
    keys, rank = acc.ids.sorted()
    seg = energy_mod.concat_segments(acc.segments)
    clash = energy_mod.overlapping(seg)
    if len(clash):
        seg = _resummarized(seg, clash, acc, reread)
    seg.gpu = rank[seg.gpu]
    joined = energy_mod.join_segments(seg, len(keys))
    joined.keys = keys
    reads = np.bincount(seg.gpu, weights=seg.reads, minlength=len(keys)).astype(int)
    return energy_mod.records(joined, [int(x) for x in reads])


def _resummarized(seg: energy_mod.Segments, clash: np.ndarray, acc: _Ingest, reread) -> energy_mod.Segments:
    ids = _GpuIds()  # the same ids again: the rows come in the same order
    parts = []
    for batch in reread():
        r = _rows(batch, ids)
        if r is None:
            continue
        mine = np.isin(r.gid, clash)
        if mine.any():
            e = r.energy[mine] if r.energy is not None else np.full(int(mine.sum()), np.nan)
            parts.append((r.gid[mine], r.time[mine], r.power[mine], e))
    g, t, p, e = (np.concatenate([x[i] for x in parts]) for i in range(4))
    order = np.lexsort((t, g))  # stable: rows of equal time keep their file order
    again = energy_mod.summarize_segments(g[order], t[order], p[order], e[order])
    keep = ~np.isin(seg.gpu, clash)
    kept = energy_mod.Segments(*(getattr(seg, f)[keep] for f in energy_mod.Segments.__dataclass_fields__))
    return energy_mod.concat_segments([kept, again])


# ---------------------------------------------------------------- window features


@dataclass
class _Windows:
    keys: list[tuple[str, int]]  # (host, gpu) per GPU id, sorted
    gpu_id: np.ndarray  # per window
    index: np.ndarray  # absolute window index floor(time / window_s)
    n: np.ndarray  # power samples
    power: np.ndarray  # mean, NaN where n == 0
    util: np.ndarray  # mean, NaN where no utilization sample
    high: np.ndarray  # share of samples >= the GPU's compute_min_w
    low: np.ndarray  # share of samples < the GPU's low_max_w
    filled: np.ndarray  # no sample, but inside a short gap: values of the nearest window
    levels: Levels
    # per chunk: (where its cells land: _Place, rows per cell, its cause figures), for causes()
    cause_chunks: list = field(default_factory=list)

    def causes(self, wanted: np.ndarray) -> causes_mod.WindowCauses:
        """SM clock, temperature and reasons counts of the windows at positions `wanted` (straggler causes)."""
        chunks = [(place.positions, rows, found) for place, rows, found in self.cause_chunks]
        return causes_mod.window_causes(chunks, len(self.n), wanted)


def _windows(
    acc: _Ingest, table: TriageTable, window_s: float, caps: dict | None = None, power_cap_w: float | None = None
) -> _Windows:
    keys, rank = acc.ids.sorted()
    ngpu = len(keys)
    gids = [rank[c.gid] for c in acc.cells]  # per chunk, each cell's GPU in sorted order
    first = np.full(ngpu, np.iinfo(np.int64).max)
    last = np.full(ngpu, np.iinfo(np.int64).min)
    for c, g in zip(acc.cells, gids):
        if c.ticks is not None:  # every GPU of the chunk over the same runs of windows, in time order
            ids = rank[c.ticks.head]
            first[ids] = np.minimum(first[ids], c.ticks.window[0])
            last[ids] = np.maximum(last[ids], c.ticks.window[-1])
        else:
            np.minimum.at(first, g, c.window)
            np.maximum.at(last, g, c.window)
    span = last - first + 1
    cells_per_gpu = sum((np.bincount(g, minlength=ngpu) for g in gids), np.zeros(ngpu, np.int64))
    _check_sampled_span(keys, span, cells_per_gpu, first, window_s)
    base = np.concatenate([[0], np.cumsum(span)])
    total = int(base[-1])
    # where each chunk's cells land in the GPU-major output (a cell may recur in the next chunk, never in its own)
    shift = base[:-1] - first
    where = [_Place(c, g, shift, rank) for c, g in zip(acc.cells, gids)]

    def summed(name: str, dtype=np.float64) -> np.ndarray:
        out = np.zeros(total, dtype)
        for c, place in zip(acc.cells, where):  # added chunk by chunk in row order, as one bincount adds
            place.add(out, getattr(c, name))
        return out

    # each result in its own sum's buffer: a fresh array of a day's windows costs more in page faults than
    # the arithmetic on it
    n = summed("n", np.int64)
    samples_per_gpu = sum(
        (np.bincount(g, weights=c.rows, minlength=ngpu) for c, g in zip(acc.cells, gids)), np.zeros(ngpu)
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = summed("psum")
        mean_p /= n
        nu = summed("nu")
        mean_u = summed("usum")
        np.divide(mean_u, nu, out=mean_u, where=nu > 0)
        mean_u[nu == 0] = np.nan
    gpu_id = np.repeat(np.arange(ngpu), span)
    index = np.empty(total, np.int64)
    for g in np.flatnonzero(span > 0):  # each GPU's windows, first to last: a range, no gather per window
        index[base[g] : base[g + 1]] = np.arange(first[g], first[g] + span[g])

    known = n > 0
    cap = np.array([_cap_of(k, caps, power_cap_w, table) for k in keys], float)
    levels = learn_levels(mean_p[known], mean_u[known], gpu_id[known], ngpu, table, window_s, cap)
    # per-sample bands against the GPU's own edges: the oscillation rule counts samples, not means
    # by the ids of the chunks (first sight), as the samples hold them
    hi_edge, lo_edge = _float32_edge(levels.compute_min_w)[rank], _float32_edge(levels.low_max_w)[rank]
    high, low = np.zeros(total), np.zeros(total)
    cause_chunks = []
    # the sampler's layout: runs of ticks, each GPU's edge along its column; the chunks counted on both cores
    # (numpy lets go of the GIL in its loops), then added in row order
    counted = _each(
        lambda c: ticks_mod.band_counts(c.ticks, hi_edge, lo_edge) if c.ticks is not None else None, acc.cells
    )
    for c, place, by_ticks in zip(acc.cells, where, counted):
        if c.causes is not None:
            cause_chunks.append((place, c.rows, c.causes))
        # per sample 2 if high, + 1 if low (both at once were the learned edges ever to cross), counted per cell
        if by_ticks is not None:
            place.add(high, by_ticks[0])
            place.add(low, by_ticks[1])
            continue
        cells = place.cells
        assert c.cell is not None and c.power is not None and c.gpu is not None  # kept outside the tick layout
        flags = (c.power >= hi_edge[c.gpu]).view(np.int8) * np.int8(2)
        flags += c.power < lo_edge[c.gpu]
        four = c.cell * 4 if c.grid < 1 << 29 else c.cell.astype(np.int64) * 4
        four += flags
        counts = np.bincount(four, minlength=4 * c.grid).reshape(-1, 4)[c.present]
        high[cells] += counts[:, 2] + counts[:, 3]
        low[cells] += counts[:, 1] + counts[:, 3]
    with np.errstate(invalid="ignore", divide="ignore"):
        high /= n
        low /= n
    win = _Windows(keys, gpu_id, index, n, mean_p, mean_u, high, low, np.zeros(total, dtype=bool), levels, cause_chunks)
    _fill_short_gaps(win, samples_per_gpu, window_s)
    return win


MAX_UNSAMPLED_RATIO = 64  # windows from first to last sample per window with samples, beyond a floor of ...
MIN_DENSE_WINDOWS = 1 << 21  # ... ~24 days of 1 s windows: a GPU's span is dense, a clock jump must not be


def _check_sampled_span(keys: list, span: np.ndarray, sampled: np.ndarray, first: np.ndarray, window_s: float) -> None:
    """Refuse a trace whose windows would mostly cover time nobody sampled (one sample at time 0 among
    today's asked for 13 GiB): every GPU gets every window from its first sample to its last."""
    if int(span.sum()) <= max(MIN_DENSE_WINDOWS, MAX_UNSAMPLED_RATIO * int(sampled.sum())):
        return
    g = int(np.argmax(span / np.maximum(sampled, 1)))
    host, gpu = keys[g]
    raise InputError(
        f"trace: GPU {host or '?'}:{gpu} has samples from {first[g] * window_s:.17g} s to "
        f"{(first[g] + span[g]) * window_s:.17g} s (unix time) but only {int(sampled[g])} of those "
        f"{int(span[g])} windows of {window_s:g} s hold any: a time far from the rest (a clock jump, or a log's "
        "time column misread); fix those rows (wattgate import-trace rejects them) or triage the parts separately"
    )


def _float32_edge(edge: np.ndarray) -> np.ndarray:
    """The smallest float32 at or above each (float64) edge: a float32 power p is >= edge exactly when it is
    >= this, so samples compare without converting them."""
    e32 = edge.astype(np.float32)
    below = e32.astype(np.float64) < edge
    e32[below] = np.nextafter(e32[below], np.float32(np.inf))
    return e32


def _cap_of(key, caps: dict | None, power_cap_w: float | None, table: TriageTable) -> float:
    """The GPU's power cap: --power-cap-w, else the enforced limit the sampler recorded, else the table's tdp_w."""
    if power_cap_w:
        return float(power_cap_w)
    cap = (caps or {}).get(key)
    return float(cap) if cap else float(table.tdp_w)


def _fill_short_gaps(win: _Windows, samples_per_gpu: np.ndarray, window_s: float) -> None:
    """Empty windows inside a gap of fewer than GAP_FILL_PERIODS sampling periods (or GAP_FILL_MIN_WINDOWS
    windows: the sampler's grid jittering across a window edge) take the values of the nearest known
    window; longer gaps stay unknown."""
    known = win.n > 0
    ngpu = len(samples_per_gpu)
    per_window = samples_per_gpu / np.maximum(np.bincount(win.gpu_id[known], minlength=ngpu), 1)
    period = window_s / np.maximum(per_window, 1e-9)
    limit = np.maximum(GAP_FILL_PERIODS * period, GAP_FILL_MIN_WINDOWS * window_s)  # seconds, per GPU
    starts, ends = gpu_runs(known, win.gpu_id)
    empty = ~known[starts]
    starts, ends = starts[empty], ends[empty]
    if len(starts) == 0:
        return
    g = win.gpu_id[starts]
    interior = (starts > 0) & (ends < len(known))
    interior &= (win.gpu_id[np.maximum(starts - 1, 0)] == g) & (win.gpu_id[np.minimum(ends, len(known) - 1)] == g)
    gap_s = (ends - starts + 1) * window_s  # from the last sample's window to the next sample's
    short = interior & (gap_s <= limit[g] + 1e-9)
    s, e = starts[short], ends[short]
    if len(s) == 0:
        return
    at = _ranges(s, e)
    mid = np.repeat(s + (e - s) // 2, e - s)
    src = np.where(at < mid, np.repeat(s - 1, e - s), np.repeat(e, e - s))
    for arr in (win.n, win.power, win.util, win.high, win.low):
        arr[at] = arr[src]
    win.filled[at] = True

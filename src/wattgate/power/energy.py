"""Energy per GPU: the NVML energy counter where the trace has it, else integrated power.

Computed once, by triage (run_triage writes it into triage.json as "energy"), from
the samples it already holds; the report computes it from the traces when it has
no such record (power-only reports, other traces).

The sampler reads the counter only every ~10 s (each read costs milliseconds
of CPU), so most rows carry no reading. Per GPU the counter gives the energy
between its first and last reading; the seconds before the first and after
the last reading are integrated from power so that both methods cover the
GPU's whole trace and can be compared.

Only sampled time counts. An interval between two power samples longer than
GAP_PERIODS sampling periods (the GPU's median interval) and MIN_GAP_S is a
gap, as triage's windows call it `unknown`: it is not integrated across (10 s
at 100 W, an hour's hole, 30 s at 300 W read 0.2022 kWh instead of 0.00278),
its seconds are reported (gap_s) and left out of the GPU's sampled seconds
(GPU-hours). A counter whose readings span a gap would count the hole's
energy too, so that GPU falls back to its integral.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

COUNTER = "energy_counter"
INTEGRATED = "integrated_power"
GAP_PERIODS = 4.0  # as triage's windows (GAP_FILL_PERIODS): a longer silence is a gap, not a slow sample
MIN_GAP_S = 2.0  # ... and never under two 1 s windows: a sampler's jitter is no gap


class GpuSeries(Protocol):
    """One GPU's samples in time order (report.inputs.GpuSeries is one)."""

    host: str
    gpu: int
    time: np.ndarray  # float64
    power: np.ndarray  # NaN = missing
    energy_pos: np.ndarray  # positions (into time/power) of samples with an energy reading
    energy_j: np.ndarray  # the readings at those positions


@dataclass
class GpuEnergy:
    keys: list[tuple[str, int]]
    first: np.ndarray  # first sample time per GPU
    last: np.ndarray  # last sample time per GPU
    integrated_j: np.ndarray  # trapezoid over the GPU's power samples, gaps left out
    counter_j: np.ndarray  # counter delta plus integrated edges; NaN where the counter is unusable
    gap_s: np.ndarray | None = None  # seconds in gaps between samples (None: not known, read as 0)

    @property
    def gaps(self) -> np.ndarray:
        return np.zeros(len(self.first)) if self.gap_s is None else np.nan_to_num(self.gap_s)

    @property
    def sampled_s(self) -> np.ndarray:
        """Seconds from the GPU's first sample to its last, less its gaps (its share of GPU-hours)."""
        return np.maximum(self.last - self.first - self.gaps, 0.0)

    @property
    def joules(self) -> np.ndarray:
        return np.where(np.isnan(self.counter_j), self.integrated_j, self.counter_j)

    @property
    def methods(self) -> list[str]:
        return [INTEGRATED if np.isnan(c) else COUNTER for c in self.counter_j]

    @property
    def method(self) -> str | None:
        found = set(self.methods)
        if not found:
            return None
        return found.pop() if len(found) == 1 else "mixed"


def trapezoids(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Energy of each interval between consecutive samples with power (J); NaN samples are skipped over."""
    p = np.asarray(p, np.float64)
    ok = np.isfinite(p)
    if not ok.all():
        t, p = t[ok], p[ok]
    if len(t) < 2:
        return np.zeros(0)
    return np.diff(t) * (p[1:] + p[:-1]) * 0.5


def gpu_energy(samples) -> GpuEnergy:
    """Per GPU of `samples` (.series of GpuSeries in (host, gpu) order, .keys)."""
    series = samples.series
    if not series:
        return GpuEnergy([], np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0))
    sizes = [len(s.time) for s in series]
    gid = np.repeat(np.arange(len(series)), sizes)
    readings = np.full(len(gid), np.nan)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for s, o in zip(series, offsets):
        readings[o + np.asarray(s.energy_pos, np.int64)] = s.energy_j
    seg = summarize_segments(
        gid,
        np.concatenate([s.time for s in series]).astype(np.float64, copy=False),
        np.concatenate([np.asarray(s.power, np.float64) for s in series]),
        readings,
    )
    joined = join_segments(seg, len(series))
    joined.keys = samples.keys
    return joined


def records(energy: GpuEnergy, readings: list[int] | None = None) -> dict:
    """triage.json's "energy": "host:gpu" -> first, last (sample times), integrated_j, counter_j (null where
    the counter is unusable), energy_j and method (what the report uses), readings (counter readings), gap_s
    (unsampled seconds between first and last)."""

    def num(x):
        return None if not np.isfinite(x) else float(x)

    out = {}
    gaps = energy.gaps
    for k, ((h, g), a, b, i, c, j, m) in enumerate(
        zip(
            energy.keys, energy.first, energy.last, energy.integrated_j, energy.counter_j, energy.joules, energy.methods
        )
    ):
        out[f"{h}:{g}"] = {
            "first": num(a),
            "last": num(b),
            "integrated_j": num(i),
            "counter_j": num(c),
            "energy_j": num(j),
            "method": m,
            "readings": readings[k] if readings else 0,
            "gap_s": num(gaps[k]),
        }
    return out


# ---------------------------------------------------------------- energy from summaries of pieces


@dataclass
class Segments:
    """Rows summarised per GPU, one segment per GPU and run of rows (a row group, a file): all that joining
    them needs, so a trace read a row group at a time is never held whole. Arrays, one entry per segment."""

    gpu: np.ndarray  # the GPU's id
    t0: np.ndarray  # first and last row's time (with or without power)
    t1: np.ndarray
    fin: np.ndarray  # has a sample with finite power
    fin_t0: np.ndarray  # first and last finite-power sample
    fin_p0: np.ndarray
    fin_t1: np.ndarray
    fin_p1: np.ndarray
    integral: np.ndarray  # trapezoids between its finite samples, gaps left out
    limit: np.ndarray  # the longest interval that is not a gap (inf: too few samples to tell)
    gap: np.ndarray  # seconds in gaps between its finite samples
    reads: np.ndarray  # counter readings
    # first and last reading: time, value; the integral from the segment's first finite sample to the last one
    # at or before the reading, and whether the segment has such a sample
    r0_t: np.ndarray
    r0_e: np.ndarray
    r0_i: np.ndarray
    r0_in: np.ndarray
    r0_g: np.ndarray  # gap seconds from the first finite sample to the reading
    r1_t: np.ndarray
    r1_e: np.ndarray
    r1_i: np.ndarray
    r1_in: np.ndarray
    r1_g: np.ndarray


def summarize_segments(gid: np.ndarray, t: np.ndarray, p: np.ndarray, e: np.ndarray | None) -> Segments:
    """Segments of rows grouped by GPU: gid contiguous per GPU, time order within it; p NaN = no power,
    e NaN = no counter reading (None: no reading at all)."""
    n = len(gid)
    starts = np.flatnonzero(np.concatenate([[True], gid[1:] != gid[:-1]])) if n else np.zeros(0, np.int64)
    ends = np.append(starts[1:], n).astype(np.int64)
    finite = np.isfinite(p)
    # k indexes the finite samples: pieces[k] runs from finite sample k to k + 1; all rows when all are
    if finite.all():
        fin, tf, pf = None, t, p.astype(np.float64, copy=False)
        f0, f1 = starts, ends - 1
    else:
        fin = np.flatnonzero(finite)
        tf, pf = t[fin], p[fin].astype(np.float64)
        f0, f1 = np.searchsorted(fin, starts), np.searchsorted(fin, ends) - 1
    has = f1 >= f0
    dts = np.diff(tf)
    pieces = pf[1:] + pf[:-1]
    pieces *= dts
    pieces *= 0.5
    cross = f0[1:] - 1  # the piece into each segment's first finite sample comes from another GPU
    cross = cross[(cross >= 0) & (cross < len(pieces))]
    pieces[cross] = 0.0
    f0, f1 = np.where(has, f0, 0), np.where(has, f1, 0)
    limit, gaps = _gap_pieces(dts, f0, f1, has)
    gaps[cross] = 0.0
    pieces[gaps > 0] = 0.0
    if not len(tf):  # indexable when empty
        tf, pf = np.full(1, np.nan), np.full(1, np.nan)

    def integral_to(stop: np.ndarray) -> np.ndarray:
        """Per segment: the pieces from its first finite sample up to finite sample stop, summed per GPU
        (no other GPU's energy enters the rounding)."""
        return _interval_sums(pieces, f0, np.maximum(stop, f0))

    def gaps_to(stop: np.ndarray) -> np.ndarray:
        return _interval_sums(gaps, f0, np.maximum(stop, f0))

    reading = np.flatnonzero(np.isfinite(e)) if e is not None else np.zeros(0, np.int64)
    sr = np.searchsorted(starts, reading, "right") - 1  # each reading's segment
    ids = np.arange(len(starts))
    r_first = np.searchsorted(sr, ids, "left")
    r_last = np.searchsorted(sr, ids, "right") - 1
    reads = r_last - r_first + 1
    got = reads > 0

    def reading_at(which: np.ndarray) -> tuple[np.ndarray, ...]:
        row = reading[np.clip(which, 0, len(reading) - 1)] if len(reading) else np.zeros(len(ids), np.int64)
        last_fin = row if fin is None else np.searchsorted(fin, row, "right") - 1  # at or before the reading
        inside = got & has & (last_fin >= f0)
        integral = np.where(inside, integral_to(np.where(inside, last_fin, 0)), 0.0)
        gap = np.where(inside, gaps_to(np.where(inside, last_fin, 0)), 0.0)
        value = e[row] if e is not None else np.zeros(len(ids))
        return np.where(got, t[row], np.nan), np.where(got, value, np.nan), integral, inside, gap

    return Segments(
        gid[starts],
        t[starts],
        t[ends - 1],
        has,
        np.where(has, tf[f0], np.nan),
        np.where(has, pf[f0], np.nan),
        np.where(has, tf[f1], np.nan),
        np.where(has, pf[f1], np.nan),
        np.where(has, integral_to(f1), 0.0),
        limit,
        np.where(has, gaps_to(f1), 0.0),
        reads,
        *reading_at(r_first),
        *reading_at(r_last),
    )


def summarize_ticks(
    head: np.ndarray, tick_time: np.ndarray, p2: np.ndarray, readings: tuple[np.ndarray, np.ndarray] | None
) -> Segments:
    """summarize_segments of a chunk in the sampler's layout: ticks of the GPUs `head` (in that column order),
    one time per tick, no missing power (`p2`: ticks x GPUs; `readings`: (position in p2's flat row order,
    value) of each counter reading, in that order; None: no reading). The GPUs share the tick times, so the
    intervals, gaps and their limit are worked out once; the figures are summarize_segments' on the same rows
    grouped by GPU."""
    k, ticks = len(head), len(tick_time)
    dts = np.diff(tick_time)
    pieces = np.add(p2[1:], p2[:-1], dtype=np.float64)  # as float64(a) + float64(b), without a float64 copy
    # (a + b) * dt * 0.5 in one pass: halving is exact, so x * (dt * 0.5) rounds as (x * dt) * 0.5 does
    pieces *= (dts * 0.5)[:, None]
    limit = np.full(k, np.inf)
    gaps = np.zeros(len(dts))
    if ticks >= 3:
        typical = float(np.median(dts[:: max(1, len(dts) // 4096)]))
        limit[:] = max(GAP_PERIODS * typical, MIN_GAP_S)
        over = dts > limit[0]
        if over.any():
            gaps = np.where(over, dts, 0.0)
            pieces[over] = 0.0

    def to(stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per GPU the pieces and gap seconds from the first tick up to tick stop[j] (the pieces before it),
        summed from the first piece as summarize_segments sums them (reduceat: the same order, the same
        bits); one pass per distinct stop (the sampler reads every GPU's counter in the same tick)."""
        integral, gap = np.zeros(k), np.zeros(k)
        for s in np.unique(stop):
            if s <= 0:
                continue
            mine = stop == s
            integral[mine] = np.add.reduceat(pieces[:s], [0], axis=0)[0][mine]
            gap[mine] = np.add.reduceat(gaps[:s], [0])[0]
        return integral, gap

    last = np.full(k, ticks - 1)
    integral, gap_s = to(last)
    reads = np.zeros(k, np.int64)
    first_row, last_row = np.zeros(k, np.int64), np.zeros(k, np.int64)
    first_value, last_value = np.zeros(k), np.zeros(k)
    if readings is not None and len(readings[0]):
        at, values = readings
        rows, cols = np.divmod(at, k)
        reads = np.bincount(cols, minlength=k)
        by = np.argsort(cols, kind="stable")  # each GPU's readings together, in tick order
        c = cols[by]
        firsts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
        lasts = np.r_[firsts[1:], len(c)] - 1
        g = c[firsts]
        first_row[g], last_row[g] = rows[by[firsts]], rows[by[lasts]]
        first_value[g], last_value[g] = values[by[firsts]], values[by[lasts]]
    got = reads > 0

    def reading_at(row: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, ...]:
        i, g = to(np.where(got, row, 0))
        return (
            np.where(got, tick_time[row], np.nan),
            np.where(got, value, np.nan),
            np.where(got, i, 0.0),
            got.copy(),
            np.where(got, g, 0.0),
        )

    t0, t1 = np.full(k, tick_time[0]), np.full(k, tick_time[-1])
    return Segments(
        np.asarray(head),
        t0,
        t1,
        np.ones(k, dtype=bool),
        t0.copy(),
        p2[0].astype(np.float64),
        t1.copy(),
        p2[-1].astype(np.float64),
        integral,
        limit,
        gap_s,
        reads.astype(np.int64),
        *reading_at(first_row, first_value),
        *reading_at(last_row, last_value),
    )


def _gap_pieces(dts: np.ndarray, f0: np.ndarray, f1: np.ndarray, has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per segment the longest interval that is not a gap (from its median sampling interval), and per piece
    its length where it is a gap, else 0."""
    limit = np.full(len(f0), np.inf)
    gaps = np.zeros(len(dts))
    for i in np.flatnonzero(has & (f1 - f0 >= 2)):  # a segment per GPU and chunk: a short loop
        mine = dts[f0[i] : f1[i]]
        typical = float(np.median(mine[:: max(1, len(mine) // 4096)]))  # a strided sample: the median is robust
        limit[i] = max(GAP_PERIODS * typical, MIN_GAP_S)
        over = mine > limit[i]
        if over.any():
            gaps[f0[i] : f1[i]] = np.where(over, mine, 0.0)
    return limit, gaps


def _interval_sums(x: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """sum(x[start[i]:stop[i]]) for each i, 0 where empty; one pass (add.reduceat over the bounds)."""
    if not len(start):
        return np.zeros(0)
    bounds = np.empty(2 * len(start), np.int64)
    bounds[0::2], bounds[1::2] = start, stop
    sums = np.add.reduceat(np.append(x, 0.0), np.minimum(bounds, len(x)))[0::2]
    return np.where(stop > start, sums, 0.0)


def concat_segments(parts: list[Segments]) -> Segments:
    return Segments(*(np.concatenate([getattr(s, f) for s in parts]) for f in Segments.__dataclass_fields__))


def overlapping(seg: Segments) -> np.ndarray:
    """The GPU ids whose segments overlap in time (rows of two files interleaved): these cannot be joined
    from summaries, their rows must be sorted together."""
    if not len(seg.gpu):
        return np.zeros(0, np.int64)
    order = np.lexsort((seg.t0, seg.gpu))
    g, t0, t1 = seg.gpu[order], seg.t0[order], seg.t1[order]
    # the latest end so far on the same GPU: a running max that each GPU's offset keeps from the one before
    base = float(min(t0.min(), t1.min()))
    lift = 2.0 * (float(max(t0.max(), t1.max())) - base) + 1.0
    ended = np.maximum.accumulate(t1 - base + g * lift) - g * lift + base
    clash = (g[1:] == g[:-1]) & (t0[1:] < ended[:-1])
    return np.unique(g[1:][clash])


def join_segments(seg: Segments, ngpu: int) -> GpuEnergy:
    """Per GPU id 0..ngpu-1 (keys left empty): its segments joined in time order (stable: row order breaks
    ties); a trapezoid bridges one segment's last finite sample and the next one's first."""
    first, last = np.full(ngpu, np.nan), np.full(ngpu, np.nan)
    integrated, counter, gap_s = np.zeros(ngpu), np.full(ngpu, np.nan), np.zeros(ngpu)
    order = np.lexsort((np.arange(len(seg.gpu)), seg.t0, seg.gpu))
    bounds = np.searchsorted(seg.gpu[order], np.arange(ngpu + 1))
    for g in range(ngpu):
        mine = order[bounds[g] : bounds[g + 1]]
        if not len(mine):
            continue
        first[g], last[g] = seg.t0[mine[0]], seg.t1[mine].max()
        total, gap, prev, reads = 0.0, 0.0, None, 0
        start = end = None  # (time, value, integral up to it, gap seconds up to it) of the first and last reading
        for k in mine:
            into, into_gap = total, gap  # the integral and gaps up to this segment's first finite sample
            if seg.fin[k] and prev is not None:
                dt = seg.fin_t0[k] - prev[0]
                known = [x for x in (prev[2], seg.limit[k]) if np.isfinite(x)]
                if known and dt > max(known):  # longer than either side's own gap limit
                    into_gap += dt
                else:
                    into += dt * (seg.fin_p0[k] + prev[1]) * 0.5
            if seg.reads[k]:
                r0 = (seg.r0_t[k], seg.r0_e[k], *_upto(seg, k, 0, into, into_gap, total, gap))
                end = (seg.r1_t[k], seg.r1_e[k], *_upto(seg, k, 1, into, into_gap, total, gap))
                start = start or r0
                reads += int(seg.reads[k])
            if seg.fin[k]:
                total, gap = into + seg.integral[k], into_gap + seg.gap[k]
                prev = (seg.fin_t1[k], seg.fin_p1[k], seg.limit[k])
        integrated[g], gap_s[g] = total, gap
        if reads >= 2:
            assert start is not None and end is not None  # set by the segments that had the readings
            delta = float(end[1] - start[1])
            # else a counter reset, one instant, or a gap between the readings (the counter ran on while
            # nobody sampled): integrate instead
            if delta > 0 and end[0] > start[0] and end[3] == start[3]:
                counter[g] = delta + start[2] + (total - end[2])
    return GpuEnergy([], first, last, integrated, counter, gap_s)


def _upto(seg: Segments, k: int, which: int, into: float, into_gap: float, total: float, gap: float) -> tuple:
    """(integral, gap seconds) up to segment k's first (which 0) or last (1) reading, from the GPU's start."""
    inside = (seg.r0_in if which == 0 else seg.r1_in)[k]
    if not inside:
        return total, gap
    return into + (seg.r0_i if which == 0 else seg.r1_i)[k], into_gap + (seg.r0_g if which == 0 else seg.r1_g)[k]


def in_time_order(t: np.ndarray, p: np.ndarray, pos: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, ...]:
    """A GPU's samples (and its readings' positions) sorted by time, stably; as they are when already so."""
    if len(t) < 2 or not np.any(t[1:] < t[:-1]):
        return t, p, pos, e
    order = np.argsort(t, kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    new_pos = rank[pos]
    by = np.argsort(new_pos, kind="stable")
    return t[order], p[order], new_pos[by], e[by]


def join_parts(by_key: dict, make) -> list:
    """One series per (host, gpu), in key order: a GPU found in several files (a restarted sampler) is joined in
    time order. `make(host, gpu, time, power, energy_pos, energy_j)` builds the series (report or energy type)."""
    series = []
    for key in sorted(by_key):
        parts = by_key[key]
        if len(parts) == 1:
            series.append(parts[0])
            continue
        offsets = np.cumsum([0] + [len(p.time) for p in parts[:-1]])
        series.append(
            make(
                key[0],
                key[1],
                *in_time_order(
                    np.concatenate([p.time for p in parts]),
                    np.concatenate([p.power for p in parts]),
                    np.concatenate([p.energy_pos + o for p, o in zip(parts, offsets)]),
                    np.concatenate([p.energy_j for p in parts]),
                ),
            )
        )
    return series

"""Power triage's rules: each window's class from its power and utilization, its peers and the run.

Band edges are per GPU: the table's, refined by the levels the run shows
(levels.py: idle with a context held, the wait level, compute plateaus), so
"idle_w", "low_max_w" and "compute_min_w" below are the GPU's own.

Rules, in order (each sees the labels the earlier ones left):
1. Band of the median P of the window and the 2 known windows on each side
   (a median keeps steps sharp and drops single-window spikes), with
   hysteresis: a window within a margin of a band edge keeps the band of the
   window before it when that band touches the edge (margins: 10% of
   compute_min_w - low_max_w at compute_min_w, 10% of low_max_w - idle_w at
   low_max_w), so noise around an edge does not flap. The median never moves
   a window two bands from its own P, nor out of the high band when its own P
   is past the margin there: no GPU draws that much without computing, so a
   1 s step between waits stays compute.
2. Class of a window:
   - P >= 90% of the power cap (AT_CAP_SHARE): compute, whatever U reads
     (a GPU held at its cap is working flat out);
   - >= 15% of its samples high and >= 15% low, U < busy_util_pct:
     data_starvation (kernel bursts between host gaps; a 1 s window at 10 Hz
     sees both; at busy U the low samples were a kernel waiting, not a gap);
   - high band: U >= busy_util_pct -> compute, else data_starvation (gaps
     with no kernel between bursts, as a 1 s average reads them);
   - mid band: U >= busy_util_pct -> communication, else data_starvation;
   - low band: U >= busy_util_pct -> a wait (a kernel resident at low
     power: rule 4), U <= idle_util_pct -> idle; in between: idle when P is
     at most idle_w + 30% of (low_max_w - idle_w), U < 10% and no sample is in
     the high band (host copies of a checkpoint, teardown: a kernel for a few
     % of the time at idle power), else low-util (data_starvation unless rule
     5 claims it: light inference at 5-25% is work, not idle);
   - no utilization in the window: mid -> communication; low -> idle below
     idle_w + 30% of (low_max_w - idle_w), else a wait.
   Then peers: in each window (matched by time over every GPU of the input),
   the GPUs within 12% of the peers' median power and 15 points of their
   median U, if at least half of them and two, take their most common class
   (a strict plurality): GPUs doing the same thing at the same time read the
   same, and a GPU that departs from them keeps its own class.
3. Majority filter: a window takes the most common class among itself and
   the 2 known windows on each side on its GPU; a tie keeps its own class, and
   so does a window whose own P is two bands from the winner's class (compute
   high, communication mid, waits and idle low) or that is compute past the
   high margin.
4. Waits (the power-only wait rule). A contiguous wait *ends* when compute,
   communication or data starvation resumes on that GPU within
   deadlock_after_s after it; one that does not end is deadlock if it lasted
   deadlock_after_s (it never ended, or the job died after it), else
   communication (a trace that stops seconds into a wait proves nothing). A
   wait that ends is checkpoint if it lasted deadlock_after_s (a peer was
   checkpointing). A shorter one is communication (a sync wait: a straggler,
   a slow collective) unless it lasted at least 10 s (CHECKPOINT_MIN_S) and
   its episode (the ended waits of all GPUs of the input that overlap in time,
   3 windows of slack) shows a checkpoint, by either of:
   - the idle rank: a GPU that is not waiting in the episode is idle or
     low-util for at least half of it, in one stretch that follows activity
     (or a wait), is followed by activity (or a wait), and ends within 3
     windows of the episode's end: the writer, whom the others wait for in a
     collective (~100% utilization at near-idle power) until it comes back;
   - periodicity: its own length is within x1.5 (LENGTH_RATIO) of at least 3
     other episodes' (>= 10 s, long ones included), and of the intervals
     between the starts of these consecutive similar episodes at least 3, and
     at least half, are within 20% (PERIOD_TOLERANCE) of their median, one of
     them next to it (a checkpoint every N steps). Three pauses are not a
     series: two random intervals agree that well too often.
   So a wait that never ends stays deadlock however many ranks sit idle in it
   or however regular the pauses before it were; a wait of a few seconds, or
   one with no idle rank that does not recur, stays communication.
5. Peers (every GPU of the input, windows matched by time): a run of idle or
   low-util windows on a GPU that was active before it
   - with activity after it, overlapping peers' checkpoint waits for at least
     half its length -> checkpoint (the rank writing the checkpoint);
   - reaching the GPU's last sample, overlapping peers' deadlock waits for at
     least half its length or deadlock_after_s -> deadlock where it overlaps
     them, a few windows of slack either side (the stuck rank).
6. Run info (heartbeats, metrics; optional), in this order:
   - a power-only deadlock (or, when heartbeat events exist, checkpoint) label
     on one of the run's GPUs, from the run's first progress stamp to
     deadlock_after_s after its last, that is neither in a stall nor in a
     checkpoint interval (both below) goes back to what the window showed: a
     wait -> communication, a quiet window -> idle or data_starvation;
   - with confidence 1: a window >= 50% inside a step's data wait, or inside
     a step that waited for data for >= 50% of its time, with P <
     compute_min_w -> data_starvation;
   - with confidence 1: any other window >= 50% inside steps (metrics step
     end - step_time_s to step end) that power labelled data_starvation,
     low-util or idle, outside a stall -> compute: the loader kept up, so a
     GPU below full power was held back by the step's own host work
     (launches, small kernels), which is what the step costs;
   - with confidence 1: a data_starvation or low-util window >= 50% after the
     GPU's ranks all sent "done" (every rank's, when no rank maps to a GPU),
     P < low_max_w and U < busy_util_pct -> idle (teardown);
   - with confidence 1: a window >= 50% inside a checkpoint interval (a rank's
     "checkpoint" or "export" event to its next event: writing the final
     model is the same I/O pause) with P < compute_min_w -> checkpoint; an
     open interval (no later event) proves nothing and is left to the rest;
   - with confidence 1, in a stall: P < compute_min_w with U >= busy_util_pct
     -> deadlock, and idle or low-util while another of the run's GPUs is so
     waiting in the same window -> deadlock (the stuck rank). A stall is a gap
     of >= deadlock_after_s between progress stamps (metrics step ends,
     heartbeat events and states) after the run started, before any rank
     exported or finished, outside checkpoint intervals; the gap after the
     last stamp counts when the GPU's trace goes on for deadlock_after_s past it.
   Ranks map to GPUs by the heartbeat's GPU UUID (trace meta gpus[].uuid),
   else host + local_rank; the checkpoint intervals of a rank that maps to no
   GPU apply to every GPU; data waits and steps apply only to mapped GPUs.

Without metrics, a step held back by the host (a small model: launch-bound
kernels at mid power and ~50% utilization) and a step starved by its data
loader look alike: both read data_starvation. Only the run's data_wait_s
tells them apart (rule 6). Likewise a checkpoint written by the only GPU of a
job looks idle without heartbeats: no peer waits at low power for it. And rule
4 calls any ended pause of >= 10 s with one rank idle, or any regular series of
them, a checkpoint: a rank held that long by other host work (a stalled data
loader, evaluation on the CPU, a periodic upload) reads the same; a checkpoint
shorter than 10 s, or a single one whose writer's GPU is not in the input,
reads communication. Heartbeat events settle both (rule 6).

Confidence: 0 for unknown, 1 for run-info labels; otherwise the distance of
P from the nearest band edge in units of 2.5 margins (capped at 1), for
labels that also rest on U the lesser of that and U's distance from the
nearest utilization threshold in 5-point units; oscillating windows use the
lesser high/low share / 0.3; a class the majority filter changed is capped
at 0.5.
"""

from __future__ import annotations

import numpy as np

from wattgate.power.triage.arrays import _bounds, _ranges, _runs
from wattgate.power.triage.levels import _Edges
from wattgate.power.triage.phases import (
    ACTIVE,
    CHECKPOINT,
    COMMUNICATION,
    COMPUTE,
    DATA_STARVATION,
    DEADLOCK,
    IDLE,
    LOW_UTIL,
    WAIT,
)
from wattgate.power.triage.runinfo import (
    RunInfo,
    _checkpoint_intervals,
    _covered_share,
    _done_times,
    _progress,
    map_ranks,
)

EDGE_MARGIN = 0.10  # hysteresis margin, share of the band next to the edge
OSCILLATION_SHARE = 0.15  # share of samples high and low that marks kernel bursts between gaps
NO_UTIL_IDLE_SHARE = 0.30  # without utilization: low-band power this far above idle is a wait
LIGHT_UTIL_PCT = 10.0  # below this, utilization at idle power is too light to be work (host copies, teardown)
SMOOTH_RADIUS = 2  # majority filter and power median: windows on each side
COVER_SHARE = 0.5  # share of a window inside a heartbeat interval that makes it count
PEER_SLACK = 3  # windows of slack around peers' waits when matching the stuck rank
CHECKPOINT_MIN_S = 10.0  # a shorter pause is a sync wait, whatever its peers do
PERIODIC_MIN = 4  # pauses in a series before it counts as periodic (3 match by chance too often)
PERIOD_TOLERANCE = 0.2  # start-to-start interval within this share of the series' median
LENGTH_RATIO = 1.5  # pauses of "similar length" are within this factor of each other
AT_CAP_SHARE = 0.9  # a window at this share of the power cap is compute whatever its utilization
PEER_POWER_TOL = 0.12  # a GPU within this share of its peers' median power (and PEER_UTIL_TOL) is with them
PEER_UTIL_TOL = 15.0


def _rolling_median(x: np.ndarray, gpu: np.ndarray, ngpu: int, radius: int) -> np.ndarray:
    """Median of each window and `radius` known windows on each side on the same GPU."""
    if len(x) == 0 or radius <= 0:
        return x
    gs, ge = _bounds(gpu, ngpu)
    pos = np.arange(len(x))
    lo, hi = gs[gpu], ge[gpu] - 1
    # near a GPU's ends, mirror inside its range so the window stays centred and odd-sized
    cols = []
    for off in range(-radius, radius + 1):
        j = pos + off
        j = np.where(j < lo, 2 * lo - j, j)
        j = np.where(j > hi, 2 * hi - j, j)
        cols.append(x[np.clip(j, lo, hi)])
    if radius == 2 and not np.isnan(x).any():  # the median of 5 by min/max (picks the same value)
        a, b, c, d, e = cols
        f = np.maximum(np.minimum(a, b), np.minimum(c, d))
        g = np.minimum(np.maximum(a, b), np.maximum(c, d))
        return np.maximum(np.minimum(e, f), np.minimum(np.maximum(e, f), g))
    return np.partition(np.stack(cols, axis=1), radius, axis=1)[:, radius]


def _raw_band(p: np.ndarray, e: _Edges) -> np.ndarray:
    return ((p >= e.lo).astype(np.int8) + (p >= e.hi)).astype(np.int8)


def _band(p_med: np.ndarray, p: np.ndarray, gpu: np.ndarray, e: _Edges) -> np.ndarray:
    """0 low, 1 mid, 2 high (rule 1): the band of the window power median, with hysteresis at both edges;
    never two bands away from the window's own power (a burst between waits stays high)."""
    lo, hi = e.lo, e.hi
    m_lo, m_hi = EDGE_MARGIN * (lo - e.idle), EDGE_MARGIN * (hi - lo)
    raw = _raw_band(p_med, e)
    definite = (p_med < lo - m_lo) | ((p_med >= lo + m_lo) & (p_med < hi - m_hi)) | (p_med >= hi + m_hi)
    definite[np.flatnonzero(np.diff(gpu)) + 1] = True  # hysteresis never crosses GPUs
    if len(definite):
        definite[0] = True
    lower = np.where(p_med < (lo + hi) / 2, 0, 1).astype(np.int8)  # the bands touching the nearer edge
    positions = np.arange(len(p_med))
    out = raw
    for _ in range(64):
        last = np.maximum.accumulate(np.where(definite, positions, 0))
        prev = raw[last]
        fits = (prev == lower) | (prev == lower + 1)
        jump = ~definite & ~fits  # arrived from a band away from this edge: it takes its raw band
        if not jump.any():
            out = np.where(definite, raw, prev)
            break
        # only the first such window after each definite one is certain; the ones after it carry its band
        at = np.flatnonzero(jump)
        _, first = np.unique(last[at], return_index=True)
        definite[at[first]] = True
    own = _raw_band(p, e)
    # the median may not move a window two bands, nor lower one clearly in the compute band: no GPU draws
    # that much power without computing, however short the burst
    keep_own = (np.abs(out.astype(np.int16) - own) >= 2) | (p >= hi + m_hi)
    return np.where(keep_own, own, out).astype(np.int8)


def _classify(p, u, high, low, band, e: _Edges) -> tuple[np.ndarray, np.ndarray]:
    """(class, oscillating) per window (rule 2)."""
    with np.errstate(invalid="ignore"):
        busy, idle = u >= e.busy_util, u <= e.idle_util
        light_util = u < LIGHT_UTIL_PCT
    no_util = np.isnan(u)
    cls = np.full(len(p), LOW_UTIL, np.int8)
    cls[(band == 2) & (busy | no_util)] = COMPUTE
    cls[(band == 2) & ~busy & ~no_util] = DATA_STARVATION
    cls[(band == 1) & (busy | no_util)] = COMMUNICATION
    cls[(band == 1) & ~busy & ~no_util] = DATA_STARVATION
    low_band = band == 0
    cls[low_band & busy] = WAIT
    cls[low_band & idle] = IDLE
    quiet = e.idle + NO_UTIL_IDLE_SHARE * (e.lo - e.idle)
    # a little utilization at idle power with no sample in the high band is work too light to draw
    # power (host copies, teardown): compute bursts filling that share of the time would lift P above `quiet`
    light = low_band & ~busy & ~idle & light_util & (p <= quiet) & (high == 0)
    cls[light] = IDLE
    cls[low_band & no_util] = np.where((p <= quiet)[low_band & no_util], IDLE, WAIT)
    # kernel bursts between host gaps; at busy utilization the low samples were a kernel waiting, not a gap
    osc = (high >= OSCILLATION_SHARE) & (low >= OSCILLATION_SHARE) & ~busy
    cls[osc] = DATA_STARVATION
    # at the power cap the GPU is working flat out whatever utilization reads (sampled kernel occupancy)
    at_cap = p >= AT_CAP_SHARE * e.cap
    cls[at_cap] = COMPUTE
    osc &= ~at_cap
    return cls, osc


_CLASS_BAND = np.array([2, 1, -1, -1, -1, 0, -1, 0, -1], np.int8)  # band a class implies; -1: any


def _majority(
    cls: np.ndarray, gpu: np.ndarray, ngpu: int, radius: int, own_band: np.ndarray, keep: np.ndarray | None = None
) -> np.ndarray:
    """Most common class within `radius` windows on each side on the same GPU; ties keep the window's own,
    and so do a window whose own power is two bands from the winner's and the windows in `keep`."""
    if len(cls) == 0 or radius <= 0:
        return cls
    values = np.unique(cls)
    compact = np.searchsorted(values, cls)
    onehot = np.zeros((len(cls) + 1, len(values)), np.uint8)
    onehot[np.arange(1, len(cls) + 1), compact] = 1
    cum = np.cumsum(onehot, axis=0, dtype=np.int32)
    gs, ge = _bounds(gpu, ngpu)
    pos = np.arange(len(cls))
    a = np.maximum(pos - radius, gs[gpu])
    b = np.minimum(pos + radius + 1, ge[gpu])
    counts = cum[b] - cum[a]
    best = counts.max(axis=1)
    own = counts[pos, compact]
    winner = values[np.argmax(counts, axis=1)].astype(cls.dtype)
    wb = _CLASS_BAND[winner]
    stay = (own == best) | ((wb >= 0) & (np.abs(wb.astype(np.int16) - own_band) >= 2))
    if keep is not None:
        stay |= keep
    return np.where(stay, cls, winner).astype(cls.dtype)


def _peer_vote(cls, p, u, index, e: _Edges, gpu: np.ndarray | None = None) -> np.ndarray:
    """GPUs doing the same thing at the same time get the same class: in each window (matched by time over
    every GPU of the input), the GPUs within PEER_POWER_TOL of the peers' median power and PEER_UTIL_TOL of
    their median utilization, if at least half of them and two, take their most common class (a strict
    plurality; a tie changes nothing). A GPU that departs from its peers keeps its own class."""
    n = len(cls)
    if n == 0:
        return cls
    uu = np.where(np.isnan(u), -1.0, u)
    lo = int(index.min())
    span = int(index.max()) - lo + 1
    if gpu is not None and span * (int(gpu.max()) + 1) <= 2 * n + (1 << 20) and not np.isnan(p).any():
        # the usual case, GPUs over the same hours: a (time x GPU) grid sorted along each row
        row = index - lo
        counts = np.bincount(row, minlength=span)
        mid = np.maximum(counts - 1, 0) // 2
        med_p, med_u = (_row_median(x, row, gpu, span, mid) for x in (p, uu))
        grp = row
    else:
        order = np.lexsort((p, index))
        idx = index[order]
        new = np.ones(n, dtype=bool)
        new[1:] = idx[1:] != idx[:-1]
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, n))
        grp = np.empty(n, np.int64)
        grp[order] = np.cumsum(new) - 1
        med_p = p[order][starts + (counts - 1) // 2]
        order_u = np.lexsort((uu, index))
        med_u = uu[order_u][starts + (counts - 1) // 2]
    ngrp = len(counts)
    with_peers = (np.abs(p - med_p[grp]) <= PEER_POWER_TOL * np.maximum(med_p[grp], e.lo)) & (
        np.abs(uu - med_u[grp]) <= PEER_UTIL_TOL
    )
    n_with = np.bincount(grp, weights=with_peers, minlength=ngrp)
    ok = (counts >= 2) & (n_with >= np.maximum(2, np.ceil(counts / 2)))
    sel = with_peers & ok[grp]
    votes = np.bincount(grp[sel] * 9 + cls[sel], minlength=ngrp * 9).reshape(ngrp, 9)
    best = votes.argmax(axis=1)
    top = votes.max(axis=1)
    votes[np.arange(ngrp), best] = -1
    strict = top > votes.max(axis=1)
    take = sel & strict[grp]
    out = cls.copy()
    out[take] = best[grp[take]]
    return out


def _row_median(x: np.ndarray, row: np.ndarray, gpu: np.ndarray, span: int, mid: np.ndarray) -> np.ndarray:
    """Per row of a (time x GPU) grid: the (counts - 1) // 2-th smallest of its values (the lower median)."""
    grid = np.full((span, int(gpu.max()) + 1), np.inf)
    grid[row, gpu] = x
    grid.sort(axis=1)
    return grid[np.arange(span), mid]


def _next_true(mask: np.ndarray) -> np.ndarray:
    """Position of the first True at or after each position (len(mask) if none)."""
    n = len(mask)
    idx = np.where(mask, np.arange(n), n)
    return np.minimum.accumulate(idx[::-1])[::-1]


def _wait_runs(cls, index, gpu, window_s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end (exclusive) and length in seconds of every contiguous run of WAIT windows."""
    starts, ends = _runs(cls, gpu)
    waits = cls[starts] == WAIT
    s, e = starts[waits], ends[waits]
    return s, e, (index[e - 1] + 1 - index[s]) * window_s if len(s) else np.zeros(0)


def _resolve_waits(cls, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 4: a wait becomes communication, checkpoint or deadlock by its length and what follows."""
    out = cls.copy()
    s, e, length = _wait_runs(cls, index, gpu, window_s)
    if len(s) == 0:
        return out
    _, ge = _bounds(gpu, ngpu)
    nxt = _next_true(np.isin(cls, ACTIVE))
    resume = np.minimum(nxt[np.minimum(e, len(cls) - 1)], len(cls) - 1)
    resumes = (e < len(cls)) & (nxt[np.minimum(e, len(cls) - 1)] < ge[gpu[s]])
    gap = (index[resume] - index[e - 1] - 1) * window_s
    label = np.where(
        length < deadlock_after_s, COMMUNICATION, np.where(resumes & (gap < deadlock_after_s), CHECKPOINT, DEADLOCK)
    ).astype(cls.dtype)
    out[_ranges(s, e)] = np.repeat(label, e - s)
    return out


def _short_checkpoints(cls, smooth, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 4, second half: a pause shorter than deadlock_after_s that shows a checkpoint (an idle
    writer, or a periodic series) becomes checkpoint instead of communication."""
    out = cls.copy()
    s, e, length = _wait_runs(smooth, index, gpu, window_s)
    if len(s) == 0:
        return out
    n = len(smooth)
    gs, ge = _bounds(gpu, ngpu)
    # "ended" exactly as rule 4 measures it, so long pauses (already checkpoint) join the series
    nxt = _next_true(np.isin(smooth, ACTIVE))
    after = nxt[np.minimum(e, n - 1)]
    resumes = (e < n) & (after < ge[gpu[s]])
    gap = (index[np.minimum(after, n - 1)] - index[e - 1] - 1) * window_s
    member = (length >= CHECKPOINT_MIN_S) & resumes & (gap < deadlock_after_s)
    if not member.any():
        return out
    s, e = s[member], e[member]
    a, b, g = index[s], index[e - 1] + 1, gpu[s]

    # episodes: the pauses of every GPU that overlap in time (peers enter and leave a collective a
    # window or two apart)
    order = np.argsort(a, kind="stable")
    a, b, g, s, e = a[order], b[order], g[order], s[order], e[order]
    reach = np.maximum.accumulate(b)
    new = np.ones(len(a), dtype=bool)
    new[1:] = a[1:] > reach[:-1] + PEER_SLACK
    ep = np.cumsum(new) - 1
    ep_a = np.minimum.reduceat(a, np.flatnonzero(new))
    ep_b = np.maximum.reduceat(b, np.flatnonzero(new))
    nep = len(ep_a)

    # the idle rank: a quiet stretch (idle or low-util) between activity on a GPU that is not pausing,
    # ending with the episode (the others block until the writer comes back)
    quiet = np.isin(smooth, (IDLE, LOW_UTIL))
    qs, qe = _runs(quiet, gpu)
    keep = quiet[qs]
    qs, qe = qs[keep], qe[keep]
    busy_or_wait = np.isin(smooth, ACTIVE + (WAIT,))
    before = (qs > gs[gpu[qs]]) & busy_or_wait[np.maximum(qs - 1, 0)]
    after_ok = (qe < ge[gpu[qs]]) & busy_or_wait[np.minimum(qe, n - 1)]
    keep = before & after_ok & ((index[qe - 1] + 1 - index[qs]) * window_s >= 0.5 * CHECKPOINT_MIN_S)
    qa, qb, qg = index[qs[keep]], index[qe[keep] - 1] + 1, gpu[qs[keep]]
    writer = np.zeros(nep, dtype=bool)
    for k in range(nep if len(qa) else 0):
        overlap = np.minimum(qb, ep_b[k]) - np.maximum(qa, ep_a[k])
        pausing = np.isin(qg, g[ep == k])
        writer[k] = bool(
            (~pausing & (overlap >= 0.5 * (ep_b[k] - ep_a[k])) & (np.abs(qb - ep_b[k]) <= PEER_SLACK)).any()
        )

    # periodicity: pauses of similar length at a regular interval (a checkpoint every N steps)
    periodic = np.zeros(nep, dtype=bool)
    ep_len = (ep_b - ep_a).astype(np.float64)
    for k in range(nep):
        similar = np.flatnonzero((ep_len <= LENGTH_RATIO * ep_len[k]) & (ep_len * LENGTH_RATIO >= ep_len[k]))
        if len(similar) < PERIODIC_MIN:
            continue
        intervals = np.diff(ep_a[similar]).astype(np.float64)
        regular = np.abs(intervals - np.median(intervals)) <= PERIOD_TOLERANCE * np.median(intervals)
        at = int(np.searchsorted(similar, k))
        own = (at > 0 and regular[at - 1]) or (at < len(intervals) and regular[at])
        # most intervals regular: random stragglers' waits put ~15% of theirs within 20% of the median
        periodic[k] = bool(own) and regular.sum() >= max(PERIODIC_MIN - 1, 0.5 * len(intervals))

    hit = (writer | periodic)[ep]
    if hit.any():
        pos = _ranges(s[hit], e[hit])
        out[pos[out[pos] == COMMUNICATION]] = CHECKPOINT
    return out


def _near(index: np.ndarray, mask: np.ndarray, slack: int = 0) -> np.ndarray:
    """Per window: does any window of `mask` (any GPU) lie within `slack` windows of its time?"""
    marked = np.unique(index[mask])
    if len(marked) == 0:
        return np.zeros(len(index), dtype=bool)
    j = np.searchsorted(marked, index - slack)
    return (j < len(marked)) & (marked[np.minimum(j, len(marked) - 1)] <= index + slack)


def _peer_rules(cls, from_wait, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 5: the checkpoint writer and the stuck rank, from what their peers do at the same time."""
    out = cls.copy()
    if len(cls) == 0:
        return out
    ck = _near(index, (cls == CHECKPOINT) & from_wait)
    dl_tight = _near(index, (cls == DEADLOCK) & from_wait)
    dl = _near(index, (cls == DEADLOCK) & from_wait, PEER_SLACK)
    if not (ck.any() or dl.any()):
        return out
    quiet = np.isin(cls, (IDLE, LOW_UTIL))
    starts, ends = _runs(quiet, gpu)
    keep = quiet[starts]
    s, e = starts[keep], ends[keep]
    gs, ge = _bounds(gpu, ngpu)
    active_pos = np.flatnonzero(np.isin(cls, ACTIVE))
    k = np.searchsorted(active_pos, gs[gpu[s]])
    first_active = np.where(k < len(active_pos), active_pos[np.minimum(k, len(active_pos) - 1)], len(cls))
    was_active = first_active < s
    length = e - s
    ck_c, dl_c = (np.concatenate([[0], np.cumsum(m)]) for m in (ck, dl_tight))
    ck_overlap, dl_overlap = ck_c[e] - ck_c[s], dl_c[e] - dl_c[s]
    last = e == ge[gpu[s]]
    writer = was_active & ~last & (ck_overlap >= 0.5 * length)
    stuck = was_active & last & ((dl_overlap >= 0.5 * length) | (dl_overlap * window_s >= deadlock_after_s))
    if writer.any():
        out[_ranges(s[writer], e[writer])] = CHECKPOINT
    if stuck.any():
        pos = _ranges(s[stuck], e[stuck])
        out[pos[dl[pos]]] = DEADLOCK
    return out


def _run_info_rules(cls, conf, smooth, p, u, index, gpu, keys, info: RunInfo, e: _Edges, window_s, deadlock_after_s):
    """Rule 6: heartbeat- and metrics-backed labels, in place."""
    rank_gpu = map_ranks(info, keys)
    ngpu = len(keys)
    gs, ge = _bounds(gpu, ngpu)
    w0, w1 = index * window_s, (index + 1) * window_s
    below = p < e.hi
    with np.errstate(invalid="ignore"):
        busy = u >= e.busy_util
    run_gpus = np.zeros(ngpu, dtype=bool)
    run_gpus[list(set(rank_gpu.values()))] = True
    if not run_gpus.any():  # no rank maps to a GPU: run-wide facts apply to all of them
        run_gpus[:] = True
    in_run = run_gpus[gpu]

    intervals = _checkpoint_intervals(info.events)
    done = _done_times(info)
    in_ckpt = np.zeros(len(cls), dtype=bool)
    starving = np.zeros(len(cls), dtype=bool)
    stepping = np.zeros(len(cls), dtype=bool)
    finished = np.zeros(len(cls), dtype=bool)
    if info.has_metrics:  # as arrays once: the GPUs' rows are picked out of them below
        m_rank = info.metrics["rank"].to_numpy()
        m_time, m_step, m_wait = (info.metrics[c].to_numpy(float) for c in ("time", "step_time_s", "data_wait_s"))
    for g in range(ngpu):
        sl = slice(gs[g], ge[g])
        ranks = [r for r, gg in rank_gpu.items() if gg == g]
        if info.has_metrics and ranks:
            mine = np.isin(m_rank, ranks)
            step_s, wait_s = m_step[mine], m_wait[mine]
            begin = m_time[mine] - step_s
            # a data wait, or all of a step that waited for data most of its time
            starved = wait_s >= COVER_SHARE * step_s
            share = _covered_share(
                np.concatenate([begin, begin[starved]]),
                np.concatenate([begin + wait_s, begin[starved] + step_s[starved]]),
                w0[sl],
                w1[sl],
            )
            starving[sl] = share >= COVER_SHARE
            fed = ~starved
            stepping[sl] = _covered_share(begin[fed], begin[fed] + step_s[fed], w0[sl], w1[sl]) >= COVER_SHARE
        mine = intervals[intervals["rank"].isin(ranks) | ~intervals["rank"].isin(list(rank_gpu))]
        share = _covered_share(mine["start"].to_numpy(float), mine["end"].to_numpy(float), w0[sl], w1[sl])
        in_ckpt[sl] = share >= COVER_SHARE
        # a GPU is done when all its ranks are; with no rank placed anywhere, when every rank is
        owners = ranks or ([] if rank_gpu else list(done))
        if owners:
            end = max(done[r] for r in owners)
            finished[sl] = w0[sl] + COVER_SHARE * window_s >= end
    stepping &= ~starving

    stamps, run_over = _progress(info)
    stalled = np.zeros(len(cls), dtype=bool)
    during = np.zeros(len(cls), dtype=bool)
    if len(stamps):
        k = np.searchsorted(stamps, w0, side="right")  # stamps[k-1] <= window start; k == 0: before the run
        after_start = k > 0
        during = in_run & after_start & (w0 < stamps[-1] + deadlock_after_s)
        prev = stamps[np.maximum(k - 1, 0)]
        k_next = np.searchsorted(stamps, w1, side="left")
        nxt = np.where(k_next < len(stamps), stamps[np.minimum(k_next, len(stamps) - 1)], np.inf)
        trailing_ok = np.isfinite(nxt) | (w1[ge[gpu] - 1] - stamps[-1] >= deadlock_after_s)
        stalled = after_start & (w0 < run_over) & (nxt - prev >= deadlock_after_s) & trailing_ok & ~in_ckpt & in_run

    # power-only hang and checkpoint labels that the run's own record contradicts go back to what
    # the window showed: a wait that was no hang is a (long) sync wait, a quiet window is idle or low-util
    wrong = during & (cls == DEADLOCK) & ~stalled
    if len(info.events):
        wrong |= during & (cls == CHECKPOINT) & ~in_ckpt & ~stalled
    cls[wrong] = np.where(smooth[wrong] == WAIT, COMMUNICATION, smooth[wrong])

    hit = starving & below
    cls[hit], conf[hit] = DATA_STARVATION, 1.0
    # the step's own work: a step that did not wait for data but left the GPU low or quiet was held
    # back by the host (launches, small kernels), not by the loader. A stall keeps the power labels
    # so the hang rules below still see an idle stuck rank.
    hit = stepping & ~stalled & np.isin(cls, (DATA_STARVATION, LOW_UTIL, IDLE))
    cls[hit], conf[hit] = COMPUTE, 1.0
    # after the run said done the GPU is being released: quiet windows are idle, not starved
    hit = finished & (p < e.lo) & ~busy & np.isin(cls, (DATA_STARVATION, LOW_UTIL))
    cls[hit], conf[hit] = IDLE, 1.0
    hit = in_ckpt & below
    cls[hit], conf[hit] = CHECKPOINT, 1.0
    waiting = stalled & below & busy
    stuck = stalled & np.isin(cls, (IDLE, LOW_UTIL, DATA_STARVATION)) & below & ~busy & _near(index, waiting)
    hit = waiting | stuck
    cls[hit], conf[hit] = DEADLOCK, 1.0


def _confidence(p, u, high, low, osc, raw, smooth, final, filled, e: _Edges) -> np.ndarray:
    lo, hi = e.lo, e.hi
    m_lo, m_hi = EDGE_MARGIN * (lo - e.idle), EDGE_MARGIN * (hi - lo)
    conf_p = np.minimum(np.abs(p - lo) / (2.5 * m_lo), np.abs(p - hi) / (2.5 * m_hi))
    du = np.minimum(np.abs(u - e.busy_util), np.abs(u - e.idle_util)) / 5.0
    conf_u = np.where(np.isnan(u), 1.0, du)
    conf = np.where(final == COMPUTE, conf_p, np.minimum(conf_p, conf_u))
    conf = np.where(osc, np.minimum(high, low) / 0.3, conf)  # bursts are judged by shares, not by the means
    conf = np.where(raw != smooth, np.minimum(conf, 0.5), conf)
    conf = np.where(filled, np.minimum(conf, 0.5), conf)  # no sample: the phase around a short gap
    return np.clip(conf, 0.0, 1.0).astype(np.float32)


# ---------------------------------------------------------------- triage

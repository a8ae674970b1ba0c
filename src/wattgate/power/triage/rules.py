"""Power triage's rules: each window's class from its power and utilization, its peers and the run.

Band edges are per GPU: the table's, refined by the levels the run shows
(levels.py: idle with a context held, the wait level, compute plateaus), so
"idle_w", "low_max_w" and "compute_min_w" below are the GPU's own.

Rules, in order (each sees the labels the earlier ones left; the rolling median
and the majority filter live in smoothing.py, rule 6 in run_rules.py):
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

from dataclasses import dataclass

import numpy as np

from wattgate.power.triage.arrays import _bounds, _ranges, true_runs
from wattgate.power.triage.levels import Edges
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

EDGE_MARGIN = 0.10  # hysteresis margin, share of the band next to the edge
OSCILLATION_SHARE = 0.15  # share of samples high and low that marks kernel bursts between gaps
NO_UTIL_IDLE_SHARE = 0.30  # without utilization: low-band power this far above idle is a wait
LIGHT_UTIL_PCT = 10.0  # below this, utilization at idle power is too light to be work (host copies, teardown)
PEER_SLACK = 3  # windows of slack around peers' waits when matching the stuck rank
CHECKPOINT_MIN_S = 10.0  # a shorter pause is a sync wait, whatever its peers do
PERIODIC_MIN = 4  # pauses in a series before it counts as periodic (3 match by chance too often)
PERIOD_TOLERANCE = 0.2  # start-to-start interval within this share of the series' median
LENGTH_RATIO = 1.5  # pauses of "similar length" are within this factor of each other
AT_CAP_SHARE = 0.9  # a window at this share of the power cap is compute whatever its utilization
PEER_POWER_TOL = 0.12  # a GPU within this share of its peers' median power (and PEER_UTIL_TOL) is with them
PEER_UTIL_TOL = 15.0


@dataclass(frozen=True)
class KnownWindows:
    """The windows with samples (or filled from a short gap), GPU-major, as the rules read them: each one's GPU,
    time, readings and band edges."""

    keys: list[tuple[str, int]]  # (host, gpu) per GPU id
    gpu: np.ndarray  # GPU id per window
    index: np.ndarray  # window index floor(time / window_s)
    power: np.ndarray  # mean power
    util: np.ndarray  # mean utilization, NaN where none was sampled
    high: np.ndarray  # share of samples >= the GPU's compute_min_w
    low: np.ndarray  # share of samples < the GPU's low_max_w
    filled: np.ndarray  # no sample: the values of the nearest window across a short gap
    edges: Edges


def raw_power_band(p: np.ndarray, e: Edges) -> np.ndarray:
    band = np.empty(len(p), np.int8)
    for sl, _, lo, hi, _ in e.spans:
        x = p[sl]
        band[sl] = x >= lo
        band[sl] += x >= hi
    return band


def power_band(p_med: np.ndarray, p: np.ndarray, gpu: np.ndarray, e: Edges) -> np.ndarray:
    """0 low, 1 mid, 2 high (rule 1): the band of the window power median, with hysteresis at both edges;
    never two bands away from the window's own power (a burst between waits stays high). `gpu`: the windows'
    GPUs, as in `e`, which gives each GPU's slice."""
    definite = np.empty(len(p_med), dtype=bool)
    clear = np.empty(len(p_med), dtype=bool)  # P past the high margin: compute, however short the burst
    for sl, idle, lo, hi, _ in e.spans:
        m_lo, m_hi = EDGE_MARGIN * (lo - idle), EDGE_MARGIN * (hi - lo)
        x = p_med[sl]
        d = x < lo - m_lo
        d |= (x >= lo + m_lo) & (x < hi - m_hi)
        d |= x >= hi + m_hi
        d[0] = True  # hysteresis never crosses GPUs
        definite[sl] = d
        np.greater_equal(p[sl], hi + m_hi, out=clear[sl])
    out = _hysteresis(raw_power_band(p_med, e), np.flatnonzero(~definite), p_med, e)
    # the median may not move a window two bands, nor lower one clearly in the compute band: no GPU draws
    # that much power without computing
    own = raw_power_band(p, e)
    clear |= np.abs(out - own) >= 2
    np.copyto(out, own, where=clear)
    return out


def _hysteresis(raw: np.ndarray, amb: np.ndarray, p_med: np.ndarray, e: Edges) -> np.ndarray:
    """The bands with hysteresis, in `raw`: a window within a margin of an edge (at `amb`, sorted; the rest
    are definite) keeps the band of the definite window before it when that band touches the edge."""
    if len(amb) == 0:
        return raw
    _, lo, hi = e.levels_at(amb)
    lower = np.where(p_med[amb] < (lo + hi) / 2, 0, 1).astype(np.int8)  # the bands touching the nearer edge
    # the definite window before each run of consecutive ambiguous ones (position 0 is always definite)
    run_start = np.ones(len(amb), dtype=bool)
    run_start[1:] = amb[1:] != amb[:-1] + 1
    before = np.maximum.accumulate(np.where(run_start, amb - 1, 0))
    settled = np.zeros(len(amb), dtype=bool)  # ambiguous windows found to take their own band
    for _ in range(64):
        last = np.maximum(before, np.maximum.accumulate(np.where(settled, amb, 0)))
        prev = raw[last]
        fits = (prev == lower) | (prev == lower + 1)
        jump = ~settled & ~fits  # arrived from a band away from this edge: it takes its raw band
        if not jump.any():
            raw[amb[~settled]] = prev[~settled]
            return raw
        # only the first such window after each definite one is certain; the ones after it carry its band
        at = np.flatnonzero(jump)
        _, first = np.unique(last[at], return_index=True)
        settled[at[first]] = True
    return raw  # not settled after that many rounds: every window keeps its raw band


# class of a window in the mid or high band by (band, busy or no utilization); the low band is classed apart
_ACTIVE_CLASS = np.array([LOW_UTIL, LOW_UTIL, DATA_STARVATION, COMMUNICATION, DATA_STARVATION, COMPUTE], np.int8)


def _classify(p, u, high, low, band, e: Edges) -> tuple[np.ndarray, np.ndarray]:
    """(class, oscillating) per window (rule 2)."""
    with np.errstate(invalid="ignore"):
        busy = u >= e.busy_util
    working = np.isnan(u)
    working |= busy
    key = band * np.int8(2)
    key += working
    cls = _ACTIVE_CLASS[key]
    at = np.flatnonzero(band == 0)
    idle_w, low_max_w, _ = e.levels_at(at)
    cls[at] = _classify_low(p[at], u[at], high[at], idle_w, low_max_w, e)
    # kernel bursts between host gaps; at busy utilization the low samples were a kernel waiting, not a gap
    osc = high >= OSCILLATION_SHARE
    osc &= low >= OSCILLATION_SHARE
    osc &= ~busy
    cls[osc] = DATA_STARVATION
    # at the power cap the GPU is working flat out whatever utilization reads (sampled kernel occupancy)
    at_cap = np.empty(len(p), dtype=bool)
    for sl, _, _, _, cap in e.spans:
        np.greater_equal(p[sl], AT_CAP_SHARE * cap, out=at_cap[sl])
    cls[at_cap] = COMPUTE
    osc &= ~at_cap
    return cls, osc


def _classify_low(p, u, high, idle_w, low_max_w, e: Edges) -> np.ndarray:
    """Class of windows in the low band."""
    with np.errstate(invalid="ignore"):
        busy, idle = u >= e.busy_util, u <= e.idle_util
        light_util = u < LIGHT_UTIL_PCT
    no_util = np.isnan(u)
    cls = np.full(len(p), LOW_UTIL, np.int8)
    cls[busy] = WAIT
    cls[idle] = IDLE
    quiet = p <= idle_w + NO_UTIL_IDLE_SHARE * (low_max_w - idle_w)
    # a little utilization at idle power with no sample in the high band is work too light to draw
    # power (host copies, teardown): compute bursts filling that share of the time would lift P above `quiet`
    cls[~busy & ~idle & light_util & quiet & (high == 0)] = IDLE
    cls[no_util] = np.where(quiet[no_util], IDLE, WAIT)
    return cls


def peer_vote(cls, p, u, index, e: Edges, gpu: np.ndarray | None = None) -> np.ndarray:
    """GPUs doing the same thing at the same time get the same class: in each window (matched by time over
    every GPU of the input), the GPUs within PEER_POWER_TOL of the peers' median power and PEER_UTIL_TOL of
    their median utilization, if at least half of them and two, take their most common class (a strict
    plurality; a tie changes nothing). A GPU that departs from its peers keeps its own class."""
    n = len(cls)
    if n == 0:
        return cls
    uu = np.where(np.isnan(u), -1.0, u) if np.isnan(u).any() else u
    lo = int(index.min())
    span = int(index.max()) - lo + 1
    if gpu is not None and span * (int(gpu.max()) + 1) <= 2 * n + (1 << 20) and not np.isnan(p).any():
        return _peer_vote_grid(cls, p, uu, index - lo, gpu, span, e)
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


def _peer_vote_grid(cls, p, uu, row, gpu, span: int, e: Edges) -> np.ndarray:
    """peer_vote for GPUs over the same hours: on a (GPU x time) grid, which holds the windows in their own
    (GPU-major) order, so a GPU seen at every time of the span needs no scatter and no gather."""
    ngpu = int(gpu.max()) + 1
    complete = len(cls) == ngpu * span  # each GPU has at most one window per time, so all of them

    def grid(x, fill):
        if complete:
            return x.reshape(ngpu, span)
        g = np.full(ngpu * span, fill, x.dtype)
        g[flat] = x
        return g.reshape(ngpu, span)

    flat = None if complete else np.multiply(gpu, span, dtype=np.int64) + row
    present = None if complete else grid(np.ones(len(cls), bool), False)
    counts = np.full(span, ngpu) if present is None else present.sum(axis=0)
    mid = np.maximum(counts - 1, 0) // 2
    grid_p, grid_u = grid(p, np.inf), grid(uu, np.inf)
    med_p, med_u = (np.take_along_axis(np.sort(x, axis=0), mid[None, :], axis=0)[0] for x in (grid_p, grid_u))
    with np.errstate(invalid="ignore"):  # inf - inf at times no GPU has a window: masked out below
        dist = np.subtract(grid_p, med_p)
        np.abs(dist, out=dist)
        tol = np.maximum(med_p, e.levels.low_max_w[:ngpu, None])  # grid row g: GPU g
        tol *= PEER_POWER_TOL
        with_peers = dist <= tol
        np.subtract(grid_u, med_u, out=dist)
        np.abs(dist, out=dist)
        with_peers &= dist <= PEER_UTIL_TOL
    if present is not None:
        with_peers &= present
    ok = (counts >= 2) & (with_peers.sum(axis=0) >= np.maximum(2, np.ceil(counts / 2)))
    with_peers &= ok
    # the strict plurality of each time's voters: most times they agree, and only the others need counting
    grid_c = grid(cls, 0)
    info = np.iinfo(cls.dtype)
    best = np.where(with_peers, grid_c, info.max).min(axis=0)
    split = np.flatnonzero(best < np.where(with_peers, grid_c, info.min).max(axis=0))
    strict = with_peers.any(axis=0)
    if len(split):
        best[split], strict[split] = _plurality(grid_c[:, split], with_peers[:, split])
    with_peers &= strict
    out = np.where(with_peers, best, grid_c).ravel()
    return out if complete else out[flat]


def _plurality(cls: np.ndarray, voter: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column: the most common class of the voters (the lowest of a tie), and whether it is strictly
    the most common."""
    top, second = np.zeros(cls.shape[1], np.int64), np.zeros(cls.shape[1], np.int64)
    best = np.zeros(cls.shape[1], cls.dtype)
    for k in np.unique(cls[voter]):  # ascending: a later class must beat the leader, not tie it
        votes = (voter & (cls == k)).sum(axis=0)
        more = votes > top
        second = np.where(more, top, np.maximum(second, votes))
        best[more] = k
        top = np.where(more, votes, top)
    return best, top > second


def _is(cls: np.ndarray, classes) -> np.ndarray:
    """cls in classes: one comparison per class (np.isin builds a lookup table on every call)."""
    out = cls == classes[0]
    for c in classes[1:]:
        out |= cls == c
    return out


def next_true_at(mask: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Position of the first True at or after each position in `at` (len(mask) if none), from the False
    positions alone (few: the labels that are not activity)."""
    out = at.copy()
    off = np.flatnonzero(~mask)
    if len(off):
        run_last = off[np.append(off[1:] != off[:-1] + 1, True)]  # the last of each run of False
        inside = ~mask[at]
        out[inside] = run_last[np.searchsorted(run_last, at[inside])] + 1
    return out


def _wait_runs(cls, index, gpu, window_s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end (exclusive) and length in seconds of every contiguous run of WAIT windows."""
    s, e = true_runs(cls == WAIT, gpu)
    return s, e, (index[e - 1] + 1 - index[s]) * window_s if len(s) else np.zeros(0)


def _resolve_waits(cls, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 4: a wait becomes communication, checkpoint or deadlock by its length and what follows."""
    out = cls.copy()
    s, e, length = _wait_runs(cls, index, gpu, window_s)
    if len(s) == 0:
        return out
    _, ge = _bounds(gpu, ngpu)
    nxt = next_true_at(_is(cls, ACTIVE), np.minimum(e, len(cls) - 1))
    resume = np.minimum(nxt, len(cls) - 1)
    resumes = (e < len(cls)) & (nxt < ge[gpu[s]])
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
    after = next_true_at(_is(smooth, ACTIVE), np.minimum(e, n - 1))
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
    qs, qe = true_runs(_is(smooth, (IDLE, LOW_UTIL)), gpu)
    before = (qs > gs[gpu[qs]]) & _is(smooth[np.maximum(qs - 1, 0)], ACTIVE + (WAIT,))
    after_ok = (qe < ge[gpu[qs]]) & _is(smooth[np.minimum(qe, n - 1)], ACTIVE + (WAIT,))
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


def _near(marked: np.ndarray, times: np.ndarray, slack: int = 0) -> np.ndarray:
    """Per time in `times`: does any of the times `marked` (windows of any GPU) lie within `slack` windows?"""
    marked = np.unique(marked)
    if len(marked) == 0:
        return np.zeros(len(times), dtype=bool)
    j = np.searchsorted(marked, times - slack)
    return (j < len(marked)) & (marked[np.minimum(j, len(marked) - 1)] <= times + slack)


def _peer_rules(cls, from_wait, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 5: the checkpoint writer and the stuck rank, from what their peers do at the same time."""
    out = cls.copy()
    if len(cls) == 0:
        return out
    ck_at = index[(cls == CHECKPOINT) & from_wait]  # peers' waits, by time
    dl_at = index[(cls == DEADLOCK) & from_wait]
    if not (len(ck_at) or len(dl_at)):
        return out
    s, e = true_runs(_is(cls, (IDLE, LOW_UTIL)), gpu)
    if len(s) == 0:
        return out
    gs, ge = _bounds(gpu, ngpu)
    active = _is(cls, ACTIVE)
    first_active = np.full(ngpu, len(cls))  # on each GPU with a quiet run
    for g in np.unique(gpu[s]):
        seen = active[gs[g] : ge[g]]
        if seen.any():
            first_active[g] = gs[g] + int(seen.argmax())
    was_active = first_active[gpu[s]] < s
    length = e - s
    # how many of each run's windows overlap peers' waits (the quiet windows alone are looked up)
    quiet_at = _ranges(s, e)
    run_end = np.cumsum(length)
    ck_c, dl_c = (np.concatenate([[0], np.cumsum(_near(m, index[quiet_at]))]) for m in (ck_at, dl_at))
    ck_overlap, dl_overlap = ck_c[run_end] - ck_c[run_end - length], dl_c[run_end] - dl_c[run_end - length]
    last = e == ge[gpu[s]]
    writer = was_active & ~last & (ck_overlap >= 0.5 * length)
    stuck = was_active & last & ((dl_overlap >= 0.5 * length) | (dl_overlap * window_s >= deadlock_after_s))
    if writer.any():
        out[_ranges(s[writer], e[writer])] = CHECKPOINT
    if stuck.any():
        pos = _ranges(s[stuck], e[stuck])
        out[pos[_near(dl_at, index[pos], PEER_SLACK)]] = DEADLOCK
    return out


def _confidence(w: KnownWindows, osc, raw, smooth, final) -> np.ndarray:
    p, u, high, low, e = w.power, w.util, w.high, w.low, w.edges
    # P's distance from the nearest band edge in units of 2.5 margins
    conf = np.empty(len(p))
    for sl, idle, lo, hi, _ in e.spans:
        m_lo, m_hi = EDGE_MARGIN * (lo - idle), EDGE_MARGIN * (hi - lo)
        to_lo, to_hi = np.abs(p[sl] - lo), np.abs(p[sl] - hi)
        to_lo /= 2.5 * m_lo
        to_hi /= 2.5 * m_hi
        np.minimum(to_lo, to_hi, out=conf[sl])
    # labels that also rest on U: U's distance from the nearest utilization threshold in 5-point units
    at = np.flatnonzero(final != COMPUTE)
    ua = u[at]
    to_u = np.minimum(np.abs(ua - e.busy_util), np.abs(ua - e.idle_util)) / 5.0
    to_u[np.isnan(ua)] = 1.0
    conf[at] = np.minimum(conf[at], to_u)
    at = np.flatnonzero(osc)  # bursts are judged by shares, not by the means
    conf[at] = np.minimum(high[at], low[at]) / 0.3
    np.minimum(conf, 0.5, out=conf, where=raw != smooth)
    np.minimum(conf, 0.5, out=conf, where=w.filled)  # no sample: the phase around a short gap
    np.clip(conf, 0.0, 1.0, out=conf)
    return conf.astype(np.float32)

"""Power triage's rule 6 (rules.py describes it): what the run recorded (heartbeats, metrics) overriding power.

Apart from rules.py because it alone reads the run's record (runinfo.py); the power-only rules never do.
"""

from __future__ import annotations

import numpy as np

from wattgate.power.triage.arrays import _bounds
from wattgate.power.triage import phases as P  # the phase codes
from wattgate.power.triage.rules import KnownWindows, _is, _near
from wattgate.run_tables import DATA_WAIT_S, RANK, STEP_TIME_S, TIME
from wattgate.power.triage.runinfo import (
    INTERVAL_END,
    INTERVAL_RANK,
    INTERVAL_START,
    RunInfo,
    _checkpoint_intervals,
    _covered_share,
    _eval_intervals,
    _done_times,
    _progress,
    map_ranks,
)

COVER_SHARE = 0.5  # share of a window inside a heartbeat interval that makes it count


def _run_info_rules(cls, conf, smooth, w: KnownWindows, info: RunInfo, window_s, deadlock_after_s):
    """Rule 6: heartbeat- and metrics-backed labels of windows `w`, in place. The run's intervals are laid over only
    the windows whose label they can change (a step over a quiet window, not over hours of compute)."""
    if len(cls) == 0:
        return
    p, u, index, gpu, keys, e = w.power, w.util, w.index, w.gpu, w.keys, w.edges
    rank_gpu = map_ranks(info, keys)
    ngpu = len(keys)
    gs, ge = _bounds(gpu, ngpu)
    below = np.empty(len(p), dtype=bool)
    for sl, _, _, hi, _ in e.spans:
        np.less(p[sl], hi, out=below[sl])
    run_gpus = np.zeros(ngpu, dtype=bool)
    run_gpus[list(set(rank_gpu.values()))] = True
    if not run_gpus.any():  # no rank maps to a GPU: run-wide facts apply to all of them
        run_gpus[:] = True
    gpu_ranks = [[] for _ in range(ngpu)]
    for r, g in rank_gpu.items():
        gpu_ranks[g].append(r)

    def share(at, starts, ends):  # share of each window at `at` inside the intervals
        i = index[at]
        return _covered_share(starts, ends, i * window_s, (i + 1) * window_s)

    # stalls: gaps between progress stamps, worked out once per time (every GPU's window then reads the same)
    stamps, run_over = _progress(info)
    stalled = np.zeros(len(cls), dtype=bool)
    during: np.ndarray | None = None  # per time: after the first stamp, before the last one's deadline
    rows: np.ndarray | None = None  # per window: its time's row in `during`
    if len(stamps):
        times, rows = _time_rows(index)
        t0, t1 = times * window_s, (times + 1) * window_s
        k = np.searchsorted(stamps, t0, side="right")  # stamps[k-1] <= window start; k == 0: before the run
        after_start = k > 0
        during = after_start & (t0 < stamps[-1] + deadlock_after_s)
        prev = stamps[np.maximum(k - 1, 0)]
        k_next = np.searchsorted(stamps, t1, side="left")
        nxt = np.where(k_next < len(stamps), stamps[np.minimum(k_next, len(stamps) - 1)], np.inf)
        gap = after_start & (t0 < run_over) & (nxt - prev >= deadlock_after_s)
        gap_closed = gap & np.isfinite(nxt)
        for g in np.flatnonzero(run_gpus & (ge > gs)):
            # the gap after the last stamp counts where the GPU's trace goes on for deadlock_after_s past it
            trails = (index[ge[g] - 1] + 1) * window_s - stamps[-1] >= deadlock_after_s
            stalled[gs[g] : ge[g]] = (gap if trails else gap_closed)[rows[gs[g] : ge[g]]]

    intervals = _checkpoint_intervals(info.events)
    ck_rank = intervals[INTERVAL_RANK].to_numpy()
    ck_start, ck_end = intervals[INTERVAL_START].to_numpy(float), intervals[INTERVAL_END].to_numpy(float)
    unplaced = ~np.isin(ck_rank, list(rank_gpu))
    in_ckpt = np.zeros(len(cls), dtype=bool)
    need = below | stalled | (cls == P.CHECKPOINT)  # where in_ckpt is read below
    for g in range(ngpu):
        mine = np.isin(ck_rank, gpu_ranks[g]) | unplaced
        if mine.any():
            at = gs[g] + np.flatnonzero(need[gs[g] : ge[g]])
            in_ckpt[at] = share(at, ck_start[mine], ck_end[mine]) >= COVER_SHARE
    stalled &= ~in_ckpt
    in_eval = _ranks_cover(_eval_intervals(info.events), rank_gpu, gpu_ranks, gs, ge, share, len(cls))
    stalled &= ~in_eval  # a pass that ended was progress, however long it took

    # power-only hang and checkpoint labels that the run's own record contradicts go back to what
    # the window showed: a wait that was no hang is a (long) sync wait, a quiet window is idle or low-util
    at = np.flatnonzero(_is(cls, (P.DEADLOCK, P.CHECKPOINT)) if len(info.events) else cls == P.DEADLOCK)
    if len(stamps) and len(at):
        assert during is not None and rows is not None  # set above whenever there are stamps
        c = cls[at]
        wrong = during[rows[at]] & run_gpus[gpu[at]] & ~stalled[at]
        wrong &= (c == P.DEADLOCK) | ~in_ckpt[at]
        at = at[wrong]
        cls[at] = np.where(smooth[at] == P.WAIT, P.COMMUNICATION, smooth[at])

    starving, stepping = _step_cover(cls, below, stalled, gs, ge, info, gpu_ranks, share)
    hit = starving & below
    cls[hit], conf[hit] = P.DATA_STARVATION, 1.0
    # the step's own work: a step that did not wait for data but left the GPU low or quiet was held
    # back by the host (launches, small kernels), not by the loader. A stall keeps the power labels
    # so the hang rules below still see an idle stuck rank.
    cls[stepping], conf[stepping] = P.COMPUTE, 1.0
    # after the run said done the GPU is being released: quiet windows are idle, not starved. A GPU is
    # done when all its ranks are; with no rank placed anywhere, when every rank is
    done = _done_times(info)
    end = np.full(ngpu, np.inf)
    for g in range(ngpu):
        owners = gpu_ranks[g] or ([] if rank_gpu else list(done))
        if owners:
            end[g] = max(done[r] for r in owners)
    at = np.flatnonzero(_is(cls, (P.DATA_STARVATION, P.LOW_UTIL)))
    _, low_max_w, _ = e.levels_at(at)
    with np.errstate(invalid="ignore"):
        quiet = (p[at] < low_max_w) & ~(u[at] >= e.busy_util)
    hit = at[quiet & (index[at] * window_s + COVER_SHARE * window_s >= end[gpu[at]])]
    cls[hit], conf[hit] = P.IDLE, 1.0
    hit = in_ckpt & below
    cls[hit], conf[hit] = P.CHECKPOINT, 1.0
    # a validation pass is forward passes: compute, never data starvation, a checkpoint or a hang
    cls[in_eval], conf[in_eval] = P.COMPUTE, 1.0
    at = np.flatnonzero(stalled & below)
    if len(at):
        with np.errstate(invalid="ignore"):
            waiting = u[at] >= e.busy_util
        stuck = _is(cls[at], (P.IDLE, P.LOW_UTIL, P.DATA_STARVATION)) & ~waiting & _near(index[at[waiting]], index[at])
        hit = at[waiting | stuck]
        cls[hit], conf[hit] = P.DEADLOCK, 1.0


def _ranks_cover(intervals, rank_gpu, gpu_ranks, gs, ge, share, n) -> np.ndarray:
    """Per window: inside (>= COVER_SHARE) one of its GPU's ranks' intervals (a rank on no GPU: every GPU's)."""
    out = np.zeros(n, dtype=bool)
    if not len(intervals):
        return out
    rank, start, end = (intervals[c].to_numpy() for c in (INTERVAL_RANK, INTERVAL_START, INTERVAL_END))
    unplaced = ~np.isin(rank, list(rank_gpu))
    for g, ranks in enumerate(gpu_ranks):
        mine = np.isin(rank, ranks) | unplaced
        if mine.any() and ge[g] > gs[g]:
            at = np.arange(gs[g], ge[g])
            out[at] = share(at, start[mine].astype(float), end[mine].astype(float)) >= COVER_SHARE
    return out


def _step_cover(cls, below, stalled, gs, ge, info: RunInfo, gpu_ranks, share) -> tuple[np.ndarray, np.ndarray]:
    """Per window, from the metrics: (starving, stepping). Starving: >= COVER_SHARE inside a step's data wait,
    or inside a step that waited for data for most of its time; stepping: >= COVER_SHARE inside the other
    steps, not starving, not stalled and labelled data starvation, low-util or idle (what the step rule
    relabels). Starving is worked out only where P is below the compute band or the window could be stepping:
    nowhere else is it read."""
    starving = np.zeros(len(cls), dtype=bool)
    stepping = np.zeros(len(cls), dtype=bool)
    if not info.has_metrics:
        return starving, stepping
    metrics = info.metrics
    assert metrics is not None  # has_metrics
    m_rank = metrics[RANK].to_numpy()
    m_time, m_step, m_wait = (metrics[c].to_numpy(float) for c in (TIME, STEP_TIME_S, DATA_WAIT_S))
    candidate = ~stalled & _is(cls, (P.DATA_STARVATION, P.LOW_UTIL, P.IDLE))
    need = below | candidate
    for g, ranks in enumerate(gpu_ranks):
        if not ranks:
            continue
        mine = np.flatnonzero(_is(m_rank, ranks))  # positions: each column is then gathered at a few rows
        step_s, wait_s = m_step[mine], m_wait[mine]
        begin = m_time[mine] - step_s
        # a data wait, or all of a step that waited for data most of its time
        starved = wait_s >= COVER_SHARE * step_s
        at = gs[g] + np.flatnonzero(need[gs[g] : ge[g]])
        starving[at] = (
            share(
                at,
                np.concatenate([begin, begin[starved]]),
                np.concatenate([begin + wait_s, begin[starved] + step_s[starved]]),
            )
            >= COVER_SHARE
        )
        fed = ~starved
        at = gs[g] + np.flatnonzero(candidate[gs[g] : ge[g]] & ~starving[gs[g] : ge[g]])
        stepping[at] = share(at, begin[fed], begin[fed] + step_s[fed]) >= COVER_SHARE
    return starving, stepping


def _time_rows(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct window times (every time of the span, when that is not much more) and each window's
    row among them."""
    lo, hi = int(index.min()), int(index.max())
    if hi - lo + 1 <= 2 * len(index) + (1 << 20):
        return np.arange(lo, hi + 1), index - lo
    return np.unique(index, return_inverse=True)

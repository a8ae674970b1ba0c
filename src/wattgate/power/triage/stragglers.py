"""Stragglers from power alone: the GPU its peers wait for, why it is slow, and what the waiting cost.

In a synchronous data-parallel step every rank waits for the slowest one. The ranks that are done drop to
the wait level (a kernel spinning in the collective, or the host blocked) while the straggler still works,
so in that window the straggler stays busy and its peers do not. Per GPU and window, `busy` is the share of
its samples at or above its own low-band top (levels.py: low_max_w): working, not waiting. A gradient
reduce that every GPU runs together keeps them all busy (the communication band), so a balanced run shows
no such windows.

Per group of GPUs (the job: every GPU in the traces; and each host of a multi-host job, whose clocks need
not agree with the other hosts' to the window):
- a **wait window** is one in which at least one GPU was busy for MARGIN of the window and at least half of
  the others were busy MARGIN less than it: most of the group waited while some of it worked;
- its **last** GPU is the busiest one when every other GPU of the group was busy at least MARGIN less
  (a unique last; two equally slow GPUs share no window);
- a GPU's **lag share** is the share of the group's wait windows whose last GPU it was;
- the **waiting** it caused is, over the windows it was last in, every other GPU's busy share below its own
  times the window (GPU-seconds), and that times each peer's wait power (its learned wait level, else the
  middle of its low band) for the energy.
Only the group's members count (GPUs busy in at least MEMBER_SHARE as many windows as its busiest member:
an idle GPU beside a job is no peer), and only inside the group's training span (the first to the last
window in which at least half of its members were busy: the export rank 0 does alone after the others
left is not a step).

A GPU is a **straggler** when its lag share is above the configured share (`telemetry.straggler_share`), it
was last in at least MIN_LAG_WINDOWS windows and in at least DOMINANCE times as many as the median of the
others (a balanced pair of GPUs each last in half of the windows by chance is not a straggler).

Its **cause**, over the windows it was last in, against its peers in the same windows (causes.py):
`thermal`, `power_cap` or `hw_slowdown` when its clocks-event reasons say so (that group's bits in at least
half of its windows and REASON_EXCESS more often than its peers), else from its readings: an SM clock
CLOCK_DEFICIT below its peers' with a temperature HOT_C above theirs (thermal); its power at its own,
lower power limit (power_cap); a clock at most HW_CLOCK of its peers' (hw_slowdown); then `data` when its
rank waited for data (metrics.parquet's data_wait_s) DATA_EXCESS longer than the other ranks in those steps;
then `rank0_work` when it is rank 0's GPU (from the heartbeats, or GPU 0 of a one-host job without them);
else `unknown`, with the clock deficit named when there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Literal, cast

import numpy as np

from wattgate.power.triage.arrays import _bounds
from wattgate.power.triage.causes import GROUPS
from wattgate.records.triage import Cause, Lag, Lagging, LagSettings, Straggler, Timeline
from wattgate.run_tables import DATA_WAIT_S, RANK, STEP_TIME_S, TIME

if TYPE_CHECKING:
    from wattgate.power.triage.runinfo import RunInfo
    from wattgate.power.triage.windows import _Windows

MARGIN = 0.15  # of a window: 1.5 samples at 10 Hz, so a sampler's jitter at a step's edge is no lag
MIN_LAG_WINDOWS = 3
DOMINANCE = 3.0
MEMBER_SHARE = 0.1
BUSY = 0.5  # a GPU busy for this share of a window is working in it (the training span, membership)
TIMELINE_BINS = 400
REASON_SHARE, REASON_EXCESS = 0.5, 0.3
CLOCK_DEFICIT = 0.03  # its SM clock this share below its peers': the GPU itself is slowed
HW_CLOCK = 0.6  # HW slowdown cuts the clocks by a factor of 2 or more
HOT_C = 10.0
AT_CAP = 0.95  # of its power limit
LOWER_CAP = 0.95  # its limit this share of its peers' median or less
DATA_EXCESS_S, DATA_EXCESS_SHARE = 0.05, 0.05  # s, and share of the median step time
BLOCK_CELLS = 1 << 22  # GPUs x windows reduced at once: bounds the temporaries of a big job's day
CAUSE_WORDS = {
    "thermal": "SW/HW thermal slowdown (0x20/0x40)",
    "power_cap": "SW power cap (0x4)",
    "hw_slowdown": "HW slowdown / HW power brake (0x8/0x80)",
}


@dataclass
class _Scope:
    """One group's lag: its wait windows and, per window it was last in, the last GPU and what it cost."""

    name: Literal["job", "host"]
    members: np.ndarray  # GPU ids
    wait_windows: int = 0
    wait_cols: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_cols: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_gpu: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per last window
    wait_j: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def counts(self, ngpu: int) -> np.ndarray:
        return np.bincount(self.last_gpu, minlength=ngpu)


def no_lag(share: float) -> Lag:
    """triage.json's "lag" where nothing was compared (fewer than two GPUs, no GPU telemetry)."""
    settings = LagSettings(share=share, margin=MARGIN, min_windows=MIN_LAG_WINDOWS, dominance=DOMINANCE)
    return Lag(settings=settings, wait_windows=0, wait_gpu_hours=0.0, wait_kwh=0.0, timeline=None)


def find_stragglers(
    win: _Windows, window_s: float, share: float, run_info: RunInfo | None = None, rank_of: dict[int, int] | None = None
) -> Lagging:
    """triage.json's "stragglers" and "lag" (totals, settings and the per-GPU lag timeline) from the windows
    (windows._Windows). `rank_of`: GPU id -> rank (from the heartbeats), if known."""
    keys = win.keys
    ngpu = len(keys)
    if ngpu < 2 or not (win.n > 0).any():
        return Lagging(stragglers=(), lag=no_lag(share))
    starts, ends = _bounds(win.gpu_id, ngpu)
    first = win.index[np.minimum(starts, len(win.index) - 1)]
    has = ends > starts
    imin, imax = int(first[has].min()), int((first + (ends - starts) - 1)[has].max())
    span = imax - imin + 1
    # GPU-major windows: each GPU's span is one slice, copied into its row (unknown and filled: NaN)
    matrix = np.full((ngpu, span), np.nan, np.float32)
    for g in np.flatnonzero(has):
        a, b = starts[g], ends[g]
        row = matrix[g, first[g] - imin : first[g] - imin + (b - a)]
        np.subtract(1.0, win.low[a:b], out=row, casting="same_kind")
        row[(win.n[a:b] == 0) | win.filled[a:b]] = np.nan
    lv = win.levels
    wait_w = np.where(np.isfinite(lv.wait_w), lv.wait_w, lv.idle_w + 0.5 * (lv.low_max_w - lv.idle_w))

    hosts = sorted({h for h, _ in keys})
    scopes = [_scope("job", np.arange(ngpu), matrix, window_s, wait_w)]
    if len(hosts) > 1:
        for h in hosts:
            rows = np.array([i for i, (hh, _) in enumerate(keys) if hh == h])
            if len(rows) >= 2:
                scopes.append(_scope("host", rows, matrix, window_s, wait_w))

    found: dict[int, tuple[_Scope, float]] = {}
    for sc in scopes:
        counts = sc.counts(ngpu)
        if sc.wait_windows == 0:
            continue
        for g in sc.members:
            others = np.delete(counts[sc.members], np.flatnonzero(sc.members == g))
            lag = counts[g] / sc.wait_windows
            typical = float(np.median(others)) if len(others) else 0.0
            if lag > share and counts[g] >= MIN_LAG_WINDOWS and counts[g] >= DOMINANCE * typical:
                found.setdefault(int(g), (sc, lag))  # the job's own scope first, else its host's
    ctx = _Context(win, matrix, imin, first, starts, window_s, run_info, rank_of or {}, keys)
    entries = tuple(ctx.entry(g, sc) for g, (sc, _) in sorted(found.items(), key=lambda x: keys[x[0]]))
    job = scopes[0]
    lag = Lag(
        settings=no_lag(share).settings,
        wait_windows=job.wait_windows,
        wait_gpu_hours=round(sum(e.wait_gpu_hours for e in entries), 6),
        wait_kwh=round(sum(e.wait_kwh for e in entries), 6),
        timeline=_timeline(job, keys, imin, span, window_s),
    )
    return Lagging(stragglers=entries, lag=lag)


def _scope(
    name: Literal["job", "host"], rows: np.ndarray, matrix: np.ndarray, window_s: float, wait_w: np.ndarray
) -> _Scope:
    """The group's wait windows and last GPUs over the whole span, a block of windows at a time."""
    sub = matrix[rows]
    working = (sub >= BUSY).sum(axis=1)
    members = rows[working >= MEMBER_SHARE * max(int(working.max()), 1)]
    sc = _Scope(name, members)
    if len(members) < 2:
        return sc
    sub = matrix[members]
    m, span = sub.shape
    working = (sub >= BUSY).sum(axis=0)
    used = np.flatnonzero((working * 2 >= (~np.isnan(sub)).sum(axis=0)) & (working > 0))
    if not len(used):
        return sc
    lo, hi = int(used[0]), int(used[-1]) + 1
    power = wait_w[members].astype(np.float64)[:, None]
    # per block: its wait windows; and of its windows with one GPU last, those windows, that GPU, and the seconds
    # and joules its peers spent waiting for it
    waits, last_cols, last_gpu, wait_s, wait_j = [], [], [], [], []
    block = max(1, BLOCK_CELLS // m)
    for a in range(lo, hi, block):
        b = min(hi, a + block)
        x = sub[:, a:b]
        valid = ~np.isnan(x)
        cnt = valid.sum(axis=0)
        filled = np.where(valid, x, -1.0)
        top = filled.argmax(axis=0)
        cols = np.arange(b - a)
        b1 = filled[top, cols]
        filled[top, cols] = -1.0
        b2 = filled.max(axis=0)
        with np.errstate(invalid="ignore"):
            below = (valid & (x <= b1 - MARGIN)).sum(axis=0)
        wait = (cnt >= 2) & (b1 >= MARGIN) & (2 * below >= cnt - 1) & (below >= 1)
        last = wait & (b2 <= b1 - MARGIN)
        waits.append(np.flatnonzero(wait) + a)
        at = np.flatnonzero(last)
        if len(at):
            gap = np.clip(np.where(valid[:, at], b1[at] - x[:, at], 0.0), 0.0, None)
            last_cols.append(at + a)
            last_gpu.append(members[top[at]])
            wait_s.append(gap.sum(axis=0) * window_s)
            wait_j.append((gap * power).sum(axis=0) * window_s)
    sc.wait_cols = np.concatenate(waits) if waits else np.zeros(0, np.int64)
    sc.wait_windows = len(sc.wait_cols)
    if last_cols:
        sc.last_cols = np.concatenate(last_cols)
        sc.last_gpu = np.concatenate(last_gpu)
        sc.wait_s = np.concatenate(wait_s)
        sc.wait_j = np.concatenate(wait_j)
    return sc


def _timeline(job: _Scope, keys, imin: int, span: int, window_s: float) -> Timeline | None:
    """Per time bin: the job's wait windows, and per GPU last in any, the windows it was last in."""
    if job.wait_windows == 0:
        return None
    bins = min(TIMELINE_BINS, span)
    per = span / bins

    def binned(cols):
        return np.bincount(np.minimum((cols / per).astype(np.int64), bins - 1), minlength=bins)

    last = {}
    for g in np.unique(job.last_gpu):
        last[f"{keys[g][0]}:{keys[g][1]}"] = binned(job.last_cols[job.last_gpu == g]).tolist()
    return Timeline(
        start=round(imin * window_s, 3),
        bin_s=round(per * window_s, 6),
        bins=bins,
        wait_windows=tuple(binned(job.wait_cols).tolist()),
        last={k: tuple(v) for k, v in last.items()},
    )


@dataclass
class _Context:
    win: _Windows
    matrix: np.ndarray
    imin: int
    first: np.ndarray  # per GPU: its first window index
    starts: np.ndarray  # per GPU: its first position in the window arrays
    window_s: float
    run_info: RunInfo | None
    rank_of: dict[int, int]
    keys: list[tuple[str, int]]

    def positions(self, g: int, cols: np.ndarray) -> np.ndarray:
        return self.starts[g] + (self.imin + cols - self.first[g])

    def entry(self, g: int, sc: _Scope) -> Straggler:
        mine = sc.last_gpu == g
        cols = sc.last_cols[mine]
        peers = sc.members[sc.members != g]
        host, gpu = self.keys[g]
        lag = float(mine.sum()) / sc.wait_windows
        cause, why = self.cause(g, cols, peers)
        t0, t1 = (self.imin + cols.min()) * self.window_s, (self.imin + cols.max() + 1) * self.window_s
        where = f"the job's {len(sc.members)} GPUs" if sc.name == "job" else f"the {len(sc.members)} GPUs of {host}"
        seconds = float(mine.sum()) * self.window_s
        evidence = (
            f"last in {100 * lag:.0f}% of the {sc.wait_windows} windows in which {where} waited for one of them "
            f"({seconds:.0f} s of waiting in all, spread over the {t1 - t0:.0f} s from {_hm(t0)} to {_hm(t1)} UTC); "
            f"{why}"
        )
        return Straggler(
            host=host,
            gpu=gpu,
            rank=self.rank_of.get(g),
            lag_share=round(lag, 4),
            lag_windows=int(mine.sum()),
            wait_windows=sc.wait_windows,
            scope=sc.name,
            wait_gpu_hours=round(float(sc.wait_s[mine].sum()) / 3600.0, 6),
            wait_kwh=round(float(sc.wait_j[mine].sum()) / 3.6e6, 6),
            cause=cause,
            evidence=evidence,
            first=round(t0, 3),
            last=round(t1, 3),
            source="power",
        )

    def cause(self, g: int, cols: np.ndarray, peers: np.ndarray) -> tuple[Cause, str]:
        """(cause, its evidence) of GPU g over the windows `cols` it was last in."""
        win = self.win
        pos_g = self.positions(g, cols)
        peer_pos = []
        for p in peers:
            ok = ~np.isnan(self.matrix[p, cols])
            peer_pos.append(self.positions(p, cols[ok]))
        pos_p = np.concatenate(peer_pos) if peer_pos else np.zeros(0, np.int64)
        figs = win.causes(np.concatenate([pos_g, pos_p]))
        n = len(pos_g)
        mine_r, theirs_r = figs.reasons[:n].sum(axis=0), figs.reasons[n:].sum(axis=0)
        clock_g, clock_p = _mean(figs.clock[:n]), _mean(figs.clock[n:])
        temp_g, temp_p = _mean(figs.temp[:n]), _mean(figs.temp[n:])
        lv = win.levels
        power_g = self.working_power(g, cols)
        cap_g, cap_p = float(lv.cap_w[g]), float(np.median(lv.cap_w[peers])) if len(peers) else math.nan
        clock_text = ""
        if math.isfinite(clock_g) and math.isfinite(clock_p) and clock_p > 0:
            clock_text = (
                f"SM clock {clock_g:.0f} MHz, {100 * (1 - clock_g / clock_p):.0f}% below its peers' {clock_p:.0f} MHz"
            )
            if clock_g >= clock_p * (1 - CLOCK_DEFICIT):
                clock_text = f"SM clock {clock_g:.0f} MHz, as its peers' {clock_p:.0f} MHz"
        # 1. the reasons the driver gave
        if mine_r[0] > 0:
            share_g = mine_r[1:] / mine_r[0]
            share_p = theirs_r[1:] / theirs_r[0] if theirs_r[0] > 0 else np.zeros(len(GROUPS))
            excess = share_g - share_p
            best = int(np.argmax(np.where(share_g >= REASON_SHARE, excess, -1.0)))
            if share_g[best] >= REASON_SHARE and excess[best] >= REASON_EXCESS:
                group = GROUPS[best]
                why = (
                    f"clocks-event reasons: {CAUSE_WORDS[group]} in {100 * share_g[best]:.0f}% of its samples in those "
                    f"windows, its peers {100 * share_p[best]:.0f}%" + (f"; {clock_text}" if clock_text else "")
                )
                return cast("Cause", group), why  # GROUPS: the names of trace.REASON_CAUSES, causes all
        slowed = math.isfinite(clock_g) and math.isfinite(clock_p) and clock_g < clock_p * (1 - CLOCK_DEFICIT)
        # 2. its readings, without reasons (or reasons that name nothing apart from its peers)
        hot = math.isfinite(temp_g) and math.isfinite(temp_p) and temp_g >= temp_p + HOT_C
        if slowed and hot:
            return "thermal", f"{clock_text}, at {temp_g:.0f} C against its peers' {temp_p:.0f} C (no reason recorded)"
        if math.isfinite(power_g) and power_g >= AT_CAP * cap_g and cap_g <= LOWER_CAP * cap_p:
            extra = f"; {clock_text}" if clock_text else ""
            return "power_cap", (
                f"working at {power_g:.0f} W, at its {cap_g:.0f} W power limit, below its peers' {cap_p:.0f} W "
                f"(no reason recorded){extra}"
            )
        if slowed and clock_g <= HW_CLOCK * clock_p:
            return "hw_slowdown", f"{clock_text}: clocks cut by half or more, as HW slowdown does (no reason recorded)"
        # 3. its rank's own data wait
        data = self.data_wait(g, cols)
        if data is not None:
            return "data", data
        # 4. rank 0's own work
        rank = self.rank_of.get(g)
        util_p, power_p = _median(win.util[pos_p]), _median(win.power[pos_p])
        peers_text = f"its peers sat at {power_p:.0f} W and {util_p:.0f}% utilization (medians)"
        power_lag = _mean(win.power[pos_g])
        if rank == 0 or (not self.rank_of and len({h for h, _ in self.keys}) == 1 and self.keys[g][1] == 0):
            how = "rank 0's GPU (heartbeats)" if rank == 0 else "GPU 0 of a one-host job, where rank 0 runs by default"
            state = "idle, not spinning in a collective" if util_p <= 10 else "waiting in a collective"
            hw = f"; {clock_text}" if clock_text else ""
            return "rank0_work", (
                f"{how} worked alone at {power_lag:.0f} W while {peers_text}, {state}: work only rank 0 does "
                f"(logging, evaluation, a save){hw}"
            )
        if slowed:
            return "unknown", f"{clock_text}: the GPU itself runs slower, and nothing recorded says why"
        return (
            "unknown",
            f"while it lagged {peers_text}; {clock_text or 'no clock readings'}; no reason, data wait or rank-0 role "
            "found",
        )

    def working_power(self, g: int, cols: np.ndarray) -> float:
        """g's power while it works, over the stretch it lagged in: the mean of its windows there spent wholly
        in the compute band (a lag window also holds part of the step's reduce), else of its lag windows."""
        win = self.win
        pos = self.positions(g, np.arange(cols.min(), cols.max() + 1))
        pos = pos[(pos >= self.starts[g]) & (pos < len(win.n))]
        pos = pos[win.gpu_id[pos] == g]
        with np.errstate(invalid="ignore"):
            whole = pos[(win.n[pos] > 0) & (win.high[pos] >= 0.95)]
        return _mean(win.power[whole]) if len(whole) else _mean(win.power[self.positions(g, cols)])

    def data_wait(self, g: int, cols: np.ndarray) -> str | None:
        """The data-wait evidence when g's rank waited for data longer than the other ranks in the steps that
        ended in the windows it was last in; None otherwise (or without metrics)."""
        info, rank = self.run_info, self.rank_of.get(g)
        m = getattr(info, "metrics", None)
        if rank is None or m is None or not len(m) or DATA_WAIT_S not in m:
            return None
        window = np.floor(m[TIME].to_numpy(float) / self.window_s).astype(np.int64) - self.imin
        inside = np.isin(window, cols)
        if not inside.any():
            return None
        rows = m[inside]
        mine = rows[RANK].to_numpy() == rank
        if not mine.any() or mine.all():
            return None
        wait = rows[DATA_WAIT_S].to_numpy(float)
        w_me, w_others = float(np.nanmean(wait[mine])), float(np.nanmean(wait[~mine]))
        step = float(np.nanmedian(rows[STEP_TIME_S].to_numpy(float))) if STEP_TIME_S in rows else 0.0
        if not w_me - w_others >= max(DATA_EXCESS_S, DATA_EXCESS_SHARE * (step if math.isfinite(step) else 0.0)):
            return None
        return (
            f"metrics: rank {rank} waited {w_me:.2f} s per step for data in the {int(mine.sum())} steps that ended "
            f"in those windows, the other ranks {w_others:.2f} s"
        )


def _mean(x: np.ndarray) -> float:
    x = np.asarray(x, np.float64)
    ok = np.isfinite(x)
    return float(x[ok].mean()) if ok.any() else math.nan


def _median(x: np.ndarray) -> float:
    x = np.asarray(x, np.float64)
    ok = np.isfinite(x)
    return float(np.median(x[ok])) if ok.any() else math.nan


def _hm(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"{t:.0f}"

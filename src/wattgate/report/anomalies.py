"""Anomalies of a run: hangs, data starvation and straggler ranks, each with its time span.

Evidence of one event from different sources (deadlock windows on several
GPUs and the watcher's verdict; starved windows and starved steps) is merged
into one episode when the time spans touch, so a table row is one event.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from wattgate.records.summary import Anomaly, StragglerEntry
from wattgate.records.watcher import WatcherRecord
from wattgate.power.triage.arrays import reduce_into
from wattgate.report.phases import PhaseWindows, runs
from wattgate.run_tables import DATA_WAIT_S, RANK, STEP, STEP_TIME_S, TIME

STARVATION_MIN_S = 5.0  # a run of data_starvation windows shorter than this is a hiccup
STARVED_STEP_SHARE = 0.2  # a step that waited this share of its time for data is starved
STRAGGLER_RATIO = 1.10  # a rank this much slower (median compute time) than the median rank
HANG_VERDICTS = ("deadlock", "stuck_ranks")
QUIET_VERDICTS = (None, "running", "healthy", "stopped")  # stopped: a graceful stop, resumed by the next job
# the facts an episode carries (Episode.facts: fact -> a count, summed when episodes merge, or a text)
DEADLOCK_GPU_S, STARVED_GPU_S = "deadlock GPU-seconds", "starved GPU-seconds"
STARVED_STEPS, DATA_WAIT_S_FACT = "starved steps", "data wait s"
WATCHER_FACT, STRAGGLER_FACT, RATIO_FACT = "watcher", "straggler", "ratio"


@dataclass
class Episode:
    kind: str
    start: float
    end: float
    gpus: set = field(default_factory=set)
    ranks: set = field(default_factory=set)
    facts: dict = field(default_factory=dict)  # evidence name -> count or text

    def absorb(self, other: Episode) -> None:
        self.start, self.end = min(self.start, other.start), max(self.end, other.end)
        self.gpus |= other.gpus
        self.ranks |= other.ranks
        for k, v in other.facts.items():
            self.facts[k] = self.facts[k] + v if isinstance(v, (int, float)) and k in self.facts else v


def merge(episodes: list[Episode], gap_s: float) -> list[Episode]:
    """Episodes whose spans overlap or lie within gap_s of each other become one."""
    out: list[Episode] = []
    for e in sorted(episodes, key=lambda e: (e.start, e.end)):
        if out and e.start <= out[-1].end + gap_s:
            out[-1].absorb(e)
        else:
            out.append(Episode(e.kind, e.start, e.end, set(e.gpus), set(e.ranks), dict(e.facts)))
    return out


def _window_episodes(w: PhaseWindows, phase: str, kind: str, fact: str, min_s: float, gap_s: float) -> list[Episode]:
    gid, start, end = runs(w, phase, gap_s)
    keep = (end - start) >= min_s
    labels = [f"{h}:{g}" for h, g in w.keys]
    return [
        Episode(kind, float(s), float(e), {labels[g]}, set(), {fact: float(e - s)})
        for g, s, e in zip(gid[keep], start[keep], end[keep])
    ]


def watcher_episode(watcher: WatcherRecord | None) -> Episode | None:
    """The watcher's verdict as an episode: from when progress stopped to when it acted."""
    if watcher is None or watcher.verdict in QUIET_VERDICTS:
        return None
    verdict = watcher.verdict
    end = watcher.detected_at or watcher.ended
    if end is None:
        return None
    start = float(end) - float(watcher.stalled_for_s or 0.0)
    ranks = set(watcher.stuck_ranks or watcher.behind or ())
    kind = "hang" if verdict in HANG_VERDICTS else verdict
    return Episode(kind, start, float(end), set(), set(ranks), {WATCHER_FACT: watcher.reason or verdict})


def hangs(w: PhaseWindows, watcher: WatcherRecord | None, window_s: float) -> list[Episode]:
    found = _window_episodes(w, "deadlock", "hang", DEADLOCK_GPU_S, 0.0, 2 * window_s)
    verdict = watcher_episode(watcher)
    if verdict is not None and verdict.kind == "hang":
        found.append(verdict)
    merged = merge(found, 2 * window_s)
    if verdict is not None and verdict.kind != "hang":
        merged.append(verdict)
    return merged


def group_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row the index of its value among the sorted distinct values (-1 for NaN), and those values: the
    groups of pandas' groupby(sort=True), without its machinery (a few times the arithmetic, and lazy
    imports on first use). Integers in a range not much wider than the rows go through a lookup table."""
    values = np.asarray(values)
    if values.dtype.kind in "iu" and len(values):
        lo, hi = int(values.min()), int(values.max())
        if hi - lo <= 4 * len(values) + 1024 and hi <= np.iinfo(np.int64).max:
            codes = np.subtract(values, lo, dtype=np.int64)
            present = np.bincount(codes, minlength=hi - lo + 1) > 0
            np.take(np.cumsum(present) - 1, codes, out=codes, mode="clip")  # in place: one array of the rows
            return codes, (np.flatnonzero(present) + lo).astype(values.dtype)
    valid = _notna(values)
    uniques, inverse = np.unique(values[valid], return_inverse=True)
    codes = np.full(len(values), -1, np.int64)
    codes[valid] = inverse.reshape(-1)
    return codes, uniques


def _notna(values: np.ndarray) -> np.ndarray:
    """Not NaN per row (a numeric column from Parquet: integers never are)."""
    return ~np.isnan(values) if values.dtype.kind == "f" else np.ones(len(values), bool)


def starved_steps(metrics: pd.DataFrame | None) -> list[Episode]:
    """Per rank, runs of consecutive steps that waited >= STARVED_STEP_SHARE of their time for data."""
    if metrics is None or not {STEP_TIME_S, DATA_WAIT_S} <= set(metrics.columns) or metrics.empty:
        return []
    rank, step, time_, step_s, wait = (metrics[c].to_numpy() for c in (RANK, STEP, TIME, STEP_TIME_S, DATA_WAIT_S))
    complete = _notna(rank) & _notna(step) & _notna(time_) & _notna(step_s) & _notna(wait)
    rows = np.flatnonzero(complete & (step_s > 0) & (wait >= STARVED_STEP_SHARE * step_s))
    if not len(rows):
        return []
    rows = rows[np.lexsort((step[rows], rank[rows]))]  # stable: rows of one (rank, step) keep their order
    rank, step = rank[rows], step[rows]
    new = np.ones(len(rows), bool)
    new[1:] = (rank[1:] != rank[:-1]) | (step[1:] != step[:-1] + 1)
    run = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    end = time_[rows].astype(float)
    begin = end - step_s[rows].astype(float)
    runs = len(first)
    lo, hi = np.full(runs, np.inf), np.full(runs, -np.inf)
    reduce_into(np.minimum, lo, run, begin)  # runs are numbered in row order
    reduce_into(np.maximum, hi, run, end)
    waited = np.bincount(run, weights=wait[rows].astype(float), minlength=runs)
    steps = np.bincount(run, minlength=runs)
    return [
        Episode(
            "starvation",
            float(lo[k]),
            float(hi[k]),
            set(),
            {int(rank[first[k]])},
            {STARVED_STEPS: int(steps[k]), DATA_WAIT_S_FACT: float(waited[k])},
        )
        for k in range(runs)
    ]


def starvation(w: PhaseWindows, metrics: pd.DataFrame | None, window_s: float) -> list[Episode]:
    found = _window_episodes(w, "data_starvation", "starvation", STARVED_GPU_S, STARVATION_MIN_S, 2 * window_s)
    steps = starved_steps(metrics)
    gap = 2 * window_s
    if metrics is not None and STEP_TIME_S in metrics.columns and len(metrics):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # no finite step time: NaN, as pandas gives
            typical = float(np.nanmedian(metrics[STEP_TIME_S].to_numpy(float)))
        gap = max(gap, 2 * typical)  # neighbouring starved steps: one episode
    return merge(found + steps, gap)


def stragglers(metrics: pd.DataFrame | None, rank_gpu: dict[int, str]) -> list[Episode]:
    """Ranks whose median step time less data wait is >= STRAGGLER_RATIO x the median over ranks."""
    if metrics is None or not {STEP_TIME_S, DATA_WAIT_S} <= set(metrics.columns) or metrics.empty:
        return []
    group, ranks = group_codes(metrics[RANK].to_numpy())
    if len(ranks) < 2:
        return []
    time_, step_s = metrics[TIME].to_numpy(float), metrics[STEP_TIME_S].to_numpy(float)
    compute = step_s - metrics[DATA_WAIT_S].to_numpy(float)
    if len(group) > 1 and not (group[1:] >= group[:-1]).all():  # train writes a step's ranks together
        # as int16 (ranks < 2^15) numpy's stable sort is a radix sort: a tenth of a merge sort's time
        compute = compute[np.argsort(group.astype(np.int16) if len(ranks) < 1 << 15 else group, kind="stable")]
    bounds = np.cumsum(np.bincount(group + 1, minlength=len(ranks) + 1))  # rank k: bounds[k]:bounds[k + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank without a finite value: NaN, as pandas gives
        # overwrite_input: compute is this function's own, and partitioning it in place saves a copy
        median = np.array([np.nanmedian(compute[a:b], overwrite_input=True) for a, b in zip(bounds, bounds[1:])])
        typical = float(np.nanmedian(median))
    if not typical > 0:
        return []
    ranked = group >= 0  # rows of a NaN rank are in no rank's span
    if ranked.all():
        ranked = slice(None)
    begin, end = np.full(len(ranks), np.nan), np.full(len(ranks), np.nan)
    np.fmin.at(begin, group[ranked], (time_ - step_s)[ranked])
    np.fmax.at(end, group[ranked], time_[ranked])
    out = []
    for k in np.flatnonzero(median >= STRAGGLER_RATIO * typical):
        rank = ranks[k]
        text = (
            f"rank {rank}: median step time less data wait {median[k]:.4g} s = "
            f"{median[k] / typical:.2f}x the median over {len(ranks)} ranks ({typical:.4g} s)"
        )
        gpus = {rank_gpu[int(rank)]} if int(rank) in rank_gpu else set()
        out.append(
            Episode(
                "straggler",
                float(begin[k]),
                float(end[k]),
                gpus,
                {int(rank)},
                {STRAGGLER_FACT: text, RATIO_FACT: round(float(median[k] / typical), 4)},
            )
        )
    return out


def waited_for(entries: list[StragglerEntry]) -> list[Episode]:
    """The stragglers triage (or the watcher) named, each an episode from the first to the last window the others
    waited for it."""
    out = []
    for e in entries:
        if e.first is None or e.last is None:
            continue
        gpus = {f"{e.host}:{e.gpu}"} if e.gpu is not None else set()
        ranks = {e.rank} if e.rank is not None else set()
        text = f"waited for ({e.cause}, lag share {100 * (e.lag_share or 0):.0f}%): {e.evidence}"
        out.append(Episode("straggler", float(e.first), float(e.last), gpus, ranks, {STRAGGLER_FACT: text}))
    return out


# each fact an episode can carry, and its line of evidence, in the order the table gives them
EVIDENCE = (
    (
        DEADLOCK_GPU_S,
        lambda e, f: (
            f"power triage: low-power wait without progress on {len(e.gpus)} GPU(s) ({f[DEADLOCK_GPU_S]:.0f} GPU-s)"
        ),
    ),
    (
        STARVED_GPU_S,
        lambda e, f: f"power triage: data_starvation on {len(e.gpus)} GPU(s) ({f[STARVED_GPU_S]:.0f} GPU-s)",
    ),
    (
        STARVED_STEPS,
        lambda e, f: (
            f"metrics: {f[STARVED_STEPS]} step(s) on {len(e.ranks)} rank(s) waited >= "
            f"{100 * STARVED_STEP_SHARE:.0f}% of the step for data ({f[DATA_WAIT_S_FACT]:.1f} s of waiting)"
        ),
    ),
    (WATCHER_FACT, lambda e, f: f"watcher: {f[WATCHER_FACT]}"),
    (STRAGGLER_FACT, lambda e, f: f[STRAGGLER_FACT]),
)


def describe(e: Episode) -> str:
    """One line of evidence for the anomalies table."""
    return "; ".join(line(e, e.facts) for fact, line in EVIDENCE if fact in e.facts)


def anomaly_records(episodes: list[Episode]) -> list[Anomaly]:
    """summary.json's anomalies in time order (their offset from the run's start is the summary's to add)."""
    return [
        Anomaly(
            kind=e.kind,
            start=round(e.start, 3),
            end=round(e.end, 3),
            duration_s=round(e.end - e.start, 3),
            gpus=tuple(sorted(e.gpus, key=_gpu_order)),
            ranks=tuple(sorted(e.ranks)),
            detail=describe(e),
        )
        for e in sorted(episodes, key=lambda e: (e.start, e.kind, e.end))
    ]


def _gpu_order(label: str) -> tuple[str, int]:
    host, _, gpu = label.rpartition(":")
    return host, int(gpu) if gpu.isdigit() else -1

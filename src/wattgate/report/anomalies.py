"""Anomalies of a run: hangs, data starvation and straggler ranks, each with its time span.

Evidence of one event from different sources (deadlock windows on several
GPUs and the watcher's verdict; starved windows and starved steps) is merged
into one episode when the time spans touch, so a table row is one event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from wattgate.report.phases import PhaseWindows, runs

STARVATION_MIN_S = 5.0  # a run of data_starvation windows shorter than this is a hiccup
STARVED_STEP_SHARE = 0.2  # a step that waited this share of its time for data is starved
STRAGGLER_RATIO = 1.10  # a rank this much slower (median compute time) than the median rank
HANG_VERDICTS = ("deadlock", "stuck_ranks")
QUIET_VERDICTS = (None, "running", "healthy")


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


def watcher_episode(watcher: dict | None) -> Episode | None:
    """The watcher's verdict as an episode: from when progress stopped to when it acted."""
    if not watcher or watcher.get("verdict") in QUIET_VERDICTS:
        return None
    verdict = str(watcher["verdict"])
    end = watcher.get("detected_at") or watcher.get("ended")
    if end is None:
        return None
    start = float(end) - float(watcher.get("stalled_for_s") or 0.0)
    ranks = set(watcher.get("stuck_ranks") or watcher.get("behind") or [])
    kind = "hang" if verdict in HANG_VERDICTS else verdict
    return Episode(
        kind, start, float(end), set(), {int(r) for r in ranks}, {"watcher": watcher.get("reason") or verdict}
    )


def hangs(w: PhaseWindows, watcher: dict | None, window_s: float) -> list[Episode]:
    found = _window_episodes(w, "deadlock", "hang", "deadlock GPU-seconds", 0.0, 2 * window_s)
    verdict = watcher_episode(watcher)
    if verdict is not None and verdict.kind == "hang":
        found.append(verdict)
    merged = merge(found, 2 * window_s)
    if verdict is not None and verdict.kind != "hang":
        merged.append(verdict)
    return merged


def starved_steps(metrics: pd.DataFrame | None) -> list[Episode]:
    """Per rank, runs of consecutive steps that waited >= STARVED_STEP_SHARE of their time for data."""
    if metrics is None or not {"step_time_s", "data_wait_s"} <= set(metrics.columns) or metrics.empty:
        return []
    m = metrics[["rank", "step", "time", "step_time_s", "data_wait_s"]].dropna()
    m = m[(m["step_time_s"] > 0) & (m["data_wait_s"] >= STARVED_STEP_SHARE * m["step_time_s"])]
    if m.empty:
        return []
    m = m.sort_values(["rank", "step"], kind="stable")
    rank, step = m["rank"].to_numpy(), m["step"].to_numpy()
    new = np.ones(len(m), bool)
    new[1:] = (rank[1:] != rank[:-1]) | (step[1:] != step[:-1] + 1)
    run = np.cumsum(new) - 1
    begin = m["time"].to_numpy(float) - m["step_time_s"].to_numpy(float)
    g = pd.DataFrame(
        {
            "run": run,
            "rank": rank,
            "begin": begin,
            "end": m["time"].to_numpy(float),
            "wait": m["data_wait_s"].to_numpy(float),
        }
    ).groupby("run")
    agg = g.agg(
        rank=("rank", "first"), begin=("begin", "min"), end=("end", "max"), steps=("end", "size"), wait=("wait", "sum")
    )
    return [
        Episode(
            "starvation",
            float(r.begin),
            float(r.end),
            set(),
            {int(r.rank)},
            {"starved steps": int(r.steps), "data wait s": float(r.wait)},
        )
        for r in agg.itertuples()
    ]


def starvation(w: PhaseWindows, metrics: pd.DataFrame | None, window_s: float) -> list[Episode]:
    found = _window_episodes(w, "data_starvation", "starvation", "starved GPU-seconds", STARVATION_MIN_S, 2 * window_s)
    steps = starved_steps(metrics)
    gap = 2 * window_s
    if metrics is not None and "step_time_s" in metrics.columns and len(metrics):
        gap = max(gap, 2 * float(metrics["step_time_s"].median()))  # neighbouring starved steps: one episode
    return merge(found + steps, gap)


def stragglers(metrics: pd.DataFrame | None, rank_gpu: dict[int, str]) -> list[Episode]:
    """Ranks whose median step time less data wait is >= STRAGGLER_RATIO x the median over ranks."""
    if metrics is None or not {"step_time_s", "data_wait_s"} <= set(metrics.columns) or metrics.empty:
        return []
    m = metrics.assign(
        compute=metrics["step_time_s"] - metrics["data_wait_s"], begin=metrics["time"] - metrics["step_time_s"]
    )
    per = m.groupby("rank").agg(
        compute=("compute", "median"), begin=("begin", "min"), end=("time", "max"), steps=("step", "size")
    )
    if len(per) < 2:
        return []
    typical = float(per["compute"].median())
    if not typical > 0:
        return []
    out = []
    for rank, r in per[per["compute"] >= STRAGGLER_RATIO * typical].iterrows():
        text = (
            f"rank {rank}: median step time less data wait {r.compute:.4g} s = "
            f"{r.compute / typical:.2f}x the median over {len(per)} ranks ({typical:.4g} s)"
        )
        gpus = {rank_gpu[int(rank)]} if int(rank) in rank_gpu else set()
        out.append(
            Episode(
                "straggler",
                float(r.begin),
                float(r.end),
                gpus,
                {int(rank)},
                {"straggler": text, "ratio": round(float(r.compute / typical), 4)},
            )
        )
    return out


def describe(e: Episode) -> str:
    """One line of evidence for the anomalies table."""
    parts = []
    f = e.facts
    if "deadlock GPU-seconds" in f:
        parts.append(
            f"power triage: low-power wait without progress on {len(e.gpus)} GPU(s) "
            f"({f['deadlock GPU-seconds']:.0f} GPU-s)"
        )
    if "starved GPU-seconds" in f:
        parts.append(f"power triage: data_starvation on {len(e.gpus)} GPU(s) ({f['starved GPU-seconds']:.0f} GPU-s)")
    if "starved steps" in f:
        parts.append(
            f"metrics: {f['starved steps']} step(s) on {len(e.ranks)} rank(s) waited >= "
            f"{100 * STARVED_STEP_SHARE:.0f}% of the step for data ({f['data wait s']:.1f} s of waiting)"
        )
    if "watcher" in f:
        parts.append(f"watcher: {f['watcher']}")
    if "straggler" in f:
        parts.append(f["straggler"])
    return "; ".join(parts)


def anomaly_records(episodes: list[Episode]) -> list[dict]:
    rows = []
    for e in sorted(episodes, key=lambda e: (e.start, e.kind, e.end)):
        rows.append(
            {
                "kind": e.kind,
                "start": round(e.start, 3),
                "end": round(e.end, 3),
                "duration_s": round(e.end - e.start, 3),
                "gpus": sorted(e.gpus, key=_gpu_order),
                "ranks": sorted(e.ranks),
                "detail": describe(e),
            }
        )
    return rows


def _gpu_order(label: str) -> tuple[str, int]:
    host, _, gpu = label.rpartition(":")
    return host, int(gpu) if gpu.isdigit() else -1

"""What a training run recorded, as triage reads it: heartbeat events and states, metrics, rank -> GPU.

Also the run-info facts rule 6 (run_rules.py) rests on: checkpoint intervals, when
each rank said done, progress stamps, and interval arithmetic on windows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from wattgate.errors import InputError
from wattgate.records.trace_meta import TraceMeta
from wattgate.heartbeats import (
    EVENT_PHASE,
    EVENT_RANK,
    EVENT_TIME,
    HEARTBEAT_EVENT_COLUMNS,
    read_heartbeat_events,
    read_heartbeats,
)
from wattgate.records.heartbeat import Beat
from wattgate.run_files import (
    METRICS,
    check_columns,
    read_metrics,
)
from wattgate.run_tables import TIME as METRICS_TIME


@dataclass
class RunInfo:
    """What the training run recorded: heartbeat events and states, metrics, and where ranks ran."""

    events: pd.DataFrame  # time, rank, step, epoch, phase (sorted by rank, time)
    states: dict[int, Beat]  # rank -> latest heartbeat
    metrics: pd.DataFrame | None = None  # rows per (step, rank)
    gpu_uuids: dict[str, tuple[str, int]] = field(default_factory=dict)  # NVML UUID -> (host, index)
    source: str = ""

    @property
    def has_heartbeats(self) -> bool:
        return bool(len(self.events) or self.states)

    @property
    def has_metrics(self) -> bool:
        return self.metrics is not None and len(self.metrics) > 0


EVENT_COLUMNS = HEARTBEAT_EVENT_COLUMNS


RUN_INFO_METRICS = ["step", "rank", "time", "step_time_s", "data_wait_s"]  # what the run-info rules read


def load_run_info(
    run_dir: str | os.PathLike,
    trace_metas: list[TraceMeta] | None = None,
    metrics: pd.DataFrame | None = None,
    on_bad: Callable[[str], object] | None = None,
) -> RunInfo:
    """Heartbeat events/states and metrics.parquet of a run folder; every file is optional. `metrics`: the
    file already read (with at least RUN_INFO_METRICS), so that it is not read twice. `on_bad`: where a note
    on a damaged heartbeat goes (it is then skipped, as heartbeats.read_heartbeats says); None: an error."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run folder")
    ev, states = read_heartbeat_events(run_dir, on_bad), read_heartbeats(run_dir, on_bad=on_bad)
    if metrics is None:
        metrics = read_metrics(run_dir, RUN_INFO_METRICS)
    else:
        check_columns(run_dir / METRICS, metrics.columns, RUN_INFO_METRICS, "metrics", "train")
    return RunInfo(ev, states, metrics, gpu_uuids(trace_metas or []), str(run_dir))


def gpu_uuids(trace_metas: list[TraceMeta]) -> dict[str, tuple[str, int]]:
    """GPU UUID -> (host, index), from the traces' metadata (the heartbeats name a rank's GPU by its UUID)."""
    out: dict[str, tuple[str, int]] = {}
    for meta in trace_metas:
        if meta.host is None:
            continue
        for g in meta.gpu_list:
            if not g.uuid:
                continue
            if g.index is None:
                raise InputError(f"trace metadata of host {meta.host!r}: GPU {g.uuid} has a UUID but no index")
            out[str(g.uuid)] = (str(meta.host), g.index)
    return out


def _short(host: str) -> str:
    return host.split(".")[0]


def map_ranks(info: RunInfo, gpu_keys: list[tuple[str, int]]) -> dict[int, int]:
    """rank -> index into gpu_keys: the heartbeat's GPU UUID if the traces list it, else host + local_rank."""
    index = {k: i for i, k in enumerate(gpu_keys)}
    by_short = {(_short(h), g): i for (h, g), i in index.items()}
    out = {}
    for rank, s in sorted(info.states.items()):
        gpu = s.gpu
        if isinstance(gpu, str) and gpu in info.gpu_uuids and info.gpu_uuids[gpu] in index:
            out[rank] = index[info.gpu_uuids[gpu]]
            continue
        host, local = s.host, s.local_rank
        if host is None or local is None:
            continue
        key = (host, local)
        if key in index:
            out[rank] = index[key]
        elif (_short(host), local) in by_short:
            out[rank] = by_short[(_short(host), local)]
    return out


def _merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    return s[new], np.maximum.reduceat(e, np.flatnonzero(new))


def _covered_share(starts: np.ndarray, ends: np.ndarray, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """Share of each window [w0, w1) that the (unmerged) intervals cover."""
    s, e = _merge_intervals(np.asarray(starts, float), np.asarray(ends, float))
    if len(s) == 0:
        return np.zeros(len(w0))
    lens = e - s
    cum = np.concatenate([[0.0], np.cumsum(lens)])

    def covered_before(t):  # total interval length before time t
        k = np.searchsorted(s, t, side="right")
        last = np.maximum(k - 1, 0)
        part = np.clip(t - s[last], 0.0, lens[last])
        return np.where(k > 0, cum[last] + part, 0.0)

    w0, w1 = np.asarray(w0, float), np.asarray(w1, float)
    before0 = covered_before(w0)
    # where a window ends where the next one starts (most do), that start's figure is the end's
    before1 = np.empty_like(before0)
    if len(w0):
        before1[:-1] = before0[1:]
        own = np.ones(len(w0), dtype=bool)
        own[:-1] = w1[:-1] != w0[1:]
        before1[own] = covered_before(w1[own])
    return (before1 - before0) / (w1 - w0)


INTERVAL_RANK, INTERVAL_START, INTERVAL_END = "rank", "start", "end"  # a phase interval table's columns


def _phase_intervals(events: pd.DataFrame, phases: tuple[str, ...]) -> pd.DataFrame:
    """Closed intervals per rank of the given heartbeat phases: such an event to the rank's next event (a phase
    that never ended, e.g. a hang inside it, has no interval)."""
    if events.empty:
        return pd.DataFrame({INTERVAL_RANK: [], INTERVAL_START: [], INTERVAL_END: []})
    ev = events.sort_values([EVENT_RANK, EVENT_TIME], kind="stable")
    nxt_time = ev.groupby(EVENT_RANK)[EVENT_TIME].shift(-1)
    ck = ev[EVENT_PHASE].isin(list(phases)) & nxt_time.notna()
    return pd.DataFrame(
        {
            INTERVAL_RANK: ev[EVENT_RANK][ck].to_numpy(),
            INTERVAL_START: ev[EVENT_TIME][ck].to_numpy(),
            INTERVAL_END: nxt_time[ck].to_numpy(),
        }
    )


def _checkpoint_intervals(events: pd.DataFrame) -> pd.DataFrame:
    """Closed checkpoint intervals per rank: a "checkpoint" or "export" event to the rank's next event."""
    return _phase_intervals(events, ("checkpoint", "export"))


def _eval_intervals(events: pd.DataFrame) -> pd.DataFrame:
    """Closed validation passes per rank: an "eval" event to the rank's next event (the loop's forward-only
    pass over the held-out documents: compute, whatever its power reads)."""
    return _phase_intervals(events, ("eval",))


def _done_times(info: RunInfo) -> dict[int, float]:
    """rank -> when it said done (inf if it never did), from events, else its heartbeat state."""
    out = {int(r): math.inf for r in set(info.events[EVENT_RANK]) | set(info.states)}
    ev = info.events[info.events[EVENT_PHASE] == "done"]
    first_done = ev.groupby(EVENT_RANK)[EVENT_TIME].min()
    for r, t in zip(first_done.index.to_numpy(), first_done.to_numpy()):
        out[int(r)] = float(t)
    for r, st in info.states.items():
        if st.phase == "done" and not math.isfinite(out[r]):
            out[r] = float(st.time)
    return out


def _progress(info: RunInfo) -> tuple[np.ndarray, float]:
    """(sorted progress stamps, when the run was over): the gaps between stamps are candidate stalls."""
    stamps = [
        info.events[EVENT_TIME].to_numpy(float),
        np.array([float(s.time) for s in info.states.values()], dtype=float),
    ]
    if info.metrics is not None and info.has_metrics:
        stamps.append(info.metrics[METRICS_TIME].to_numpy(float))
    stamps = np.unique(np.concatenate(stamps))
    over = [info.events[EVENT_TIME][info.events[EVENT_PHASE].isin(["export", "done"])].to_numpy(float)]
    over.append(np.array([float(s.time) for s in info.states.values() if s.phase in ("export", "done")], dtype=float))
    over = np.concatenate(over)
    return stamps, float(over.min()) if len(over) else math.inf

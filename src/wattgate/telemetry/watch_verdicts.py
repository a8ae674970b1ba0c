"""The watcher's verdicts: what a stall means, decided from each rank's heartbeat, the last seconds of every
node's power trace and, for ranks on the watcher's host, their processes' CPU time (telemetry/watch.py reads
them every poll and acts on the verdict). Pure: the tests drive them with hand-written inputs.

- deadlock, only on its signature: ranks out of step (another step or phase, a different number of
  planned micro-batches: one rank in a collective the others never call) with no sign of work, or
  every rank waiting: the GPUs in the low power band, or without power data every rank process
  idle (a rank blocked in a gloo collective uses no CPU; bench/watch_cpu_signal.py). Ranks that
  reached a later position are named as having run ahead; the rest are behind. With power data, a
  rank at ~0% utilization while its peers spin in a collective is named as the stuck one.
- a slow step: ranks in step with work going on (busy GPUs, a computing rank) or no evidence either
  way. Warned about at `hang_after_s`, stopped as `train_stalled` (or `eval_stalled`) only after
  `busy_stall_after_s`; the first step of a phase in this attempt (compiles, first loads) and a
  heartbeat saying `compiling` get `startup_after_s` instead, and low power there is no evidence.
- a checkpoint (or init / export) that every rank announced gets its own, longer limit and is never
  called a hang (past that limit the verdict is `checkpoint_stalled`, etc.); a phase that only some
  ranks entered is a desynchronization. `eval` (validation) runs collectives like `train`.
A rank process stopped (`T`) or stuck in I/O (`D`) on this host is named at the head of the reason
(watch_inputs.state_notes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from wattgate.collective_hints import hang_hint
from wattgate.triage_tables import TriageTable
from wattgate.records.heartbeat import Beat
from wattgate.records.watcher import RankView, Verdict, WatcherSettings
from wattgate.telemetry.watch_inputs import (
    COLLECTIVE_PHASES,
    WATCH_PHASES,
    Activity,
    odd_state_ranks,
    state_notes,
)
from wattgate.records.gate import Collectives

PHASE_ORDER = {phase: i for i, phase in enumerate(WATCH_PHASES)}


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchedJob:
    """What the watcher knows of a job before it starts: its number of ranks, the limits and action, and its GPU
    model's power bands (None: no triage table, so power is no evidence)."""

    world: int
    settings: WatcherSettings
    table: TriageTable | None


def position(beat: Beat) -> tuple[int, int, float, int]:
    """Where a rank is, comparable across ranks: steps done, phase, share of this step's micro-batches
    started, and fewer planned micro-batches first (that rank reaches the step's gradient reduction
    while its peers still run forward passes: the collective sequences no longer match)."""
    micros = beat.micros or 0
    started = (beat.micro or 0) / micros if micros else 0.0
    return beat.step, PHASE_ORDER.get(beat.phase, 0), started, -micros


def phase_limit(beats: dict[int, Beat], s: WatcherSettings) -> tuple[float, str]:
    """The stall allowed now: long only for a phase every rank announced at the same step, or while some rank
    still starts up (a rank reading its weight shard while the others wait in the first step's all-gather)."""
    if any(b.phase == "init" for b in beats.values()):
        return s.startup_after_s, "init"
    phases = {(b.phase, b.step) for b in beats.values()}
    if len(phases) == 1:
        phase = next(iter(phases))[0]
        if phase == "checkpoint":
            return s.checkpoint_after_s, "checkpoint"
        if phase in ("init", "export"):
            return s.startup_after_s, phase
        if phase == "eval":  # a validation pass runs collectives like a step: a stall there is a hang
            return s.hang_after_s, "eval"
    return s.hang_after_s, "train"


def in_step(beats: dict[int, Beat]) -> bool:
    """The ranks agree on where they are, up to a healthy step's skew: the same step and phase, the same planned
    micro-batches, at most one micro-batch apart (a rank done with its backward pass starts the next
    micro-batch and waits in its first all-gather for the slower ones)."""
    if len({(b.step, b.phase) for b in beats.values()}) > 1:
        return False
    if len({b.micros for b in beats.values() if b.micros}) > 1:
        return False
    micro = [b.micro or 0 for b in beats.values()]
    return max(micro) - min(micro) <= 1


def in_startup(beats: dict[int, Beat], firsts: dict[int, dict[str, int]]) -> bool:
    """Some rank is in the first step of its phase in this attempt, or says it compiles: start-up, where
    compiles and first loads take long and leave the GPUs idle."""
    return any(b.compiling or firsts.get(r, {}).get(b.phase) == b.step for r, b in beats.items())


def evidence(
    gpus: dict, table: TriageTable | None, activity: dict[int, Activity], beats: dict, startup: bool
) -> tuple[str | None, str]:
    """('waiting' | 'working' | None: unknown, what it rests on) for a stall: power where the trace has it,
    else the rank processes on this host."""
    low = _low_band(gpus, table)
    if low is False:
        return "working", "GPUs still busy at high power"
    if low:
        assert table is not None  # _low_band: no table, no verdict
        band = f"GPUs in the low power band (< {table.low_max_w:.0f} W)"
        return (None, f"{band} in a start-up step") if startup else ("waiting", band)
    seen = {r: a for r, a in activity.items() if r in beats}
    working = sorted(r for r, a in seen.items() if not a.waiting)
    if working:
        busy = ", ".join(f"rank {r} {seen[r].cpu_share:.2f} of a core" for r in working)
        return "working", f"no power data; rank processes working: {busy}"
    if seen and len(seen) == len(beats):
        top = max(a.cpu_share for a in seen.values())
        over = min(a.over_s for a in seen.values())
        return "waiting", f"no power data; every rank process waits: <= {top:.2f} of a core, no I/O, over {over:.0f} s"
    if seen:
        return None, f"no power data; rank(s) {_list(sorted(seen))} wait, the others are not on this host"
    return None, "no power data and no rank process readable on this host"


class _GpuReading(TypedDict, total=False):
    """RankView's GPU keys, when there is a reading (else RankView's ABSENT)."""

    power_w: float
    util_gpu: float


class _Process(TypedDict, total=False):
    """RankView's process keys, for a rank on this host."""

    cpu_share: float
    io_bytes: int
    proc_state: str


def describe_rank(b: Beat, now: float, gpu=None, activity: Activity | None = None) -> RankView:
    """A verdict's `ranks` entry: where the rank's heartbeat places it, its GPU's (power W, util %) over the stall
    and, on this host, what its process did (ActivityMeter)."""
    power: _GpuReading = {} if not gpu else {"power_w": round(gpu[0], 1), "util_gpu": round(gpu[1], 1)}
    proc: _Process = {}
    if activity:
        proc = {"cpu_share": activity.cpu_share, "io_bytes": activity.io_bytes, "proc_state": activity.state}
    return RankView(
        rank=b.rank,
        host=b.host,
        local_rank=b.local_rank,
        gpu=b.gpu,
        step=b.step,
        micro=b.micro,
        micros=b.micros,
        epoch=b.epoch,
        phase=b.phase,
        total_steps=b.total_steps,
        last_beat_age_s=round(now - b.time, 3),
        planned_epoch_end=b.epoch_end(),
        **power,
        **proc,
    )


def diagnose(
    job: WatchedJob,
    beats: dict[int, Beat],
    now: float,
    started: float,
    power: dict[tuple[str, int], tuple[float, float, float]],
    activity: dict[int, Activity] | None = None,
    firsts: dict[int, dict[str, int]] | None = None,
) -> Verdict | None:
    """A verdict when the job must be stopped, else None. Pure: the tests drive it with files."""
    return assess(job, beats, now, started, power, activity, firsts)[0]


def assess(
    job: WatchedJob,
    beats: dict[int, Beat],
    now: float,
    started: float,
    power: dict[tuple[str, int], tuple[float, float, float]],
    activity: dict[int, Activity] | None = None,
    firsts: dict[int, dict[str, int]] | None = None,
) -> tuple[Verdict | None, str | None]:
    """(the verdict when the job must be stopped, else None; a warning when a stall is let run on).

    Only the deadlock signature kills at `hang_after_s`: ranks out of step with no sign of work, or every rank
    waiting (low power; without power data, every rank process idle). Anything else is a slow step: warned
    about, and stopped as `<phase>_stalled` (not a confirmed deadlock) only after `busy_stall_after_s`, or
    `startup_after_s` in a start-up step."""
    world, table, s = job.world, job.table, job.settings
    activity, firsts = activity or {}, firsts or {}
    if len(beats) == world and all(b.phase == "done" for b in beats.values()):
        return None, None
    missing = sorted(set(range(world)) - set(beats))
    if missing:
        if now - started < s.startup_after_s:
            return None, None
        reason = (
            f"rank(s) {_list(missing)} never reported a heartbeat in {s.startup_after_s:.0f} s "
            f"while rank(s) {_list(sorted(beats))} started"
        )
        v = _verdict(
            beats,
            now,
            {},
            activity,
            verdict="stuck_ranks",
            reason=reason,
            stalled_for_s=now - started,
            limit_s=s.startup_after_s,
            limit_phase="init",
            stuck_ranks=tuple(missing),
            ran_ahead=tuple(sorted(beats)),
            behind=tuple(missing),
        )
        return v, None
    active = {r: b for r, b in beats.items() if b.phase != "done"}
    stalled_for = now - max(b.time for b in active.values())
    limit, limit_phase = phase_limit(active, s)
    gpus = _rank_power(beats, power)
    where = "; ".join(where_is(beats[r], now) for r in sorted(beats))
    if limit_phase not in COLLECTIVE_PHASES:  # every rank announced it: an overlong phase, not a collective hang
        if stalled_for < limit:
            return None, None
        desc = evidence(gpus, table, activity, active, False)[1]
        verdict = f"{limit_phase}_stalled"
        reason = (
            f"{verdict}: every rank has been in {limit_phase} for {stalled_for:.1f} s (limit {limit:.0f} s; "
            f"{desc}): {where}"
        )
        v = _verdict(
            beats,
            now,
            gpus,
            activity,
            verdict=verdict,
            reason=reason,
            stalled_for_s=stalled_for,
            limit_s=limit,
            limit_phase=limit_phase,
            power_signal=desc,
        )
        return v, None
    if stalled_for < s.hang_after_s:
        return None, None
    startup = in_startup(active, firsts)
    kind, desc = evidence(gpus, table, activity, active, startup)
    agree = in_step(beats)
    if kind == "waiting" or (not agree and kind != "working"):
        stall = _Stall(stalled_for_s=stalled_for, limit_phase=limit_phase, evidence=desc, in_step=agree, where=where)
        return _deadlock(job, beats, now, gpus, activity, stall), None
    long_limit = s.startup_after_s if startup else s.busy_stall_after_s
    what = "a start-up step" if startup else "a slow step"
    if stalled_for < long_limit:
        warning = (
            f"no rank advanced for {stalled_for:.0f} s ({desc}): {what}, not the deadlock signature; "
            f"stopped only after {long_limit:.0f} s: {where}"
        )
        return None, warning
    verdict = f"{limit_phase}_stalled"
    reason = (
        f"{verdict}: no rank advanced for {stalled_for:.1f} s, past the {long_limit:.0f} s allowed for {what} "
        f"({desc}); not a confirmed deadlock: {where}"
    )
    v = _verdict(
        beats,
        now,
        gpus,
        activity,
        verdict=verdict,
        reason=reason,
        stalled_for_s=stalled_for,
        limit_s=long_limit,
        limit_phase=limit_phase,
        power_signal=desc,
    )
    return v, None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Stall:
    """A stall in a collective phase past `hang_after_s`, as assess saw it: how long no rank advanced, the phase
    whose limit applies, what power or the rank processes say, whether the ranks are in step, where each rank is."""

    stalled_for_s: float
    limit_phase: str
    evidence: str
    in_step: bool
    where: str


def _deadlock(
    job: WatchedJob,
    beats: dict[int, Beat],
    now: float,
    gpus: dict[int, tuple[float, float, float] | None],
    activity: dict[int, Activity],
    stall: _Stall,
) -> Verdict:
    table, stalled_for, desc, where = job.table, stall.stalled_for_s, stall.evidence, stall.where
    positions = {r: position(b) for r, b in beats.items()}
    top = max(positions.values())
    ahead = sorted(r for r, p in positions.items() if p == top)
    behind = [] if stall.in_step else sorted(r for r, p in positions.items() if p != top)
    idle = sorted(r for r, g in gpus.items() if table is not None and g and g[1] <= table.idle_util_pct)
    waiting = sorted(r for r, g in gpus.items() if table is not None and g and g[1] >= table.busy_util_pct)
    stopped = odd_state_ranks(activity)  # a stopped process (SIGSTOP, a debugger) is the one stuck (state_notes)
    stuck = stopped or (idle if idle and waiting else behind)
    if behind:
        reason = (
            f"deadlock: no rank advanced for {stalled_for:.1f} s ({desc}); rank(s) {_list(ahead)} ran "
            f"ahead of rank(s) {_list(behind)}{_phases_differ(beats)}{_uneven_step(beats)}: {where}"
        )
    elif stuck and not stopped:
        reason = (
            f"deadlock: no rank advanced for {stalled_for:.1f} s ({desc}); rank(s) {_list(stuck)} idle "
            f"while the others wait in a collective: {where}"
        )
    else:
        reason = f"deadlock: no rank advanced for {stalled_for:.1f} s ({desc}): {where}"
    return _verdict(
        beats,
        now,
        gpus,
        activity,
        verdict="deadlock",
        reason=reason,
        stalled_for_s=stalled_for,
        limit_s=job.settings.hang_after_s,
        limit_phase=stall.limit_phase,
        power_signal=desc,
        ran_ahead=tuple(ahead if behind else ()),
        behind=tuple(behind),
        stuck_ranks=tuple(stuck),
        confirmed=True,
    )


def _verdict(beats, now, gpus, activity, *, reason: str, stalled_for_s: float, **fields) -> Verdict:
    """A verdict with each rank's view; `confirmed` (a deadlock's signature) is what lets the cost claim a saving."""
    ranks = tuple(describe_rank(b, now, gpus.get(r), activity.get(r)) for r, b in sorted(beats.items()))
    if notes := state_notes(beats, activity, now):  # the rank and its process state first, in the line itself
        head, _, rest = reason.partition(": ")
        reason = f"{head}: {'; '.join(notes)}; {rest}"
    return Verdict(reason=reason, stalled_for_s=round(stalled_for_s, 3), ranks=ranks, **fields)


def _phases_differ(beats: dict[int, Beat]) -> str:
    """' (rank(s) 0 in train, rank(s) 1 in eval)' when the ranks are in different phases."""
    by_phase: dict[str, list[int]] = {}
    for r, b in sorted(beats.items()):
        by_phase.setdefault(b.phase, []).append(r)
    if len(by_phase) < 2:
        return ""
    return " (" + ", ".join(f"rank(s) {_list(rs)} in {p}" for p, rs in by_phase.items()) + ")"


def _uneven_step(beats: dict[int, Beat]) -> str:
    """' (step 18 planned with 1 micro-batch on rank 0, 2 on rank 1)' when ranks in one step disagree."""
    in_step_ = {r: b for r, b in beats.items() if b.phase in COLLECTIVE_PHASES and b.micros}
    steps = {(b.step, b.phase) for b in in_step_.values()}
    if len(steps) != 1 or len({b.micros for b in in_step_.values()}) < 2:
        return ""
    step, phase = steps.pop()
    plans = ", ".join(f"{b.micros} on rank {r}" for r, b in sorted(in_step_.items()))
    what = f"step {step + 1}" if phase == "train" else f"the validation after step {step}"
    return f" (micro-batches planned for {what}: {plans}; the collective sequences differ)"


def where_is(b: Beat, now: float) -> str:
    """'rank 1: checkpointing after step 18, the last step of its epoch 0 (...)' for the verdict line."""
    step, phase, epoch = b.step, b.phase, b.epoch
    total = b.total_steps
    end = b.epoch_end()
    if phase == "train":
        if total is not None and step >= total:
            pos = "past its last step"
        elif b.micros:
            pos = f"in step {step + 1}, micro-batch {b.micro} of {b.micros}"
        else:
            pos = f"in step {step + 1}"
        if end is not None and end > step:
            pos += f" of epoch {epoch} (its epoch ends at step {end})"
    elif phase == "eval":
        pos = f"in validation after step {step}"
        if b.micros:
            pos += f", micro-batch {b.micro} of {b.micros}"
    else:
        pos = {
            "init": "starting up",
            "checkpoint": f"checkpointing after step {step}",
            "export": f"exporting after step {step}",
            "done": "done",
        }.get(phase, phase)
        if phase == "checkpoint" and end == step:
            pos += f", the last step of its epoch {epoch}"
    plan = f", {total} steps planned" if total is not None else ""
    return f"rank {b.rank}: {pos} (last heartbeat {now - b.time:.1f} s ago{plan})"


def _list(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _rank_power(beats: dict[int, Beat], power: dict) -> dict[int, tuple[float, float, float] | None]:
    return {r: power.get((b.host, b.local_rank or 0)) for r, b in beats.items()}


def _low_band(gpus: dict, table: TriageTable | None) -> bool | None:
    """True: every GPU we have data for is in the low band; False: some GPU is busy; None: no data."""
    have = [g for g in gpus.values() if g]
    if table is None or not have:
        return None
    return all(g[0] < table.low_max_w for g in have)


def with_expected_collectives(verdict: Verdict, beats: dict[int, Beat], collectives: Collectives | None) -> Verdict:
    """The verdict with, per rank, its step class and the collective the proof expected next (`expected`), and
    those of the ranks named behind or stuck added to the reason: where the ranks' collectives parted."""
    expected = {r: hang_hint(collectives, r, b) for r, b in sorted(beats.items())} if collectives else {}
    expected = {r: h for r, h in expected.items() if h}
    if not expected:
        return verdict
    named = verdict.behind or verdict.stuck_ranks or sorted(expected)
    lines = [expected[r] for r in named if r in expected]
    return verdict.replace(
        expected={str(r): h for r, h in expected.items()},
        reason=verdict.reason + ("; " + "; ".join(lines) if lines else ""),
    )

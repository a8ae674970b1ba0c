"""watcher.json, the hang watcher's record in the run folder: its settings, what it warned about, the verdict it
reached (reason, evidence, the ranks and their GPUs' power), what a kill cost, and how the job ended.
Format: docs/architecture.md, "watcher.json".

watcher.json carries no format_version. Every key but `verdict` is optional on read: the report shows what a
damaged or hand-made record (tests write partial ones) holds. A key the watcher writes only in some cases is
absent otherwise (None, or ABSENT for a key that is written null when it has no value). A GPU with no
power reading is NaN in memory and null on disk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from wattgate.records.base import ABSENT, Record, spec
from wattgate.records.attempt import Stopped
from wattgate.records.run_config import WatcherConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class WatcherSettings(Record):
    """The watcher's limits and action (the config's `watcher`, less `enabled`); watcher.json `settings`."""

    hang_after_s: float
    checkpoint_after_s: float
    startup_after_s: float
    busy_stall_after_s: float
    action: str
    poll_s: float
    kill_grace_s: float

    @classmethod
    def from_config(cls, watcher: WatcherConfig) -> WatcherSettings:
        return cls(**{f.name: getattr(watcher, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchWarning(Record):
    """One slow-step warning (watcher.json keeps the last 20)."""

    time: float
    warning: str


STRAGGLER_CAUSES = ("thermal", "power_cap", "hw_slowdown", "rank0_work", "unknown")


@dataclass(frozen=True, kw_only=True, slots=True)
class Straggler(Record):
    """A rank the others kept waiting for, warned about once (telemetry/lag_watch.py); with its counts over the
    whole run (`lag_share` ... `last`) once in watcher.json `stragglers`."""

    rank: int = spec(minimum=0)
    host: str | None
    gpu: int | None  # its local index with power data, None without
    signal: Literal["power", "cpu"]
    detected_at: float
    step: int | None
    cause: Literal["thermal", "power_cap", "hw_slowdown", "rank0_work", "unknown"]
    evidence: str
    window_s: float
    lag_share: float | None = None
    lag_windows: int | None = None
    wait_windows: int | None = None
    wait_gpu_hours: float | None = None  # power
    wait_rank_hours: float | None = None  # cpu
    wait_kwh: float | None = None
    first: float | None = None
    last: float | None = None

    @property
    def where(self) -> str:
        """'GPU n1:2' (power) or 'host n1' (CPU time) for its warning line."""
        return f"GPU {self.host}:{self.gpu}" if self.gpu is not None else f"host {self.host}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RankView(Record):
    """A verdict's `ranks` entry: the rank's heartbeat (where it is), its GPU's power and utilization over the
    stall (NaN: no reading; ABSENT: no power data), and for a rank on the watcher's host its process. The watcher
    writes every heartbeat key (null when the heartbeat had none); an older record may hold fewer."""

    rank: int | None = None
    host: str | None = None
    local_rank: int | None = None
    gpu: str | None = None  # the GPU's UUID, from its heartbeat
    step: int | None = None
    micro: int | None = None
    micros: int | None = None
    epoch: int | None = None
    phase: str | None = None
    total_steps: int | None = None
    last_beat_age_s: float | None = None
    planned_epoch_end: int | None = None
    power_w: float | None = ABSENT
    util_gpu: float | None = ABSENT
    cpu_share: float | None = spec(omit_none=True, default=None)
    io_bytes: int | None = spec(omit_none=True, default=None)
    proc_state: str | None = spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict(Record):
    """What the watcher decided about a stall (telemetry/watch.py); its fields become watcher.json's.
    `confirmed` (a deadlock's signature) is what lets the cost claim a saving."""

    verdict: str
    reason: str
    confirmed: bool = False
    stalled_for_s: float
    limit_s: float
    limit_phase: str
    ran_ahead: tuple[int, ...] = ()
    behind: tuple[int, ...] = ()
    stuck_ranks: tuple[int, ...] = ()
    power_signal: str = ""
    ranks: tuple[RankView, ...] = ()
    expected: dict[str, str] | None = spec(omit_none=True, default=None)  # rank -> the collective it was due


@dataclass(frozen=True, kw_only=True, slots=True)
class JobKill(Record):
    """watcher.json `kill`: what was signalled or cancelled (telemetry/kill.py)."""

    killed_ranks: tuple[int, ...] | None = spec(omit_none=True, default=None)  # SIGKILL at once
    terminated: tuple[int, ...] | None = spec(omit_none=True, default=None)  # SIGTERM (on Slurm: the srun)
    killed_after_grace: tuple[int, ...] | None = spec(omit_none=True, default=None)
    scancel: str | None = spec(omit_none=True, default=None)
    returncode: int | None = spec(omit_none=True, default=None)
    stderr: str | None = spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class WithoutWatcher(Record):
    """A confirmed deadlock's cost had the watcher not stopped it: until the collective timeout, and on Slurm up to
    the job's time limit (`job_limit_s` ... `limit_kwh`, absent locally)."""

    timeout_s: float
    gpu_hours: float
    kwh: float | None
    job_limit_s: float | None = spec(omit_none=True, default=None)
    until_limit_s: float | None = spec(omit_none=True, default=None)
    limit_gpu_hours: float | None = spec(omit_none=True, default=None)
    limit_kwh: float | None = ABSENT


@dataclass(frozen=True, kw_only=True, slots=True)
class HangCost(Record):
    """watcher.json `cost`: GPU-hours and energy from the last progress to the kill; `without_watcher` only for
    a confirmed deadlock (a saving is claimed for nothing else)."""

    spent_s: float
    gpus: int
    spent_gpu_hours: float
    spent_kwh: float | None
    power_w: float | None  # the GPUs' summed draw; None without power data
    without_watcher: WithoutWatcher | None = spec(omit_none=True, default=None)
    line: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFailure(Record):
    """The root cause of a failed job (telemetry/failures.py): its rank, the cause, and launch's one line;
    watcher.json `job_end.failure`."""

    rank: int
    cause: str  # "killed by SIGKILL (signal 9)" or the rank's own one-line error
    line: str  # "rank 1 died: killed by SIGKILL (signal 9) in step 13: the OOM killer or a kill -9"
    exit_status: int  # what launch exits with: 2 when the rank's own exit was 2 (an input or OS error), else 1
    others: tuple[int, ...] = ()  # ranks that failed after it
    # whether a retry of the job may succeed: a rank killed by a signal (a node lost, a preemption) or a peer lost
    # may; a rank's own error (a non-finite loss, an input error, a full disk) repeats until a person acts
    retriable: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class JobEnd(Record):
    """watcher.json `job_end`, written by launch once the job has ended."""

    returncode: int
    time: float
    failure: RankFailure | None
    stopped: Stopped | None  # STOPPED's record (a graceful stop)
    hard_stop: str | None  # the second signal that stopped it at once


QUIET_VERDICTS = ("running", "healthy", "stopped")  # found nothing (a graceful stop): a new watcher may replace them


@dataclass(frozen=True, kw_only=True, slots=True)
class WatcherRecord(Record):
    """watcher.json: written at start (`running`), on a verdict, and at the end; launch adds `job_end`."""

    verdict: str
    started: float | None = spec(omit_none=True, default=None)
    ended: float | None = spec(omit_none=True, default=None)
    settings: WatcherSettings | None = spec(omit_none=True, default=None)
    world_size: int | None = spec(minimum=1, omit_none=True, default=None)
    table: str | None = ABSENT  # the triage table's GPU model; None without one
    pid: int | None = ABSENT
    slurm_job: str | None = ABSENT
    longest_stall_s: float | None = spec(omit_none=True, default=None)
    warnings: tuple[WatchWarning, ...] | None = spec(omit_none=True, default=None)
    warnings_total: int | None = spec(minimum=0, omit_none=True, default=None)
    bad_heartbeats: dict[str, str] | None = spec(omit_none=True, default=None)  # heartbeat file -> what was wrong
    stragglers: tuple[Straggler, ...] | None = spec(omit_none=True, default=None)
    # on a verdict (Verdict's fields), when and what it did
    reason: str | None = spec(omit_none=True, default=None)
    confirmed: bool | None = spec(omit_none=True, default=None)
    stalled_for_s: float | None = spec(omit_none=True, default=None)
    limit_s: float | None = spec(omit_none=True, default=None)
    limit_phase: str | None = spec(omit_none=True, default=None)
    ran_ahead: tuple[int, ...] | None = spec(omit_none=True, default=None)
    behind: tuple[int, ...] | None = spec(omit_none=True, default=None)
    stuck_ranks: tuple[int, ...] | None = spec(omit_none=True, default=None)
    power_signal: str | None = spec(omit_none=True, default=None)
    ranks: tuple[RankView, ...] | None = spec(omit_none=True, default=None)
    expected: dict[str, str] | None = spec(omit_none=True, default=None)
    detected_at: float | None = spec(omit_none=True, default=None)
    action: str | None = spec(omit_none=True, default=None)
    # a failed job (the watcher's final verdict, or launch's): failed_rank is None when no rank left a record
    failed_rank: int | None = ABSENT
    cause: str | None = spec(omit_none=True, default=None)
    # after a kill
    kill: JobKill | None = spec(omit_none=True, default=None)
    killed_at: float | None = spec(omit_none=True, default=None)
    cost: HangCost | None = spec(omit_none=True, default=None)
    job_end: JobEnd | None = spec(omit_none=True, default=None)

    def with_verdict(self, v: Verdict, **more) -> WatcherRecord:
        """This record with the verdict's fields (and `more`) set."""
        return self.replace(**{f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, **more)

    @property
    def quiet(self) -> bool:
        """Found nothing (running, healthy, a graceful stop): a new watcher may replace it."""
        return self.verdict in QUIET_VERDICTS

    @property
    def reached(self) -> bool:
        """A verdict the watcher itself reached (a deadlock, a stall, missing ranks), not how the job ended."""
        return self.verdict not in (*QUIET_VERDICTS, "failed")


@dataclass(frozen=True, kw_only=True, slots=True)
class AbortRequest(Record):
    """ABORT_REQUESTED, written into the run folder before a kill: every rank's abort thread exits on it."""

    reason: str
    time: float

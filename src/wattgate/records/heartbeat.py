"""A training rank's heartbeat (`heartbeat/rank-<r>.json`, rewritten atomically every step by
wattgate/heartbeats.py), as the watcher reads it. Format: docs/architecture.md, "results/train/<run_name>/".

The watcher checks each file field by field first (telemetry/watch_inputs.py beat_problem: a bad heartbeat is
that rank's missing one, never an error); what passes is read into a Beat. Keys a rank writes that the watcher
does not read (`loss`, `stopped`) are not part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from wattgate.records.base import Record, spec


@dataclass(frozen=True, kw_only=True, slots=True)
class Beat(Record):
    """Where a rank is: its step (steps done), phase and, in a step, its micro-batch of those planned."""

    rank: int = spec(minimum=0)
    step: int = spec(minimum=0)
    phase: str  # heartbeats.HEARTBEAT_PHASES
    time: float  # unix s, when it was written
    host: str | None = None
    local_rank: int | None = spec(minimum=0, default=None)
    gpu: str | None = None  # the GPU's UUID (None on CPU ranks)
    pid: int | None = spec(minimum=0, default=None)
    epoch: int | None = spec(minimum=0, default=None)
    micro: int | None = spec(minimum=0, default=None)  # the micro-batch started in this step
    micros: int | None = spec(minimum=0, default=None)  # micro-batches planned for this step
    total_steps: int | None = spec(minimum=0, default=None)
    epoch_ends: tuple[int, ...] | None = None  # the global step that ends each epoch
    compiling: bool | None = None

    def epoch_end(self) -> int | None:
        """The step at which this rank's current epoch ends (None: no plan)."""
        return next((e for e in self.epoch_ends or () if e >= self.step), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankError(Record):
    """`heartbeat/error-rank-<r>.json`: written by a rank's own CLI when it exits with an error: its one line, its
    exit status, and where its last heartbeat placed it. Fields in the order they are written."""

    rank: int = spec(minimum=0)
    host: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    error: str | None = None
    step: int | None = None
    epoch: int | None = None
    phase: str | None = None
    time: float


@dataclass(frozen=True, kw_only=True, slots=True)
class RankExit(Record):
    """`heartbeat/exit-rank-<r>.json`: a failed rank's wait status as its torchrun agent saw it (`exitcode` < 0 is
    the signal that killed it: the only record of a rank killed before it could write). Fields in written order."""

    rank: int = spec(minimum=0)
    local_rank: int | None = None
    host: str | None = None
    pid: int | None = None
    exitcode: int | None = None
    agent_pid: int | None = None
    time: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseEvent(Record):
    """A line of `heartbeat/rank-<r>.events.jsonl`: a rank's phase change (heartbeats.HEARTBEAT_EVENT_COLUMNS).
    Fields in the order they are written."""

    time: float
    rank: int = spec(minimum=0)
    step: int = 0
    epoch: int = 0
    phase: str

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
    gpu: int | None = None
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

"""What the loop does at each global step on one rank: the one pure function the loop and the collective proof
(wattgate.proof) share, so the proof enumerates exactly the steps the loop will take.

A step's class is (this rank's micro-batch count, what follows the step: wattgate.cadence's log, validation,
checkpoint, epoch end, last step, and the validation pass's micro-batch count when one runs). Steps of one
class issue the same collectives, as long as nothing the model does depends on the data (see
docs/architecture.md, "The collective proof").
"""

from __future__ import annotations

from dataclasses import dataclass

from wattgate.cadence import Cadence, StepActions, step_actions
from wattgate.records.plan import Plan
from wattgate.records.run_config import TrainConfig


@dataclass(frozen=True)
class StepClass:
    """What one rank does at one step, as far as its collectives are concerned."""

    micros: int
    log: bool
    evaluate: bool
    checkpoint: bool
    epoch_end: bool
    last: bool
    eval_micros: int  # the validation pass's micro-batches when `evaluate`, else 0

    @property
    def label(self) -> str:
        parts = [f"{self.micros} micro-batch{'es' if self.micros != 1 else ''}"]
        if self.log:
            parts.append("log")
        if self.evaluate:
            parts.append(f"validation ({self.eval_micros} micro-batches)")
        after = (("checkpoint", self.checkpoint), ("epoch end", self.epoch_end), ("last", self.last))
        parts += [name for name, on in after if on]
        return " + ".join(parts)

    def key(self) -> list:
        return [self.micros, self.log, self.evaluate, self.checkpoint, self.epoch_end, self.last, self.eval_micros]


def step_class(micros: int, act: StepActions, eval_micros: int) -> StepClass:
    return StepClass(
        micros, act.log, act.evaluate, act.checkpoint, act.epoch_end, act.last, eval_micros if act.evaluate else 0
    )


@dataclass(frozen=True)
class RankSchedule:
    """The steps one rank takes: global steps 0..total-1, the first `first_step` run by an earlier segment."""

    first_step: int
    total: int
    epoch_ends: tuple[int, ...]  # 1-based global steps
    cadence: Cadence

    def actions(self, g: int, start: int) -> StepActions:
        """What follows step g (0-based; the cadence counts 1-based) when this process started at step `start`."""
        return step_actions(g + 1, self.total, frozenset(self.epoch_ends), self.cadence, first=start + 1)


def epoch_end_steps(epochs: list[int]) -> list[int]:
    """The 1-based global step that ends each epoch, from each step's epoch."""
    total = len(epochs)
    return [g + 1 for g in range(total) if g + 1 == total or epochs[g + 1] != epochs[g]]


def rank_schedule(plan: Plan, step_epochs: list[int], train: TrainConfig, validation: bool) -> RankSchedule:
    """The schedule from plan.json, the epoch of each of this rank's planned steps (packs.parquet's current
    segment, in order) and the config's `train` section (max_steps and the cadence keys)."""
    # a plan that continues another world size's run (pack/segments.py) starts at its first global step
    first = plan.first_step
    total = first + len(step_epochs)
    if train.max_steps:  # a measurement run (scaling, dataio): the plan's first steps only
        total = min(total, train.max_steps)
    if plan.epoch_ends:
        ends = [e for e in plan.epoch_ends if e <= total]
    else:
        ends = epoch_end_steps(([-1] * first + list(step_epochs))[:total])
    cadence = Cadence.from_train(train, validation)
    return RankSchedule(first, total, tuple(ends), cadence)


def rank_step_classes(sched: RankSchedule, step_micros: list[int], eval_micros: int, start: int = 0) -> list:
    """Every step's class from `start` on (`step_micros`: the micro-batch count of each planned step)."""
    first = sched.first_step
    return [
        step_class(step_micros[g - first], sched.actions(g, start), eval_micros)
        for g in range(max(start, first), sched.total)
    ]

"""What the trainer does at each optimizer step besides the step itself: the one function both the loop and
everything that predicts the loop (the forecast, the gate's schedule check, the collective proof) call.

A step's actions depend only on the plan and the settings, never on data or timing, and are the same on
every rank: that is what keeps every rank's collectives in the same order. Steps are 1-based global steps
(the step just completed), as in metrics.parquet and the checkpoint folders.
"""

from __future__ import annotations

from dataclasses import dataclass
from wattgate.records.run_config import TrainConfig


@dataclass(frozen=True)
class Cadence:
    """The settings that decide a step's actions (train.*; `validation`: the plan has a validation pass)."""

    checkpoint_every: int
    checkpoint_at_epoch_end: bool = True
    eval_every: int = 0  # 0: validation only at epoch ends and after the last step
    validation: bool = False
    log_every: int = 10

    @classmethod
    def from_train(cls, train: TrainConfig, validation: bool) -> Cadence:
        return cls(
            checkpoint_every=train.checkpoint_every,
            checkpoint_at_epoch_end=train.checkpoint_at_epoch_end,
            eval_every=train.eval_every,
            validation=validation,
            log_every=train.log_every,
        )


@dataclass(frozen=True)
class StepActions:
    """What follows optimizer step `step` (1-based), in this order: log, validation pass, checkpoint."""

    step: int
    epoch_end: bool
    last: bool
    log: bool
    evaluate: bool
    checkpoint: bool

    @property
    def kind(self) -> tuple[bool, bool, bool, bool, bool]:
        """The step's class: steps of one class issue the same collectives (the proof runs one of each)."""
        return (self.log, self.evaluate, self.checkpoint, self.epoch_end, self.last)


def step_actions(step: int, total: int, ends: frozenset[int], c: Cadence, first: int = 1) -> StepActions:
    """The actions after global step `step` of `total`; `ends` the epochs' last steps, `first` the first step
    this process runs (always logged)."""
    last = step == total
    epoch_end = step in ends or last
    return StepActions(
        step=step,
        epoch_end=epoch_end,
        last=last,
        log=step % c.log_every == 0 or step == first or last,
        evaluate=c.validation and (epoch_end or (c.eval_every > 0 and step % c.eval_every == 0)),
        checkpoint=step % c.checkpoint_every == 0 or last or (c.checkpoint_at_epoch_end and epoch_end),
    )


def checkpoint_steps(total: int, every: int, epoch_ends: list[int], at_epoch_end: bool) -> list[int]:
    """The 1-based optimizer steps after which the trainer writes a checkpoint."""
    c = Cadence(checkpoint_every=every, checkpoint_at_epoch_end=at_epoch_end)
    ends = frozenset(epoch_ends)
    return [g for g in range(1, total + 1) if step_actions(g, total, ends, c).checkpoint]


def eval_steps(total: int, epoch_ends: list[int], c: Cadence) -> list[int]:
    """The 1-based optimizer steps after which the trainer runs a validation pass."""
    ends = frozenset(epoch_ends)
    return [g for g in range(1, total + 1) if step_actions(g, total, ends, c).evaluate]

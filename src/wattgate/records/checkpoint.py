"""A checkpoint's `state.json` (checkpoints/step-<n>/, written by rank 0 when it publishes the checkpoint): the
data position, every file's size and content hash, the plan and the run identity. Format: docs/architecture.md,
"results/train/<run_name>/" (`checkpoints/step-<n>/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wattgate.records.base import Record, spec


@dataclass(frozen=True, kw_only=True, slots=True)
class FileEntry(Record):
    """One file of the checkpoint: its size and content hash (`hash_algorithm`; a dry run's has none)."""

    bytes: int = spec(minimum=0)
    hash: str | None = spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Position(Record):
    """Where the data stands at the checkpoint (train writes epoch, step and plan; the rest when they apply)."""

    epoch: int | None = spec(minimum=0, omit_none=True, default=None)
    step: int | None = spec(minimum=0, omit_none=True, default=None)  # optimizer steps done
    plan: str | None = spec(omit_none=True, default=None)  # the plan's packs_sha256
    eval_loss: float | None = spec(omit_none=True, default=None)  # a validation pass ran at this step
    eval_pending: bool | None = spec(omit_none=True, default=None)  # a stop inside its validation pass: redo it


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelIdentity(Record):
    """The model a run trains: its config's hash, and its weight files' fingerprint ("init": random init)."""

    config: str | None = None
    weights: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanLink(Record):
    """An earlier plan the current plan continues: its packs and the step its segment ends at."""

    packs_sha256: str
    end_step: int = spec(minimum=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunIdentity(Record):
    """What a checkpoint must share with the run that resumes from it (wattgate/identity.py): the plan, the plans
    it continues, the pretokenized data, the model and the result-changing train settings. Pack compares only
    `model` and `train` before it continues a run on another world size; a part an older checkpoint lacks is
    None."""

    plan: str | None = None
    links: tuple[PlanLink, ...] = ()
    pretokenized: str | None = None
    model: ModelIdentity | None = None
    train: dict[str, Any] | None = None  # identity.RESULT_SETTINGS, as the config holds them


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointState(Record):
    """state.json. `files` maps each name to its FileEntry, hashed under `hash_algorithm`."""

    step: int = spec(minimum=0)
    position: Position = spec(default_factory=Position)
    files: dict[str, FileEntry]
    hash_algorithm: str
    world_size: int | None = spec(minimum=1, default=None)
    identity: RunIdentity | None = None

    def size_of(self, name: str) -> int:
        return self.files[name].bytes

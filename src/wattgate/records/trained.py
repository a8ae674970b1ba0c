"""TRAINED, the train stage's record (rank 0, written last): losses, throughput, memory peaks per phase,
validation, what was trained. Format: docs/architecture.md, "results/train/<run_name>/".

Every key is optional on read: the report is read after the fact, often of a run that went wrong, and draws what
a damaged or hand-made TRAINED (tests build partial ones) holds, saying "n/a" for the rest. A loss that diverged
is NaN, written as null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wattgate.records.base import Record, spec

LOAD, STEADY, EXPORT = "load", "steady", "export"  # TRAINED's memory phases
MEMORY_PHASES = (LOAD, STEADY, EXPORT)  # in the order they run


@dataclass(frozen=True, kw_only=True, slots=True)
class PhasePeak(Record):
    """One phase's memory peaks on one rank (or the maximum over ranks), each peak reset at the phase start."""

    host_peak_gib: float | None = spec(minimum=0, default=None)
    host_at_start_gib: float | None = spec(minimum=0, default=None)
    seconds: float | None = spec(minimum=0, default=None)
    cuda_peak_gib: float | None = spec(minimum=0, omit_none=True, default=None)  # CUDA ranks only
    cuda_reserved_peak_gib: float | None = spec(minimum=0, omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory(Record):
    """A rank's peaks per phase (`load`, `steady`, `export`)."""

    rank: int | None = spec(minimum=0, default=None)
    host: str | None = None
    phases: dict[str, PhasePeak] = spec(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory(Record):
    """TRAINED's `memory`: every rank's peaks, and the maximum over ranks of each phase."""

    per_rank: tuple[RankMemory, ...] = ()
    max_over_ranks: dict[str, PhasePeak] = spec(default_factory=dict)

    @classmethod
    def of_ranks(cls, per_rank: list[dict]) -> Memory:
        """From each rank's gathered `{rank, host, phases}` (train/metrics.py PhaseMemory.gather)."""
        ranks = tuple(RankMemory.from_json(r, "the gathered memory peaks") for r in per_rank)
        phases = sorted({p for r in ranks for p in r.phases}, key=MEMORY_PHASES.index)
        worst = {}
        for p in phases:
            rows = [r.phases[p].to_json() for r in ranks if p in r.phases]
            worst[p] = PhasePeak(**{k: max(row[k] for row in rows) for k in rows[0]})
        return cls(per_rank=ranks, max_over_ranks=worst)


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceValidation(Record):
    """`validation.per_source` entry: a held-out source's loss at the final pass and at its own best pass."""

    name: str
    final_loss: float | None = None
    tokens: int | None = spec(minimum=0, default=None)
    best_loss: float | None = None
    best_step: int | None = spec(minimum=0, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Validation(Record):
    """TRAINED's `validation` (null without a split): the final and the best pass, and which step final/ holds."""

    final_loss: float | None = None
    final_step: int | None = spec(minimum=0, default=None)
    best_loss: float | None = None
    best_step: int | None = spec(minimum=0, default=None)
    evaluations: int | None = spec(minimum=0, default=None)
    export_from: str | None = None
    exported_step: int | None = spec(minimum=0, default=None)
    per_source: tuple[SourceValidation, ...] | None = spec(omit_none=True, default=None)  # two or more sources


@dataclass(frozen=True, kw_only=True, slots=True)
class Trained(Record):
    """The TRAINED file."""

    first_loss: float | None = None
    final_loss: float | None = None
    steps: int | None = spec(minimum=0, default=None)
    resumed_from_step: int | None = spec(minimum=0, default=None)
    world_size: int | None = spec(minimum=1, default=None)
    # the device mesh's named dimensions and sizes (train/mesh.py mesh_layout); left out on the 1-D mesh
    mesh: dict[str, int] | None = spec(omit_none=True, default=None)
    device: str | None = None
    params: int | None = spec(minimum=0, default=None)
    tokens_per_s: float | None = spec(minimum=0, default=None)
    data_cache: str | None = None
    data_copy_s: float | None = spec(minimum=0, default=None)
    wall_s: float | None = spec(minimum=0, default=None)  # the step loop
    load_s: float | None = spec(minimum=0, default=None)
    export_s: float | None = spec(minimum=0, default=None)
    export_dtype: str | None = None
    memory: Memory | None = None
    startup_s: float | None = spec(minimum=0, default=None)
    allocator: dict[str, str] | None = None  # `source` and the MALLOC_* environment (train/launch.py)
    checkpoints: int | None = spec(minimum=0, default=None)
    checkpoint_s: float | None = spec(minimum=0, default=None)
    validation: Validation | None = None
    job_s: float | None = spec(minimum=0, default=None)  # rank 0's whole process: what the forecast predicts
    config_sha256: str | None = None
    settings: dict[str, Any] | None = None  # identity.RESULT_SETTINGS: the train keys that change the result
    nonfinite_skipped_steps: int | None = spec(minimum=0, default=None)
    mfu: float | None = spec(minimum=0, omit_none=True, default=None)  # CUDA only (null: the GPU's peak unknown)
    peak_memory_gib: float | None = spec(minimum=0, omit_none=True, default=None)  # CUDA only

    def to_json(self) -> dict:
        out = Record.to_json(self)
        if self.device == "cuda":  # on CUDA both keys are written, mfu null when the GPU's peak is unknown
            out.setdefault("mfu", None)
            out.setdefault("peak_memory_gib", None)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadCheck(Record):
    """load-check.json (`wattgate loadcheck`): the model loaded (and with --export written) on this world size,
    with the memory peaks of those phases."""

    world_size: int = spec(minimum=1)
    device: str
    params: int = spec(minimum=0)
    source: str  # where the weights came from
    load_s: float = spec(minimum=0)
    export_dtype: str | None = None  # null without --export
    memory: Memory

"""plan.json, the pack stage's commit record (docs/architecture.md "results/plan/<run>/").

`Plan.read(path, rerun="pack")` (run_files.read_plan) checks every key a reader uses, its type and range, with
one line naming the file and the key; the pack writers (pack/plan.py, pack/segments.py) build a `Plan` and write
its `to_json()`. Keys a writer leaves out (a plain plan has no `segments`, `mixture` ...) are None here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from wattgate.records.base import Record, spec

PLAN_FORMAT_VERSION = 1
# the settings a continued plan must share with the plan it continues (anything else starts over)
SAME_FOR_RESUME = (
    "seq_len",
    "micro_batch_size",
    "epochs",
    "remainder",
    "seed",
    "attn_weight",
    "pretokenized_manifest_sha256",
    "max_documents_per_row",
)


def resume_settings(settings) -> tuple:
    """The SAME_FOR_RESUME values of a plan or of the settings a new plan is made with, in order."""
    return tuple(getattr(settings, name) for name in SAME_FOR_RESUME)


def _count(minimum: int = 0, **kw):
    return spec(minimum=minimum, omit_none=True, default=None, **kw)


@dataclass(frozen=True, kw_only=True, slots=True)
class DroppedDocs(Record):
    """stats.dropped[reason]: the documents (and their tokens) the plan left out for that reason."""

    docs: int | None = _count()
    tokens: int | None = _count()


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanStats(Record):
    """plan.json's `stats`, of the training side (a continued plan: segment_packs and segment_tokens)."""

    num_docs: int | None = _count()
    num_tokens: int | None = _count()
    packs_per_epoch: int | None = _count()
    efficiency: float | None = spec(omit_none=True, default=None)
    efficiency_bound: float | None = spec(omit_none=True, default=None)  # the best any plan of these tokens can do
    per_rank_tokens: tuple[int, ...] | None = spec(omit_none=True, default=None)
    per_rank_packs: tuple[int, ...] | None = spec(omit_none=True, default=None)
    per_rank_micro_batches_per_epoch: tuple[tuple[int, ...], ...] | None = spec(omit_none=True, default=None)
    per_rank_steps_per_epoch: tuple[tuple[int, ...], ...] | None = spec(omit_none=True, default=None)
    max_rank_cost_ratio_step: float | None = spec(omit_none=True, default=None)
    mean_rank_cost_ratio_step: float | None = spec(omit_none=True, default=None)
    max_rank_cost_ratio_micro: float | None = spec(omit_none=True, default=None)
    mean_rank_cost_ratio_micro: float | None = spec(omit_none=True, default=None)
    segment_packs: int | None = _count()
    segment_tokens: int | None = _count()
    dropped: dict[str, DroppedDocs] = spec(default_factory=dict)
    dropped_doc_ids: tuple[int, ...] = spec(default=())


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationPass(Record):
    """plan.json's `validation`: the validation pass (eval_packs.parquet) beside the training statistics."""

    packs: str
    packs_sha256: str | None
    num_docs: int | None = _count()
    num_tokens: int | None = _count()
    num_packs: int | None = _count()
    empty_packs: int | None = _count()
    strategy: str | None = spec(omit_none=True, default=None)
    micro_batch_size: int | None = _count(1)
    micro_batches_per_rank: int | None = _count()
    per_rank_tokens: tuple[int, ...] | None = spec(omit_none=True, default=None)
    efficiency: float | None = spec(omit_none=True, default=None)
    max_rank_cost_ratio_micro: float | None = spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class MixtureEpoch(Record):
    """One epoch of one mixture source: the documents chosen (repeats included) and their hash."""

    docs: int = spec(minimum=0)
    distinct_docs: int = spec(minimum=0)
    tokens: int = spec(minimum=0)
    loss_tokens: int = spec(minimum=0)
    doc_ids_sha256: str


@dataclass(frozen=True, kw_only=True, slots=True)
class MixtureSource(Record):
    """plan.json's mixture.sources[i]: a source's setting (one of weight, epochs, max_tokens) and its epochs."""

    name: str
    path: str
    weight: float | None = spec(omit_none=True, default=None)
    epochs: float | None = spec(omit_none=True, default=None)
    max_tokens: float | None = spec(omit_none=True, default=None)
    train_docs: int = spec(minimum=0)
    train_tokens: int = spec(minimum=0)
    target_tokens_per_epoch: float
    repeats: float
    per_epoch: tuple[MixtureEpoch, ...]

    @property
    def setting(self) -> tuple[str, float]:
        """(kind, value) of the source's setting: weight, epochs or max_tokens."""
        if self.weight is not None:
            return "weight", self.weight
        if self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return "epochs", 1 if self.epochs is None else self.epochs


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanMixture(Record):
    """plan.json's `mixture` (only with a mixture in data.inputs)."""

    seed: int
    max_repeats: float
    sources: tuple[MixtureSource, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment(Record):
    """One segment of a continued plan: a world size's steps [first_step, end_step) and their packs file."""

    world_size: int = spec(minimum=1)
    grad_accum: int = spec(minimum=1)
    micro_batch_size: int = spec(minimum=1)
    first_step: int = spec(minimum=0)
    end_step: int = spec(minimum=0)
    packs: str
    packs_sha256: str | None = spec(omit_none=True, default=None)  # the consumed prefix's: proven by hash
    plan_total_steps: int | None = _count()  # what a consumed segment's LR schedule ran towards


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumedFrom(Record):
    """A continued plan's resume point: the checkpoint, its global step and epoch, and what changed."""

    step: int = spec(minimum=0)
    checkpoint: str | None = spec(omit_none=True, default=None)
    epoch: int | None = _count()
    change: str | None = spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan(Record):
    """plan.json (format_version 1)."""

    FORMAT_VERSION: ClassVar[int] = PLAN_FORMAT_VERSION

    world_size: int = spec(minimum=1)
    seq_len: int = spec(minimum=1)
    micro_batch_size: int = spec(minimum=1)
    grad_accum: int = spec(minimum=1)
    epochs: int = spec(minimum=1)
    steps_per_epoch: int = spec(minimum=0)
    seed: int
    attn_weight: float = spec(minimum=0)
    remainder: str
    strategy: str | None = None
    packs_sha256: str | None = None  # of packs.parquet, set on publish
    pretokenized_manifest_sha256: str | None = None
    eval_micro_batch_size: int | None = spec(minimum=1, default=None)
    stats: PlanStats = spec(default_factory=PlanStats)
    validation: ValidationPass | None = None
    mixture: PlanMixture | None = spec(omit_none=True, default=None)
    # 1: every row holds one document (pack.documents_per_row one, or auto on a model with a recurrent state; the
    # gate's document_isolation reads it); left out when rows hold as many as fit
    max_documents_per_row: int | None = spec(minimum=1, omit_none=True, default=None)
    # a continued plan (pack/segments.py)
    config_grad_accum: int | None = _count(1)
    segments: tuple[Segment, ...] | None = spec(omit_none=True, default=None)
    segment_steps: dict[str, int] | None = spec(minimum=0, omit_none=True, default=None)
    epoch_ends: tuple[int, ...] | None = spec(minimum=0, omit_none=True, default=None)
    resumed_from: ResumedFrom | None = spec(omit_none=True, default=None)

    def __post_init__(self):
        if not self.segments:
            return
        for k, seg in enumerate(self.segments[:-1]):
            if seg.packs_sha256 is None:  # the consumed prefix: its archive is proven by hash
                raise ValueError(f"missing key 'segments[{k}].packs_sha256'")
        if self.segment_steps is None:
            raise ValueError("missing key 'segment_steps'")
        for epoch in self.segment_steps:
            if not epoch.isdecimal():
                raise ValueError(f"'segment_steps.{epoch}' is not keyed by an epoch number")
        if self.resumed_from is None:
            raise ValueError("missing key 'resumed_from'")

    @property
    def first_step(self) -> int:
        """The global step the current segment (packs.parquet) starts at: 0 for a plan that was not continued."""
        return self.segments[-1].first_step if self.segments else 0

    def resume_settings(self) -> tuple:
        """The settings a continued plan must share with this one (SAME_FOR_RESUME, in order)."""
        return resume_settings(self)

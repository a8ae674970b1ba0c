"""The report's summary.json (results/report/<run_name>/, docs/architecture.md): one record per card.

`wattgate report` builds a `Summary` (report/summary.py and each card's `<card>_record`, report/cards.py,
report/stragglers.py, report/steps.py) and writes `Summary.to_json()`; the page (report/html.py) draws from
its attributes. Every float is rounded where it is computed, so the same inputs give byte-identical files.
Parts copied from another stage's record (a pause, triage's telemetry gaps, the watcher's verdict) are that
record's own classes; a straggler entry (StragglerEntry) keeps the keys of the record it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from wattgate.records.base import Record, spec
from wattgate.records.triage import Gaps, PauseRecord
from wattgate.records.base import ABSENT
from wattgate.records.watcher import HangCost

# ---------------------------------------------------------------- the run and its throughput


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts(Record):
    """summary.json `run`: what ran, where its inputs lie, when it started, on which device."""

    name: str
    dir: str | None
    traces: tuple[str, ...]
    start: float | None
    start_utc: str | None
    device: str | None
    gpu_names: tuple[str, ...]
    nvml: str | None
    gpu_model: str | None
    nodes: int | None
    gpus_per_node: int | None
    params: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput(Record):
    """Tokens, steps and wall time (TRAINED, else metrics.parquet): summary.json's top-level throughput keys."""

    tokens: int | None
    steps: int | None
    wall_s: float | None
    wall_source: str | None
    world_size: int | None
    tokens_per_s: float | None
    tokens_per_s_per_gpu: float | None
    tokens_per_s_per_rank: float | None
    rank_hours: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuEnergyRow(Record):
    host: str
    gpu: int
    kwh: float | None
    method: str
    span_s: float | None
    gap_s: float | None
    mean_power_w: float | None  # over sampled time: a gap counts no energy


@dataclass(frozen=True, kw_only=True, slots=True)
class Energy(Record):
    """summary.json `energy`: the GPUs' energy, how it was measured, per GPU, and per token."""

    kwh: float | None
    method: str | None
    per_gpu: tuple[GpuEnergyRow, ...]
    integrated_kwh: float | None
    counter_kwh: float | None
    gap_s: float | None  # unsampled seconds between the GPUs' samples: counted nowhere
    j_per_token: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Loss(Record):
    first: float | None
    final: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationPass(Record):
    step: int
    epoch: int
    loss: float | None
    perplexity: float | None
    tokens: int
    seconds: float | None
    per_source: dict[str, float | None] | None = spec(omit_none=True, default=None)  # source -> loss


@dataclass(frozen=True, kw_only=True, slots=True)
class Validation(Record):
    """summary.json `validation` (eval.parquet): every pass, the final and the best."""

    passes: tuple[ValidationPass, ...]
    final: ValidationPass
    best: ValidationPass | None
    seconds: float | None
    sources: tuple[str, ...] | None = spec(omit_none=True, default=None)  # two or more held-out sources


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment(Record):
    """A run of steps on one world size (a resized run has several)."""

    first_step: int
    last_step: int
    world_size: int
    steps: int
    tokens: int | None
    start: float | None


# ---------------------------------------------------------------- phases


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseShare(Record):
    seconds: float | None
    time_share: float | None
    energy_kwh: float | None
    energy_share: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class HostPhases(Record):
    """Time share, energy and energy share per phase (phases with any time) of some GPUs of one host."""

    host: str
    seconds: float | None
    time_share: dict[str, float | None]
    energy_kwh: dict[str, float | None]
    energy_share: dict[str, float | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuPhases(HostPhases):
    """One GPU's."""

    gpu: int


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePhases(HostPhases):
    """One node's, over its `gpus` GPUs."""

    gpus: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Phases(Record):
    """summary.json `phases`: where the phases came from and the shares over all GPUs, per GPU and per node."""

    source: str | None
    table: str | None
    window_s: float
    gaps: Gaps | None = spec(omit_none=True, default=None)  # triage's telemetry gaps (triage.json `gaps`)
    seconds: float | None
    by_phase: dict[str, PhaseShare]
    per_gpu: tuple[GpuPhases, ...]
    per_node: tuple[NodePhases, ...]


# ---------------------------------------------------------------- the cards


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerEntry(Record):
    """A straggler as the summary copies it: triage.json's (records.triage Straggler, WatcherStraggler) or
    watcher.json's (records.watcher Straggler), each key its record writes and no other (a key that record has
    not is ABSENT here: a GPU triage named has no `wait_rank_hours`, only the watcher's have `signal`)."""

    host: str | None
    gpu: int | None  # None: a rank named from its CPU time (no GPU telemetry)
    rank: int | None
    cause: str | None
    evidence: str | None
    lag_share: float | None
    lag_windows: int | None
    wait_windows: int | None
    wait_gpu_hours: float | None
    wait_kwh: float | None
    first: float | None
    last: float | None
    wait_rank_hours: float | None = ABSENT
    scope: str | None = ABSENT  # triage's
    source: str | None = ABSENT  # triage's: "power" or "watcher"
    signal: str | None = ABSENT  # the watcher's: "power" or "cpu"
    detected_at: float | None = ABSENT
    step: int | None = ABSENT
    window_s: float | None = ABSENT

    @classmethod
    def of(cls, straggler: Record) -> StragglerEntry:
        """The entry of a straggler record of triage.json or watcher.json: the keys it writes."""
        return cls.from_json(straggler.to_json(), type(straggler).__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Stragglers(Record):
    """summary.json `stragglers` (report/stragglers.py): triage's entries, else the watcher's CPU ones."""

    checked: bool
    source: str | None
    share: float | None
    wait_windows: int | None
    entries: tuple[StragglerEntry, ...]
    wait_gpu_hours: float
    wait_kwh: float
    wait_rank_hours: float
    share_of_gpu_hours: float | None
    share_of_energy: float | None
    live: tuple[StragglerEntry, ...]  # the watcher's, warned during the run


@dataclass(frozen=True, kw_only=True, slots=True)
class Anomaly(Record):
    """One anomaly episode (report/anomalies.py): its kind, span, GPUs, ranks and evidence."""

    kind: str
    start: float
    end: float
    duration_s: float
    gpus: tuple[str, ...]
    ranks: tuple[int, ...]
    detail: str
    start_offset_s: float | None = None
    start_utc: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class GateCheck(Record):
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class GateCard(Record):
    """summary.json `gate`: gate.json's verdict (None: damaged), whether it was enforced, its checks."""

    passed: bool | None
    enforce: bool | None
    failed_checks: tuple[str, ...]
    checks: tuple[GateCheck, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ForecastFigures(Record):
    """The gate's forecast of the train job (gate.json `forecast`)."""

    wall_s: float
    gpu_hours: float | None
    kwh: float | None
    source: str
    detail: str
    terms_s: dict[str, float]  # the forecast's terms in seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class ActualFigures(Record):
    """What the run measured (TRAINED job_s and world size, the GPUs' energy)."""

    wall_s: float
    gpu_hours: float | None
    kwh: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ForecastError(Record):
    """actual / forecast - 1 per figure (None where either is missing)."""

    wall_s: float | None
    gpu_hours: float | None
    kwh: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ForecastCard(Record):
    """summary.json `forecast`: the gate's forecast beside the run's actual figures, and the gate's failure line."""

    forecast: ForecastFigures | None
    actual: ActualFigures | None
    error: ForecastError | None
    failure: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPhase(Record):
    phase: str
    seconds: float | None
    measured_host_peak_gib: float | None
    measured_device_peak_gib: float | None
    estimated_device_gib: float | None
    usable_device_gib: float | None
    largest_term: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCard(Record):
    """summary.json `memory`: measured peaks per phase beside the gate's estimates, host RAM per node."""

    phases: tuple[MemoryPhase, ...]
    measured_host_per_node_gib: dict[str, float | None]
    estimated_host_per_node_gib: float | None
    host_budget_gib: float | None
    load_s: float | None
    export_s: float | None
    export_dtype: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class WatcherCard(Record):
    """summary.json `watcher`: watcher.json's verdict fields, each as watcher.json holds it (a key it left out
    is left out here too; `table` is null there without a triage table, and so here)."""

    verdict: str
    cost: HangCost | None = spec(omit_none=True, default=None)
    reason: str | None = spec(omit_none=True, default=None)
    action: str | None = spec(omit_none=True, default=None)
    stalled_for_s: float | None = spec(omit_none=True, default=None)
    longest_stall_s: float | None = spec(omit_none=True, default=None)
    limit_s: float | None = spec(omit_none=True, default=None)
    limit_phase: str | None = spec(omit_none=True, default=None)
    stuck_ranks: tuple[int, ...] | None = spec(omit_none=True, default=None)
    ran_ahead: tuple[int, ...] | None = spec(omit_none=True, default=None)
    behind: tuple[int, ...] | None = spec(omit_none=True, default=None)
    power_signal: str | None = spec(omit_none=True, default=None)
    detected_at: float | None = spec(omit_none=True, default=None)
    started: float | None = spec(omit_none=True, default=None)
    ended: float | None = spec(omit_none=True, default=None)
    table: str | None = ABSENT  # as records.watcher.WatcherRecord.table: ABSENT when watcher.json has no key


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoints(Record):
    steps: tuple[int, ...]
    final: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Signals(Record):
    """Which inputs the report had (the Inputs card; power-only mode names what is missing)."""

    traces: bool
    power: bool
    util: bool
    energy_counter: bool
    phases: bool
    metrics: bool
    heartbeats: bool
    trained: bool
    watcher: bool
    gate: bool
    checkpoints: bool
    config: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportedTrace(Record):
    """A trace imported from another tool's log (its meta): where from, what was skipped."""

    file: str
    source: str | None
    notes: tuple[str, ...]
    skipped_lines: dict[str, int]
    gpu_index_inferred: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class PowerOnlyCard(Record):
    """summary.json `power_only`: the verdict without heartbeats, what was missing, what it could not tell."""

    mode: str
    missing: tuple[str, ...]
    cannot_tell: tuple[str, ...]
    wait_rule: str
    verdict: tuple[str, ...]
    deadlock_after_s: float
    imported: tuple[ImportedTrace, ...]


# ---------------------------------------------------------------- the summary


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary(Throughput):
    """summary.json: the report's numbers, one field per card (Throughput's figures at the top level)."""

    FORMAT_VERSION: ClassVar[int] = 1

    run: RunFacts
    gpus: int
    gpu_hours: float | None
    energy: Energy
    loss: Loss
    validation: Validation | None
    mfu: float | None
    peak_memory_gib: float | None
    phases: Phases
    stragglers: Stragglers
    anomalies: tuple[Anomaly, ...]
    anomalies_omitted: int
    gate: GateCard | None
    forecast: ForecastCard | None
    segments: tuple[Segment, ...]
    memory: MemoryCard | None
    watcher: WatcherCard | None
    checkpoints: Checkpoints
    signals: Signals
    pauses: tuple[PauseRecord, ...]  # power/triage/power_only.py Pause.record
    power_only: PowerOnlyCard | None
    notes: tuple[str, ...]

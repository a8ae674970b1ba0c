"""gate.json, the invariant gate's record (docs/architecture.md, `results/gate/<run>/`), as a tree of typed records.

`GateReport` is the whole file: the verdict and its checks, the memory estimate per phase, the cost section
(`Forecast`, `Failure`, `LastRunWait`), the collective proof (`Collectives`, also the run folder's
collectives.json and the kept proof in proof-cache.json) and the hashes of what the gate checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wattgate.records.base import Record, spec
from wattgate.records.plan import PlanMixture

GATE_RERUN = "gate"  # the stage that writes gate.json
# memory_estimate_phases' keys: device memory per rank at load, in steady state and at export; host RAM per node
PHASE_LOAD, PHASE_STEADY, PHASE_EXPORT, PHASE_HOST = "load", "steady", "export", "host_per_node"


@dataclass(frozen=True, kw_only=True, slots=True)
class GateCheck(Record):
    """One check's verdict: its stable name, pass or fail, and one line on why."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPhase(Record):
    """One phase's memory estimate: its terms and total, the budget it is checked against, and whether it fits
    (`fits` None: no budget to check)."""

    per: str
    terms_bytes: dict[str, int]
    total_bytes: int
    budget_bytes: int | None
    usable_bytes: int | None
    budget_source: str
    headroom: float
    fits: bool | None
    note: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ForecastTerms(Record):
    """The forecast's wall time term by term, in seconds."""

    startup_s: float
    load_s: float
    warmup_s: float
    steps_s: float
    validation_s: float
    checkpoints_s: float
    export_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ForecastThroughput(Record):
    """The throughput the forecast used: its source, the planner cost units per second per rank, and the
    start-up, warm-up, load and storage figures measured with it (None: not measured)."""

    source: str
    cost_per_s: float
    detail: str
    startup_s: float | None = None
    warmup_s: float | None = None
    load_s: float | None = None
    storage_gbps: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ForecastEnergy(Record):
    """Per-GPU power levels of the energy forecast (W), from the triage table."""

    compute_w: float
    wait_w: float
    idle_w: float
    source: str
    gpus_only: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class JobPlan(Record):
    """The Slurm jobs the run takes (forecast/walltime.py `job_plan`): `jobs` None when none fits,
    `job_limit_s` None when the launcher is not Slurm."""

    job_limit_s: float | None
    stop_margin_s: float
    max_jobs: int
    stop_work_s: float
    stop_cost_s: float
    jobs: int | None
    usable_s: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Forecast(Record):
    """The train job's forecast: wall time, GPU-hours and kWh (None without a triage table), term by term."""

    wall_s: float
    gpu_hours: float
    kwh: float | None
    terms_s: ForecastTerms
    steps: int
    validations: int
    checkpoints: int
    throughput: ForecastThroughput
    storage_gbps: float
    storage_source: str
    startup_source: str
    load_source: str
    checkpoint_gib: float
    export_gib: float
    world_size: int
    energy: ForecastEnergy | None
    jobs: JobPlan | None = spec(omit_none=True, default=None)  # set once the job plan is made


@dataclass(frozen=True, kw_only=True, slots=True)
class Divergence(Record):
    """Where the ranks' (epoch, step, micro) sequences first part, 0-based; an uneven validation pass adds its
    `phase` ("eval"), the 1-based `step` it follows, that step's `step_in_epoch` and the `per_rank` counts."""

    epoch: int
    step: int
    micro: int
    steps_in_epoch: int
    ranks_with: tuple[int, ...]
    ranks_without: tuple[int, ...]
    per_rank: tuple[int, ...] | None = spec(omit_none=True, default=None)
    step_in_epoch: int | None = spec(omit_none=True, default=None)
    phase: str | None = spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureCost(Record):
    """What reaching a divergence costs, then the wait: the collective timeout, or the job's time limit."""

    reach_s: float
    reach_gpu_hours: float
    gpus: int
    timeout_s: float
    timeout_gpu_hours: float
    job_limit_s: float | None
    limit_gpu_hours: float | None
    line: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure(Record):
    """The failure the gate prevented: where the run would hang (None: equal_steps failed otherwise), what that
    would have cost (None without a forecast), and one line for people."""

    divergence: Divergence | None
    cost: FailureCost | None
    line: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LastRunWait(Record):
    """How much of the ledger's last run of this shape went to waiting for stragglers (ledger.record_wait)."""

    run_name: str | None
    wait_hours: float | None
    wait_share: float | None
    unit: str
    source: str | None
    line: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamCensus(Record):
    """The real model's parameters counted on the meta device (train/model.py `param_census`): what FSDP2 shards
    and gathers, whatever the architecture (a formula over config keys misses what it does not know: DeepSeek-V3's
    256 routed experts, shared experts, latent attention)."""

    total: int  # every parameter, a tied one once
    largest_layer: int  # the decoder layer (one FSDP2 unit) with the most
    root: int  # outside the decoder layers: embeddings, head, final norm (the root unit)
    shapes: tuple[tuple[int, ...], ...]  # the distinct parameter shapes, as the model holds them


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGroup(Record):
    """Ranks that issue the same collectives by construction (proof/ranks.py): the one dry-run, how many ranks the
    group holds, and its highest rank."""

    rank: int
    ranks: int
    last: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Depth(Record):
    """The real model's depth and layer pattern (proof/depth.py `layer_pattern`)."""

    layers: int
    period: int
    pattern: tuple[str, ...]
    identical: bool
    moe: str | None
    model: str
    why: str
    # the layers before the pattern starts (DeepSeek-V3's dense first layers); 0 when the pattern starts at once
    head: int = spec(minimum=0, default=0)
    # the layers with a recurrent state (train/model.py recurrent_layers); left out when there is none
    recurrent: tuple[str, ...] | None = spec(omit_none=True, default=None)
    # the parameters of the real-depth model (the gate sizes memory and checkpoints from them)
    params: ParamCensus | None = spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProofBeat(Record):
    """A heartbeat a dry-run step wrote: its phase and micro-batch, and the index of the next collective."""

    index: int
    phase: str
    micro: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ProofClass(Record):
    """One step class of rank 0: its label, how many steps are of it, its first, and its collectives."""

    label: str = spec(key="class")
    key: Any
    steps: int
    first_step: int
    fingerprint: str
    collectives: int
    sequence: tuple[str, ...]
    beats: tuple[ProofBeat, ...]
    collectives_at_depth: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint(Record):
    """A phase's collectives: their count and the sha256 fingerprint of the sequence."""

    fingerprint: str
    collectives: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFingerprint(Record):
    """The graceful stop's or the resume's collectives, and the 1-based step it was dry-run at (None: none)."""

    step: int | None
    fingerprint: str
    collectives: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveDivergence(Record):
    """The first collective some rank issues differently from rank 0."""

    rank: int
    phase: str
    step: int | None
    index: int
    rank0: str
    this_rank: str
    # on a 2-D mesh: this rank's own group of the dimension the collective is on ("dp_replicate (ranks 1, 3)")
    group: str | None = spec(default=None, omit_none=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassDivergence(Record):
    """The first step where a rank's step class differs from rank 0's."""

    rank: int
    step: int
    label: str = spec(key="class")
    rank0_class: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertsKernel(Record):
    """The experts' kernel in training and in the dry run (None: not known)."""

    training: str | None = None
    dry_run: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StarvedDivergence(Record):
    """Where rank 0's dry run with no token reaching any expert first differs from its routed one."""

    phase: str
    step: int | None
    index: int
    routed: str
    starved: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Moe(Record):
    """A Mixture-of-Experts model's part of the proof: why it is one, its experts' kernel, the starved rank."""

    why: str
    experts_kernel: ExpertsKernel
    starved_rank: int
    divergence: StarvedDivergence | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Reused(Record):
    """The kept proof a gate reused: when it was proved, and in how many seconds."""

    proved_at: str | None
    proved_s: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Collectives(Record):
    """gate.json `collectives`: the collective proof's verdict and record (wattgate/proof/).

    A dry run that could not start or broke holds only `passed`, `detail` and `elapsed_s` (None); a proof refused
    before any dry run (`ranks_run` 0) adds the depth but no step classes' fingerprints. Both divergences are
    written (null when none) whenever the proof got as far as the depth (`world_size` set)."""

    passed: bool
    detail: str
    elapsed_s: float | None
    world_size: int | None = spec(omit_none=True, default=None)
    ranks_run: int | None = spec(omit_none=True, default=None)
    rank_groups: tuple[RankGroup, ...] | None = spec(omit_none=True, default=None)
    proxy_layers: int | None = spec(omit_none=True, default=None)
    depth: Depth | None = spec(omit_none=True, default=None)
    steps_run: tuple[int, ...] | None = spec(omit_none=True, default=None)
    classes: tuple[ProofClass, ...] | None = spec(omit_none=True, default=None)
    class_runs: tuple[tuple[int, ...], ...] | None = spec(omit_none=True, default=None)
    startup: Fingerprint | None = spec(omit_none=True, default=None)
    end: Fingerprint | None = spec(omit_none=True, default=None)
    stop: StepFingerprint | None = spec(omit_none=True, default=None)
    resume: StepFingerprint | None = spec(omit_none=True, default=None)
    divergence: CollectiveDivergence | None = spec(omit_none=True, default=None)
    class_divergence: ClassDivergence | None = spec(omit_none=True, default=None)
    moe: Moe | None = spec(omit_none=True, default=None)
    # set by the gate (gate/run.py, gate/proof_reuse.py): the kept proof it reused, the inputs changed since one
    reused: Reused | None = None
    changed_inputs: tuple[str, ...] | None = None
    inputs_sha256: str | None = None

    def to_json(self) -> dict:
        out = Record.to_json(self)
        if self.world_size is not None:  # the proof got as far as the depth: both divergences, null or not
            out.setdefault("divergence", None)
            out.setdefault("class_divergence", None)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanHashes(Record):
    """The sha256 of the plan files the gate checked (the verdict markers name them too)."""

    plan: str = spec(key="plan.json")
    packs: str = spec(key="packs.parquet")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFile(Record):
    """One file of model.path as the gate hashed it: its size, the stat that lets a rerun of the gate reuse the
    hashes (ctime changes with any write), and the xxh3_128 of each `chunk_bytes` piece."""

    size: int = spec(minimum=0)
    ctime_ns: int
    inode: int
    chunks: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFiles(Record):
    """gate.json `model_files`: the bytes of model.path the gate verified (its weights and JSON files), in chunks
    that the train job's ranks share when they check them again before the first step."""

    path: str
    algorithm: str
    chunk_bytes: int = spec(minimum=1)
    files: dict[str, ModelFile]


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceFile(Record):
    """One input file as the gate's `sources` check hashed it (sha256, as pretokenize's source_sha256 does), with
    the stat that lets the next gate reuse the hash (ctime changes with any write)."""

    size: int = spec(minimum=0)
    ctime_ns: int
    inode: int
    sha256: str


@dataclass(frozen=True, kw_only=True, slots=True)
class GateReport(Record):
    """gate.json: the verdict (`passed`; `enforce` false lets a failed gate run anyway), every check, the memory
    estimate per phase, the cost section, the collective proof (None with gate.collectives false) and what was
    checked: the plan files' and the config's sha256. `elapsed_s` is the only field that differs between reruns."""

    passed: bool
    enforce: bool
    elapsed_s: float = spec(minimum=0)
    checks: tuple[GateCheck, ...]
    memory_estimate_bytes: dict[str, int]  # the steady phase's terms, per rank
    memory_estimate_phases: dict[str, MemoryPhase]
    forecast: Forecast | None
    forecast_unavailable: str | None
    failure: Failure | None
    last_run_wait: LastRunWait | None
    mixture: PlanMixture | None = spec(omit_none=True, default=None)  # the plan's, for gate.md's mixture table
    collectives: Collectives | None
    plan_sha256: PlanHashes
    config_sha256: str
    model_files: ModelFiles | None = spec(omit_none=True, default=None)  # model.path's bytes (None: random init)
    source_files: dict[str, SourceFile] | None = spec(omit_none=True, default=None)  # the `sources` check's hashes

    @property
    def failed_checks(self) -> tuple[GateCheck, ...]:
        return tuple(c for c in self.checks if not c.passed)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProofCache(Record):
    """proof-cache.json: the collective proof as last proved in the gate's folder, the inputs it holds for (a
    fingerprint compared as a whole and key by key: gate/proof_reuse.py `proof_inputs`) and when."""

    inputs: dict[str, Any]
    collectives: Collectives
    proved_at: str | None = None


# ---- the parts of gate.json that its tolerant readers (the report, compare) draw, each as far as it holds its shape


@dataclass(frozen=True, kw_only=True, slots=True)
class GateParts(Record):
    """gate.json's parts as found (any shape): the report and compare read each on its own, so a damaged part
    costs that part alone (report/gate_input.py)."""

    passed: Any = None
    enforce: Any = None
    checks: Any = None
    forecast: Any = None
    failure: Any = None
    memory_estimate_phases: Any = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ThroughputView(Record):
    source: str
    detail: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ForecastView(Record):
    """What every reader of a forecast needs: the wall time, GPU-hours and kWh (null without a triage table),
    the throughput's source (None: the forecast names none) and the terms in seconds."""

    wall_s: float
    gpu_hours: float | None = None
    kwh: float | None = None
    throughput: ThroughputView | None = None
    terms_s: dict[str, float] = spec(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureView(Record):
    line: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseEstimate(Record):
    """One phase's memory estimate as the report compares it with the measured peaks."""

    total_bytes: float | None = None
    usable_bytes: float | None = None
    terms_bytes: dict[str, float] | None = None

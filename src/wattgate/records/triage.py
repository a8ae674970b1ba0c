"""triage.json (results/power/<run_name>/, written by `wattgate triage`, power/triage/stage.py): the settings a
triage ran with, the phase totals, each GPU's energy and levels, the telemetry gaps, the peers' agreement, the
pauses, the stragglers and the lag timeline. Format: docs/architecture.md, "results/power/<run_name>/".

The figures are written as computed: a figure that could not be computed (NaN) is written as null by the writer
(`write_json_atomic(..., nonfinite="null")`), so a float that may be one is `float | None` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from wattgate.records.base import Record, spec

TRIAGE_FORMAT_VERSION = 1  # phases.parquet's and triage.json's format_version (power/triage/phases.py)
STATUS_OK = "ok"
STATUS_NO_TELEMETRY = "no GPU telemetry"
# what a straggler's waiting is put down to (power/triage/causes.py; the watcher's CPU ones have no "data")
Cause = Literal["thermal", "power_cap", "hw_slowdown", "data", "rank0_work", "unknown"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TableUsed(Record):
    """The triage table the run was labelled with (triage_tables.TriageTable, as written)."""

    gpu_model: str
    match: tuple[str, ...]
    tdp_w: float
    idle_w: float
    low_max_w: float
    compute_min_w: float
    busy_util_pct: float
    idle_util_pct: float
    provenance: dict = spec(default_factory=dict)
    phases: dict = spec(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class Signals(Record):
    """Which signals the triage had: GPU power, utilization, the run's heartbeats and metrics."""

    power: bool
    util: bool
    heartbeats: bool
    metrics: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseTotal(Record):
    """One power phase over all GPUs: windows, seconds, share of the time, energy (mean power x duration)."""

    windows: int = spec(minimum=0)
    seconds: float | None
    share: float | None
    energy_j: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Gaps(Record):
    """Telemetry gaps: seconds of unknown windows over all GPUs, their runs, the longest, the short ones filled."""

    unknown_s: float | None
    unknown_gaps: int = spec(minimum=0)
    longest_gap_s: float | None
    filled_s: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Levels(Record):
    """One GPU's levels learned from the run (W; null where the run showed too little)."""

    idle_w: float | None
    wait_w: float | None
    plateau_w: float | None
    cap_w: float | None
    low_max_w: float | None
    compute_min_w: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadVsPeers(Record):
    phase: str = spec(key="read")  # what the GPU read (a field named `read` would hide Record.read)
    peers: str
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Departure(Record):
    """A GPU that read another phase than its peers for long: "host:gpu", seconds, what it read against them."""

    gpu: str
    seconds: float
    read_vs_peers: tuple[ReadVsPeers, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Peers(Record):
    windows_compared: int = spec(minimum=0)
    agree_share: float | None
    departures: tuple[Departure, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Energy(Record):
    """One GPU's energy as the report shows it (power/energy.py `records`)."""

    first: float | None
    last: float | None
    integrated_j: float | None
    counter_j: float | None  # null: the counter was unusable
    energy_j: float | None
    method: str
    readings: int = spec(minimum=0)
    gap_s: float | None  # unsampled seconds between first and last


@dataclass(frozen=True, kw_only=True, slots=True)
class Straggler(Record):
    """A GPU its peers waited for (power/triage/stragglers.py; `source` "power")."""

    host: str
    gpu: int
    rank: int | None
    lag_share: float
    lag_windows: int
    wait_windows: int
    scope: Literal["job", "host"]
    wait_gpu_hours: float
    wait_kwh: float
    cause: Cause
    evidence: str
    first: float
    last: float
    source: Literal["power"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WatcherStraggler(Record):
    """Without GPU telemetry, a rank the watcher named from its ranks' CPU time (`gpu` null, `source` "watcher");
    the figures as watcher.json holds them."""

    host: str | None
    gpu: int | None  # null: no GPU telemetry
    rank: int
    lag_share: float | None
    lag_windows: int | None
    wait_windows: int | None
    wait_gpu_hours: float | None
    wait_kwh: float | None
    wait_rank_hours: float | None
    cause: Cause
    evidence: str
    first: float | None
    last: float | None
    source: Literal["watcher"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LagSettings(Record):
    share: float
    margin: float
    min_windows: int
    dominance: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline(Record):
    """Per time bin from `start`: the job's wait windows, and per "host:gpu" last in any, the windows it was last in."""

    start: float
    bin_s: float
    bins: int = spec(minimum=1)
    wait_windows: tuple[int, ...]
    last: dict[str, tuple[int, ...]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Lag(Record):
    settings: LagSettings
    wait_windows: int = spec(minimum=0)
    wait_gpu_hours: float
    wait_kwh: float
    timeline: Timeline | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Lagging(Record):
    """What triage found of the GPUs a run waited for: triage.json's `stragglers` and `lag`, or in-process
    triage's (the phases table's metadata, power/triage/labelling.py `triage`)."""

    stragglers: tuple[Straggler | WatcherStraggler, ...] = ()
    lag: Lag | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PhasesMeta(Record):
    """What triage learned, as a phases table's metadata holds it: phases.parquet's `wattgate.phases` (with its
    settings: format_version, window_s, gpu_model, checked by phases.read_phases) or in-process triage's
    `wattgate.triage` (with the stragglers and the lag)."""

    levels: dict[str, Levels] = spec(default_factory=dict)
    filled_s: float = spec(minimum=0, default=0.0)
    stragglers: tuple[Straggler | WatcherStraggler, ...] = ()
    lag: Lag | None = None

    def lagging(self) -> Lagging:
        return Lagging(stragglers=self.stragglers, lag=self.lag)


@dataclass(frozen=True, kw_only=True, slots=True)
class PauseRecord(Record):
    """A checkpoint or deadlock episode (power_only.Pause.record)."""

    kind: str
    start: float
    end: float
    duration_s: float
    start_offset_s: float | None
    waiting: tuple[str, ...]
    idle: tuple[str, ...]
    power_w: tuple[float, ...] | None
    util_waiting: float | None
    util_idle: float | None
    open: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class PowerOnly(Record):
    """Without heartbeats: what was missing, what could therefore not be told apart, and the verdict."""

    mode: str
    missing: tuple[str, ...]
    cannot_tell: tuple[str, ...]
    wait_rule: str
    verdict: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlace(Record):
    host: str
    gpu: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Ranks(Record):
    mapped: dict[str, RankPlace]  # rank (as a string) -> its GPU
    unmapped: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Triage(Record):
    """triage.json."""

    FORMAT_VERSION: ClassVar[int] = TRIAGE_FORMAT_VERSION

    status: Literal["ok", "no GPU telemetry"]
    traces: tuple[str, ...]
    hosts: tuple[str, ...]
    gpus: int = spec(minimum=0)
    table: TableUsed | None
    table_source: str | None
    window_s: float
    deadlock_after_s: float
    run_dir: str | None
    signals: Signals
    phases: dict[str, PhaseTotal]
    gaps: Gaps | None = None  # absent in a record written before they were kept: computed from the phases
    levels: dict[str, Levels]
    peers: Peers
    energy: dict[str, Energy] = spec(default_factory=dict)
    stragglers: tuple[Straggler | WatcherStraggler, ...]
    lag: Lag
    notes: tuple[str, ...]
    pauses: tuple[PauseRecord, ...] | None = None  # as gaps
    power_only: PowerOnly | None
    ranks: Ranks | None = spec(omit_none=True, default=None)  # with the run's heartbeats and GPU telemetry

    def lagging(self) -> Lagging:
        return Lagging(stragglers=self.stragglers, lag=self.lag)

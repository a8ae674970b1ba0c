"""Everything a report reads about one training run, each piece optional.

A missing file becomes a note ("not available: ...") and a None; a file that
exists but cannot be read is an InputError naming it, because a report built
on a silently skipped input would be wrong rather than incomplete. The run's
own records are the exception, skipped loudly: a metrics.parquet without some
columns, a bad heartbeat state file or bad lines among a rank's heartbeat
events cost what they held, named in the notes (a report is most needed of
a run that went wrong).

The run may also be bare traces (power-only mode: an imported nvidia-smi,
DCGM or Zeus log, or a sampler's file) with no run folder: then only the
traces, and a gate folder or config when given explicitly, are read.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.codes import column_codes
from wattgate.errors import InputError
from wattgate.power.energy import in_time_order, join_parts
from wattgate.power.triage.causes import COLUMNS as CAUSE_COLUMNS
from wattgate.power.triage.phases import CONFIDENCE, LABELS, PHASE, PHASES_SCHEMA, phases_meta, read_phases
from wattgate.power.triage.runinfo import RUN_INFO_METRICS, RunInfo, gpu_uuids
from wattgate.triage_tables import DEFAULT_DEADLOCK_AFTER_S, DEFAULT_WINDOW_S, TriageSettings
from wattgate.power.triage.files import recorded_caps
from wattgate.power.triage.labelling import triage
from wattgate.report.gate_input import UsableGate, usable_gate
from wattgate.report.metrics import trusted_metrics
from wattgate.heartbeats import HEARTBEAT_EVENT_COLUMNS, read_heartbeat_events, read_heartbeats
from wattgate.run_files import (
    run_config_file,
    stage_folder,
    GATE_REPORT,
    METRICS,
    parquet_columns,
    read_metrics,
    read_gate_json,
    read_json_object,
    read_trained,
    read_watcher,
)
from wattgate.run_tables import read_eval
from wattgate.trace import (
    ENERGY_J,
    GPU,
    HOST,
    POWER_W,
    TIME,
    TRACE_SCHEMA,
    UTIL_GPU,
    null_invalid_values,
    read_trace,
    trace_files,
    trace_meta,
)
from wattgate.records.base import Where
from wattgate.records.run_config import RunConfig
from wattgate.records.trace_meta import TraceMeta
from wattgate.records.triage import Energy, Gaps, Lagging, PauseRecord, Triage
from wattgate.records.heartbeat import Beat
from wattgate.records.watcher import WatcherRecord
from wattgate.records.trained import Trained

TRACE_COLUMNS = [TIME, HOST, GPU, POWER_W, ENERGY_J]
METRICS_REQUIRED = ["step", "rank", "time"]  # metrics.parquet: the report needs these, reads the rest if there
METRICS_OPTIONAL = ["loss", "tokens", "loss_tokens", "step_time_s", "data_wait_s"]
PHASE_COLUMNS = [n for n in PHASES_SCHEMA.names if n != CONFIDENCE]  # the report never shows a label's confidence
_CHECKPOINT_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class GpuSeries:
    """One GPU's power samples in time order (often strided views into its file's columns)."""

    host: str
    gpu: int
    time: np.ndarray  # float64
    power: np.ndarray  # float32 or float64, NaN = missing
    energy_pos: np.ndarray  # positions (into time/power) of samples with an energy reading
    energy_j: np.ndarray  # the readings at those positions


@dataclass
class Samples:
    series: list[GpuSeries]  # sorted by (host, gpu)

    @property
    def keys(self) -> list[tuple[str, int]]:
        return [(s.host, s.gpu) for s in self.series]

    @property
    def rows(self) -> int:
        return sum(len(s.time) for s in self.series)


@dataclass
class RunInputs:
    run_dir: Path | None  # None: bare traces (power-only mode)
    run_name: str
    config: RunConfig | None = None
    trained: Trained | None = None
    metrics: pd.DataFrame | None = None
    evals: pd.DataFrame | None = None  # eval.parquet: one row per validation pass (None: no validation)
    events: pd.DataFrame | None = None  # heartbeat events: time, rank, step, epoch, phase
    states: dict[int, Beat] = field(default_factory=dict)
    run_info: RunInfo | None = None  # the same, as triage reads it (rank -> GPU mapping)
    watcher: WatcherRecord | None = None
    gate: UsableGate | None = None
    checkpoints: list[int] = field(default_factory=list)  # steps with a checkpoint folder
    has_final: bool = False
    trace_paths: list[Path] = field(default_factory=list)
    trace_metas: list[TraceMeta] = field(default_factory=list)
    samples: Samples | None = None  # None when triage.json's energy stands in for the traces
    triage_energy: dict[str, Energy] | None = None  # triage.json "energy" ("host:gpu" -> figures) for these traces
    pause_records: tuple[PauseRecord, ...] | None = None  # triage.json "pauses" for these phases
    lag: Lagging | None = None  # triage's stragglers and lag for these phases (triage.json, or in-process triage)
    gaps: Gaps | None = None  # triage.json "gaps" for these phases
    phases: pa.Table | None = None
    phases_source: str | None = None
    window_s: float = DEFAULT_WINDOW_S
    deadlock_after_s: float = DEFAULT_DEADLOCK_AFTER_S
    triage_table: str | None = None
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(text)


# ---------------------------------------------------------------- default locations


def default_power_dir(run_dir: Path) -> Path | None:
    """results/train/<run> -> results/power/<run>: the last `train` in the path becomes `power`."""
    parts = list(run_dir.parts)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == "train":
            parts[i] = "power"
            return Path(*parts)
    return None


def default_gate_dir(run_dir: Path) -> Path:
    return stage_folder(run_dir, "gate")


def default_config_path(run_dir: Path) -> Path:
    return run_config_file(run_dir)


# ---------------------------------------------------------------- small readers


def checkpoint_steps(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT_DIR.match(p.name)))


# ---------------------------------------------------------------- traces


def _read_trace_columns(path: Path, columns: list[str]) -> pa.Table:
    """Only the columns the report needs (a 24 h trace has 16 columns of 10^7 rows); segments of a
    killed sampler go through read_trace, which knows how to stitch them."""
    if not path.is_file():
        return read_trace(path).select(columns)
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowInvalid) as exc:
        raise InputError(f"{path}: not a readable Parquet trace ({exc})") from None
    missing = [c for c in columns if c not in names]
    if missing:
        raise InputError(f"{path}: not a wattgate trace: missing column(s) {', '.join(missing)}")
    try:
        table = pq.read_table(path, columns=columns, read_dictionary=[HOST])
    except (OSError, pa.ArrowInvalid) as exc:
        raise InputError(f"{path}: not a readable Parquet trace ({exc})") from None
    # a foreign trace may hold NaN, Inf or negative readings: null them as read_trace does
    return null_invalid_values(table)[0]


def _host_codes(column: pa.ChunkedArray) -> tuple[np.ndarray | None, list[str]]:
    """Integer codes (None when the file holds one host, the usual case) and the names they index (a
    missing host is "")."""
    values, codes = column_codes(column)
    text = ["" if v is None else str(v) for v in values]
    names = list(dict.fromkeys(text))
    if len(names) <= 1:
        return None, names
    return np.array([names.index(x) for x in text], np.int64)[codes], names


def _numbers(table: pa.Table, name: str, missing) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        col = pc.fill_null(col, missing)
    return col.to_numpy()


def _periodic(key: np.ndarray, ngroups: int) -> bool:
    """Rows cycle through every GPU in the same order (the sampler reads all GPUs each tick)."""
    if len(key) % ngroups:
        return False
    head = key[:ngroups]
    return bool(np.all(np.diff(head) > 0)) and bool((key.reshape(-1, ngroups) == head).all())


def _file_series(table: pa.Table) -> list[GpuSeries]:
    """Split one trace file's rows by GPU: strided views when rows cycle through the GPUs, else a sort."""
    if table.num_rows == 0:
        return []
    codes, names = _host_codes(table.column(HOST))
    gpu = _numbers(table, GPU, -1).astype(np.int64, copy=False)
    time_ = _numbers(table, TIME, np.nan).astype(np.float64, copy=False)
    power = _numbers(table, POWER_W, np.nan)
    energy = table.column(ENERGY_J)
    valid = None if energy.null_count == len(energy) else pc.is_valid(energy).to_numpy(zero_copy_only=False)
    readings = pc.drop_null(energy).to_numpy().astype(np.float64) if valid is not None else None
    width = int(gpu.max()) + 1 if len(gpu) else 1
    key = gpu if codes is None else codes.astype(np.int64) * width + gpu
    key = np.where((gpu >= 0) & np.isfinite(time_), key, -1)
    counts = np.bincount(key + 1)
    present = np.flatnonzero(counts[1:])
    groups = [(names[k // width] if codes is not None else names[0], int(k % width)) for k in present]
    out = []
    if counts[0] == 0 and _periodic(key, len(present)):
        k = len(present)
        pos = np.flatnonzero(valid) if valid is not None else np.zeros(0, np.int64)
        for j, (h, g) in enumerate(groups):
            mine = pos % k == j
            parts = (time_[j::k], power[j::k], pos[mine] // k, readings[mine] if readings is not None else np.zeros(0))
            out.append(GpuSeries(h, g, *in_time_order(*parts)))
        return out
    # general layout: a stable sort on small integer keys keeps each GPU's rows in file order
    lut = np.full(len(counts) - 1, -1, np.int64)
    lut[present] = np.arange(len(present))
    gid = np.where(key >= 0, lut[np.maximum(key, 0)], len(present))
    order = np.argsort(gid.astype(np.int16 if len(present) < 1 << 15 else np.int64), kind="stable")
    bounds = np.searchsorted(gid[order], np.arange(len(present) + 1))
    t_sorted, p_sorted = time_[order], power[order]
    if valid is not None:
        assert readings is not None  # read whenever `valid` is
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order))
        epos = rank[np.flatnonzero(valid)]
        by = np.argsort(epos, kind="stable")
        epos, evals = epos[by], readings[by]
    else:
        epos, evals = np.zeros(0, np.int64), np.zeros(0)
    for j, (h, g) in enumerate(groups):
        a, b = bounds[j], bounds[j + 1]
        lo, hi = np.searchsorted(epos, [a, b])
        out.append(GpuSeries(h, g, *in_time_order(t_sorted[a:b], p_sorted[a:b], epos[lo:hi] - a, evals[lo:hi])))
    return out


def read_samples(tables: list[pa.Table]) -> Samples:
    """Every GPU's samples in time order, sorted by (host, gpu). A GPU found in two files (a restarted
    sampler) is joined in time order."""
    by_key: dict[tuple[str, int], list[GpuSeries]] = {}
    for t in tables:
        for s in _file_series(t):
            by_key.setdefault((s.host, s.gpu), []).append(s)
    return Samples(join_parts(by_key, GpuSeries))


# ---------------------------------------------------------------- phases


def _triage_in_process(inputs: RunInputs, trace: pa.Table, info: RunInfo | None, sources: ReportSources) -> None:
    # the table, window and hang limit `wattgate triage --config` would use; a table file or GPU model
    # given here first (a Zeus log names no device)
    names = sorted({name for m in inputs.trace_metas for name in m.device_names()})
    gpu_model, table_path, power_cap_w = sources.gpu_model, sources.table_path, sources.power_cap_w
    settings = TriageSettings.merge(inputs.config, table_path, gpu_model, power_cap_w=power_cap_w)
    caps = recorded_caps(inputs.trace_metas)
    try:
        table = settings.table(names, list(caps.values()))
    except InputError as exc:
        # asked for by name: a wrong one is the caller's error, not a gap in the run
        if gpu_model or table_path or power_cap_w:
            raise
        inputs.note(f"phases not available: triage could not pick a table ({exc})")
        return
    window_s, deadlock_after_s = float(settings.window_s), float(settings.deadlock_after_s)
    share = float(settings.straggler_share)
    inputs.phases = triage(trace, table, window_s, deadlock_after_s, info, caps, power_cap_w, share)
    inputs.lag = phases_meta(inputs.phases).lagging()
    inputs.window_s, inputs.deadlock_after_s = window_s, deadlock_after_s
    inputs.triage_table = table.gpu_model
    inputs.phases_source = (
        f"in-process triage ({table.gpu_model} table, windows of {window_s:g} s, deadlock after {deadlock_after_s:g} s)"
    )


# ---------------------------------------------------------------- all inputs


@dataclass(frozen=True)
class ReportSources:
    """Where a report's inputs come from besides the run folder; each None is the run folder's own (or none).

    `trace_paths` (trace files or telemetry folders) replace run_dir/telemetry, and without a run folder they are
    all there is (power-only mode). `power_dir`: triage's output (phases), `gate_dir`: the gate's. The run config:
    `config` (loaded), else `config_path`, else results/config/<run>.yaml beside the run when there is one.
    `gpu_model` picks the triage table for in-process triage when the traces name no device (Zeus); `table_path`
    (a triage table YAML) is used instead of any shipped table (a GPU with none); `power_cap_w` derives one from
    the power cap for a GPU no table ships for (an imported log)."""

    power_dir: str | os.PathLike | None = None
    gate_dir: str | os.PathLike | None = None
    config_path: str | os.PathLike | None = None
    config: RunConfig | None = None
    trace_paths: str | os.PathLike | Iterable[str | os.PathLike] | None = None
    gpu_model: str | None = None
    table_path: str | os.PathLike | None = None
    power_cap_w: float | None = None


RUN_FOLDER_ONLY = ReportSources()  # the run folder's own inputs, nothing added


def load_inputs(run_dir: str | os.PathLike | None, sources: ReportSources = RUN_FOLDER_ONLY) -> RunInputs:
    """A run folder's inputs, with what `sources` adds or replaces (ReportSources)."""
    config_path, config, trace_paths = sources.config_path, sources.config, sources.trace_paths
    run_dir = Path(run_dir) if run_dir is not None else None
    if run_dir is None and not trace_paths:
        raise InputError("nothing to report on: give a run folder or trace files")
    if run_dir is not None and not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run folder")
    traces = None
    if trace_paths:
        given = [Path(trace_paths)] if isinstance(trace_paths, (str, os.PathLike)) else [Path(p) for p in trace_paths]
        traces = [f for p in given for f in (trace_files(p) if p.is_dir() else [p])]
        if not traces:
            raise InputError(f"{', '.join(map(str, given))}: no trace files (*.parquet)")
    cfg_path = Path(config_path) if config_path else default_config_path(run_dir) if run_dir else None
    if config is None and cfg_path is not None and (config_path or cfg_path.is_file()):
        from wattgate.config import load_run_config  # imported only when there is a file to load

        config = load_run_config(cfg_path)
    if run_dir is not None:
        name = run_dir.name
    else:
        assert traces is not None  # without a run folder there are trace files (refused above otherwise)
        name = "+".join(p.stem for p in traces)
    inputs = RunInputs(run_dir, config.run_name if config is not None else name, config=config)
    if run_dir is None:
        inputs.note(
            "power-only report: traces without a run folder (no TRAINED, metrics, heartbeats, "
            "checkpoints or watcher verdict)"
        )
    elif config is None:
        inputs.note(f"config not available ({cfg_path} not found): cluster and train settings not shown")

    power_dir = Path(sources.power_dir) if sources.power_dir else default_power_dir(run_dir) if run_dir else None
    with ThreadPoolExecutor(max_workers=1) as pool:
        # phases.parquet decodes on another thread while the run's own files are read (Arrow lets go of the GIL);
        # an error in either is raised in the order the files are read
        phases_file = power_dir / "phases.parquet" if power_dir else None
        reading = pool.submit(read_phases, phases_file, PHASE_COLUMNS, dictionary=True) if phases_file else None
        if run_dir is not None:
            _read_run_files(inputs, run_dir)
        gate_dir = Path(sources.gate_dir) if sources.gate_dir else default_gate_dir(run_dir) if run_dir else None
        if gate_dir is not None:
            raw_gate = read_gate_json(gate_dir)
            if raw_gate is None:
                inputs.note(f"gate.json not available (looked in {gate_dir})")
            else:
                inputs.gate = usable_gate(raw_gate, gate_dir / GATE_REPORT, inputs.note)
        if traces is not None:
            inputs.trace_paths = traces
        else:
            assert run_dir is not None  # without trace files there is a run folder (refused above otherwise)
            inputs.trace_paths = trace_files(run_dir / "telemetry")
        found = reading.result() if reading is not None else None
    record = None
    if found is not None:
        assert power_dir is not None  # the phases were read from it
        record = _triage_record(inputs, power_dir / "triage.json")
        if record is not None and not _written_after(power_dir / "triage.json", power_dir / "phases.parquet"):
            record = None  # not the triage.json of these phases (its write failed, or it was copied in)
        check_phase_labels(found[0], power_dir / "phases.parquet")
        inputs.phases, inputs.window_s, inputs.triage_table, inputs.deadlock_after_s = found
        inputs.phases_source = str(power_dir / "phases.parquet")
        # what triage.json says of the very phases beside it is not computed again
        if record is not None:
            inputs.pause_records, inputs.gaps, inputs.lag = record.pauses, record.gaps, record.lagging()
            inputs.triage_energy = _energy_of(record, inputs.trace_paths, power_dir / "triage.json")
    if inputs.triage_energy is not None:
        # triage read these very files and wrote each GPU's energy: the traces' 10^7 rows are not read again
        inputs.trace_metas = [trace_meta(pq.read_schema(p), p) for p in inputs.trace_paths]
    else:
        tables = []
        for path in inputs.trace_paths:
            t = _read_trace_columns(path, TRACE_COLUMNS)
            meta = trace_meta(t, path)
            if meta == TraceMeta() and path.is_file():  # none on the columns read: the file's own
                meta = trace_meta(pq.read_schema(path), path)
            inputs.trace_metas.append(meta)
            tables.append(t)
        inputs.samples = read_samples(tables)
    if not inputs.trace_paths:
        inputs.note("no telemetry traces (telemetry/*.parquet): no power, energy or phases")

    triaging = found is None and inputs.samples is not None and inputs.samples.rows > 0
    if run_dir is not None:
        info = _run_info(inputs, run_dir)
        if not info.has_heartbeats:
            inputs.note("no heartbeats: checkpoint intervals and rank placement not shown")
    else:  # nothing recorded beside the traces: triage runs on power alone
        info = RunInfo(pd.DataFrame(columns=HEARTBEAT_EVENT_COLUMNS), {}, None, source="")
    inputs.events, inputs.states, inputs.run_info = info.events, info.states, info

    if triaging:
        # triage reads utilization (and a straggler's clocks and reasons) too; only this path needs them
        trace = pa.concat_tables([_triage_columns(p) for p in inputs.trace_paths], promote_options="default")
        _triage_in_process(inputs, trace, info if run_dir is not None else None, sources)
    return inputs


def _triage_columns(path: Path) -> pa.Table:
    """What in-process triage reads of a trace: the windows' columns and, where the file has them, the SM clock,
    temperature and clocks-event reasons that name a straggler's cause."""
    names = pq.read_schema(path).names if path.is_file() else TRACE_SCHEMA.names
    cols = [TIME, HOST, GPU, POWER_W, UTIL_GPU] + [c for c in CAUSE_COLUMNS if c in names]
    return _read_trace_columns(path, cols).cast(pa.schema([TRACE_SCHEMA.field(c) for c in cols]))


def check_phase_labels(phases: pa.Table, path: Path) -> None:
    """Refuse a phases table with a label outside triage's set (LABELS): drawn, its windows would pass as
    `unknown`, a telemetry gap no sample was missing for."""
    values, codes = column_codes(phases.column(PHASE))
    if all(v in LABELS for v in values):
        return
    counts = np.bincount(codes, minlength=len(values))  # a dictionary entry no row uses is no label
    foreign = [i for i, v in enumerate(values) if v not in LABELS and counts[i]]
    if not foreign:
        return
    named = ", ".join(f"{values[i]!r} ({counts[i]} window(s))" for i in foreign[:5])
    raise InputError(
        f"{path}: column 'phase': label(s) {named} not among {', '.join(LABELS)}; "
        "run `wattgate triage` again (or fix the labels)"
    )


def _triage_record(inputs: RunInputs, path: Path) -> Triage | None:
    """triage.json beside a phases.parquet, or None (missing or unreadable: the report then recomputes what it
    would have taken from it, so a damaged file costs time, not the report)."""
    try:
        data = read_json_object(path, "the triage record", "triage")
        return Triage.from_json(data, Where(str(path), "triage")) if data is not None else None
    except InputError as exc:
        inputs.note(f"{exc}; its pauses and energy are recomputed")
        return None


def _written_after(path: Path, other: Path) -> bool:
    try:
        return path.stat().st_mtime >= other.stat().st_mtime
    except OSError:
        return False


def _energy_of(record: Triage, trace_paths: list[Path], path: Path) -> dict[str, Energy] | None:
    """triage.json's per-GPU energy when it was computed from exactly these trace files, unchanged since
    (each an ordinary file, none modified after triage.json was written); else None."""
    energy, listed = record.energy, record.traces
    if not energy or not trace_paths:
        return None
    try:
        if not all(p.is_file() for p in trace_paths):
            return None  # segments of a killed sampler: read them as before
        if sorted(str(Path(p).resolve()) for p in listed) != sorted(str(p.resolve()) for p in trace_paths):
            return None
        written = path.stat().st_mtime
        if any(p.stat().st_mtime > written for p in trace_paths):
            return None
    except OSError:
        return None
    return energy


def _read_run_files(inputs: RunInputs, run_dir: Path) -> None:
    inputs.trained = read_trained(run_dir)
    if inputs.trained is None:
        inputs.note(
            "TRAINED not available: the run did not finish, or this is not a run folder; "
            "wall time, MFU and loss come from metrics where possible"
        )
    inputs.metrics = _metrics(inputs, run_dir)
    if inputs.metrics is None:
        inputs.note("metrics.parquet not available: no tokens, step times, loss or straggler analysis")
    try:
        inputs.evals = read_eval(run_dir)
    except InputError as exc:  # a damaged validation table costs its rows, not the report
        inputs.note(f"validation table not read: {exc}")
    inputs.watcher = read_watcher(run_dir)
    if inputs.watcher is None:
        inputs.note("watcher.json not available: no hang watcher verdict")
    inputs.checkpoints = checkpoint_steps(run_dir / "checkpoints")
    inputs.has_final = (run_dir / "final").is_dir()


# ---------------------------------------------------------------- the run's own records, as far as they go
# A report is read after the fact, often of a run that went wrong: a damaged or older record costs what it
# held, named in the notes, never the whole report (the report draws what the other files give).


def _metrics(inputs: RunInputs, run_dir: Path) -> pd.DataFrame | None:
    """metrics.parquet with the columns it has; None (and a note) when it lacks step, rank or time."""
    path = run_dir / METRICS
    if not path.is_file():
        return None
    names = parquet_columns(path, "train")
    missing = [c for c in METRICS_REQUIRED if c not in names]
    if missing:
        inputs.note(f"{path}: no column(s) {', '.join(missing)}: metrics not used")
        return None
    absent = [c for c in METRICS_OPTIONAL if c not in names]
    if absent:
        inputs.note(f"{path}: no column(s) {', '.join(absent)}: what they give is not shown")
    metrics = read_metrics(run_dir, METRICS_REQUIRED, METRICS_OPTIONAL)
    return trusted_metrics(metrics, path, inputs.note) if metrics is not None else None


def _run_info(inputs: RunInputs, run_dir: Path) -> RunInfo:
    """Heartbeats and metrics as triage's rules read them (runinfo.load_run_info), but a bad heartbeat file
    or line is skipped and named, and metrics without the run-info columns take no part."""
    metrics = inputs.metrics
    if metrics is not None and not set(RUN_INFO_METRICS) <= set(metrics.columns):
        metrics = None  # _metrics named the missing columns
    events = read_heartbeat_events(run_dir, on_bad=inputs.note)
    states = read_heartbeats(run_dir, on_bad=inputs.note)
    return RunInfo(events, states, metrics, gpu_uuids(inputs.trace_metas), str(run_dir))

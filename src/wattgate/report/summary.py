"""The numbers of a report (summary.json): throughput, energy, phase shares, anomalies, verdicts.

Every float is rounded and every key sorted on output, so the same inputs give
byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import cast

import numpy as np
import pandas as pd

from wattgate.report import anomalies as an
from wattgate.power.energy import GpuEnergy, gpu_energy
from wattgate.report.cards import forecast_record, gate_record, memory_record, power_only_record, watcher_record
from wattgate.records.triage import Energy as TriageEnergy, PauseRecord
from wattgate.records.summary import (
    Checkpoints,
    Energy,
    GpuEnergyRow,
    GpuPhases,
    NodePhases,
    Phases,
    PhaseShare,
    RunFacts,
    Signals,
    StragglerEntry,
    Summary,
)
from wattgate.records.trained import Trained
from wattgate.report.inputs import RunInputs
from wattgate.report.phases import PhaseWindows, phase_windows, totals
from wattgate.report.stragglers import straggler_record
from wattgate.report.steps import loss, num, segments_section, step_table, throughput, validation_section
from wattgate.power.triage import power_only
from wattgate.power.triage.phases import LABELS, UTIL_GPU, gap_summary, phases_meta
from wattgate.power.triage.runinfo import map_ranks
from wattgate.run_tables import STEP_TIME_S, TIME
from wattgate.heartbeats import EVENT_TIME

J_PER_KWH = 3.6e6
MAX_ANOMALIES = 500  # a pathological run must not produce a report of megabytes


@dataclass
class Analysis:
    """What the figures and the page draw from: the inputs, their arrays, and the summary."""

    inputs: RunInputs
    energy: GpuEnergy | None
    windows: PhaseWindows
    t0: float | None  # earliest time any input saw
    t1: float | None  # latest
    summary: Summary
    steps: pd.DataFrame | None = None  # step_table of the metrics, for the figures


def utc(t: float | None) -> str | None:
    """The time as a UTC date, None for none (or one no calendar date has: the inputs drop such times)."""
    if t is None:
        return None
    try:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return None


# ---------------------------------------------------------------- pieces


def run_span(inputs: RunInputs, energy: GpuEnergy | None, w: PhaseWindows) -> tuple[float | None, float | None]:
    """Earliest and latest time any input saw: the range of every time axis."""
    lo, hi = [], []
    if energy is not None and len(energy.first):
        lo.append(float(np.nanmin(energy.first)))
        hi.append(float(np.nanmax(energy.last)))
    elif len(w):
        lo.append(float(w.start.min()))
        hi.append(float(w.end.max()))
    m = inputs.metrics
    if m is not None and len(m):
        begin = m[TIME] - (m[STEP_TIME_S] if STEP_TIME_S in m else 0.0)
        lo.append(float(begin.min()))
        hi.append(float(m[TIME].max()))
    if inputs.events is not None and len(inputs.events):
        lo.append(float(inputs.events[EVENT_TIME].min()))
        hi.append(float(inputs.events[EVENT_TIME].max()))
    return (min(lo), max(hi)) if lo else (None, None)


def energy_summary(energy: GpuEnergy | None, w: PhaseWindows, tokens: int | None) -> Energy:
    if energy is not None and len(energy.keys):
        joules = energy.joules
        total = float(joules.sum())
        sampled, gaps = energy.sampled_s, energy.gaps
        per_gpu = tuple(
            GpuEnergyRow(
                host=h,
                gpu=g,
                kwh=num(j / J_PER_KWH),
                method=m,
                span_s=num(b - a, 3),
                gap_s=num(gap, 3),
                mean_power_w=num(j / on, 3) if on > 0 else None,  # over sampled time: a gap counts no energy
            )
            for (h, g), j, m, a, b, on, gap in zip(
                energy.keys, joules, energy.methods, energy.first, energy.last, sampled, gaps
            )
        )
        counter = energy.counter_j
        return Energy(
            kwh=num(total / J_PER_KWH),
            method=energy.method,
            per_gpu=per_gpu,
            integrated_kwh=num(energy.integrated_j.sum() / J_PER_KWH),
            counter_kwh=num(np.nansum(counter) / J_PER_KWH) if np.isfinite(counter).all() else None,
            gap_s=num(float(gaps.sum()), 3),  # unsampled seconds between the GPUs' samples: counted nowhere
            j_per_token=num(total / tokens, 6) if tokens else None,
        )
    if len(w):
        total = float(w.energy_j.sum())
        return Energy(
            kwh=num(total / J_PER_KWH),
            method="phase_window_means",
            per_gpu=(),
            integrated_kwh=None,
            counter_kwh=None,
            gap_s=None,
            j_per_token=num(total / tokens, 6) if tokens else None,
        )
    return Energy(
        kwh=None, method=None, per_gpu=(), integrated_kwh=None, counter_kwh=None, gap_s=None, j_per_token=None
    )


def _share_rows(secs: np.ndarray, joules: np.ndarray) -> tuple[dict, dict, dict]:
    """Per phase (with any time): time share, energy kWh and energy share of one row of totals."""
    t, e = secs.sum(), joules.sum()
    present = [i for i in range(len(LABELS)) if secs[i] > 0]
    return (
        {LABELS[i]: num(secs[i] / t) for i in present},
        {LABELS[i]: num(joules[i] / J_PER_KWH) for i in present},
        {LABELS[i]: num(joules[i] / e) if e > 0 else None for i in present},
    )


def phase_section(inputs: RunInputs, w: PhaseWindows) -> Phases:
    gaps = inputs.gaps
    if gaps is None and inputs.phases is not None:
        gaps = gap_summary(inputs.phases, inputs.window_s, phases_meta(inputs.phases).filled_s)

    def phases(seconds: float | None, by_phase: dict, per_gpu: list, per_node: list) -> Phases:
        return Phases(
            source=inputs.phases_source,
            table=inputs.triage_table,
            window_s=inputs.window_s,
            gaps=gaps,
            seconds=seconds,
            by_phase=by_phase,
            per_gpu=tuple(per_gpu),
            per_node=tuple(per_node),
        )

    if not len(w):
        return phases(0.0, {}, [], [])
    ngpu = len(w.keys)
    secs, joules = totals(w, w.gid, ngpu)
    all_s, all_j = secs.sum(axis=0), joules.sum(axis=0)
    share, kwh, eshare = _share_rows(all_s, all_j)
    by_phase = {
        ph: PhaseShare(
            seconds=num(all_s[LABELS.index(ph)], 3),
            time_share=share[ph],
            energy_kwh=kwh[ph],
            energy_share=eshare[ph],
        )
        for ph in share
    }
    per_gpu = []
    for k, (h, g) in enumerate(w.keys):
        s, k_, e = _share_rows(secs[k], joules[k])
        per_gpu.append(
            GpuPhases(host=h, gpu=g, seconds=num(secs[k].sum(), 3), time_share=s, energy_kwh=k_, energy_share=e)
        )
    hosts = sorted({h for h, _ in w.keys})
    per_node = []
    for h in hosts:
        rows = [k for k, (hh, _) in enumerate(w.keys) if hh == h]
        s, k_, e = _share_rows(secs[rows].sum(axis=0), joules[rows].sum(axis=0))
        per_node.append(
            NodePhases(
                host=h, gpus=len(rows), seconds=num(secs[rows].sum(), 3), time_share=s, energy_kwh=k_, energy_share=e
            )
        )
    return phases(num(all_s.sum(), 3), by_phase, per_gpu, per_node)


def rank_gpus(inputs: RunInputs, keys: list[tuple[str, int]]) -> dict[int, str]:
    if inputs.run_info is None or not keys:
        return {}
    return {r: f"{keys[g][0]}:{keys[g][1]}" for r, g in map_ranks(inputs.run_info, keys).items()}


def find_anomalies(
    inputs: RunInputs, w: PhaseWindows, keys: list[tuple[str, int]], waited_for: tuple[StragglerEntry, ...] = ()
) -> list[an.Episode]:
    """`waited_for`: the stragglers the Stragglers card names (report/stragglers.py)."""
    return (
        an.hangs(w, inputs.watcher, inputs.window_s)
        + an.starvation(w, inputs.metrics, inputs.window_s)
        + an.stragglers(inputs.metrics, rank_gpus(inputs, keys))
        + an.waited_for(list(waited_for))
    )


def run_facts(inputs: RunInputs, t0: float | None) -> RunFacts:
    """summary.json `run`: the run's name and inputs, its start, and the device it ran on."""
    names = sorted({name for m in inputs.trace_metas for name in m.device_names()})
    cluster = inputs.config.cluster if inputs.config is not None else None
    t = inputs.trained or Trained()
    nvml = next((str(m.nvml) for m in inputs.trace_metas if m.nvml), None)
    return RunFacts(
        name=inputs.run_name,
        dir=str(inputs.run_dir) if inputs.run_dir is not None else None,
        traces=tuple(str(p) for p in inputs.trace_paths),
        start=num(t0, 3),
        start_utc=utc(t0),
        device=t.device,
        gpu_names=tuple(names),
        nvml=nvml,
        gpu_model=cluster.gpu_model if cluster else None,
        nodes=cluster.nodes if cluster else None,
        gpus_per_node=cluster.gpus_per_node if cluster else None,
        params=t.params,
    )


# ---------------------------------------------------------------- the summary


def recorded_energy(energy: dict[str, TriageEnergy]) -> GpuEnergy | None:
    """GpuEnergy from triage.json's "energy" ("host:gpu" -> first, last, integrated_j, counter_j (null: the
    counter was unusable), readings, gap_s), in (host, gpu) order as read_samples gives it."""

    def f(x):
        return np.nan if x is None else float(x)

    rows = []
    for label, e in energy.items():
        host, _, gpu = label.rpartition(":")
        rows.append(((host, int(gpu)), f(e.first), f(e.last), f(e.integrated_j), f(e.counter_j), f(e.gap_s)))
    if not rows:
        return None
    rows.sort(key=lambda r: r[0])
    keys, first, last, integrated, counter, gaps = zip(*rows)
    return GpuEnergy(list(keys), *(np.array(x) for x in (first, last, integrated, counter, gaps)))


def recorded_pauses(records: tuple[PauseRecord, ...]) -> list[power_only.Pause]:
    """Pause objects back from the records triage.json keeps of them (Pause.record)."""
    return [
        power_only.Pause(
            r.kind,
            float(r.start),
            float(r.end),
            list(r.waiting),
            list(r.idle),
            # (low, high) as Pause.record writes it; PauseRecord can only type it tuple[float, ...]
            cast("tuple[float, float]", tuple(r.power_w)) if r.power_w else None,
            r.util_waiting,
            r.util_idle,
            r.open,
        )
        for r in records
    ]


def analyze(inputs: RunInputs) -> Analysis:
    samples = inputs.samples
    if inputs.triage_energy is not None:
        energy = recorded_energy(inputs.triage_energy)
    else:
        energy = gpu_energy(samples) if samples is not None and samples.rows else None
    w = phase_windows(inputs.phases)
    keys = energy.keys if energy is not None else w.keys
    gpus = len(keys)
    steps = step_table(inputs.metrics)
    thr = throughput(inputs, steps, gpus)
    gpu_seconds = (  # sampled seconds only: a gap in the trace is no GPU time anyone measured
        float(energy.sampled_s.sum()) if energy is not None else float(w.seconds.sum()) if len(w) else None
    )
    energy_section = energy_summary(energy, w, thr.tokens)
    gpu_hours = num(gpu_seconds / 3600.0) if gpus and gpu_seconds is not None else None
    lag = straggler_record(inputs.lag, inputs.watcher, gpu_hours, energy_section.kwh, inputs.notes)
    episodes = find_anomalies(inputs, w, keys, lag.entries)
    t0, t1 = run_span(inputs, energy, w)
    records = [
        a.replace(start_offset_s=num(a.start - t0, 3) if t0 is not None else None, start_utc=utc(a.start))
        for a in an.anomaly_records(episodes)
    ]
    trained = inputs.trained or Trained()
    sig = signals(inputs, energy, w)
    found = (
        recorded_pauses(inputs.pause_records) if inputs.pause_records is not None else power_only.pauses(inputs.phases)
    )
    summary = Summary(
        run=run_facts(inputs, t0),
        **thr.to_json(),
        gpus=gpus,
        gpu_hours=gpu_hours,
        energy=energy_section,
        loss=loss(inputs, steps),
        validation=validation_section(inputs.evals),
        mfu=num(trained.mfu),
        peak_memory_gib=num(trained.peak_memory_gib, 4),
        phases=phase_section(inputs, w),
        stragglers=lag,
        anomalies=tuple(records[:MAX_ANOMALIES]),
        anomalies_omitted=max(0, len(records) - MAX_ANOMALIES),
        gate=gate_record(inputs.gate),
        forecast=forecast_record(inputs.gate, trained, energy_section.kwh),
        segments=segments_section(steps),
        memory=memory_record(inputs.trained, inputs.gate),
        watcher=watcher_record(inputs.watcher),
        checkpoints=Checkpoints(steps=tuple(inputs.checkpoints), final=inputs.has_final),
        signals=sig,
        pauses=tuple(PauseRecord.from_json(p.record(t0), "summary.json", f"pauses[{i}].") for i, p in enumerate(found)),
        power_only=power_only_record(inputs, sig, found, t0),
        notes=tuple(inputs.notes),  # last: the records above add theirs
    )
    return Analysis(inputs, energy, w, t0, t1, summary, steps)


def counter_read(inputs: RunInputs) -> bool:
    """Whether any GPU's trace has an energy counter reading."""
    if inputs.triage_energy is not None:
        return any(e.readings > 0 for e in inputs.triage_energy.values())
    return inputs.samples is not None and any(len(x.energy_pos) for x in inputs.samples.series)


def signals(inputs: RunInputs, energy: GpuEnergy | None, w: PhaseWindows) -> Signals:
    util = inputs.phases is not None and inputs.phases.num_rows > inputs.phases.column(UTIL_GPU).null_count
    return Signals(
        traces=bool(inputs.trace_paths),
        power=energy is not None,
        util=bool(util),
        energy_counter=counter_read(inputs),
        phases=bool(len(w)),
        metrics=inputs.metrics is not None,
        heartbeats=inputs.run_info is not None and inputs.run_info.has_heartbeats,
        trained=inputs.trained is not None,
        watcher=inputs.watcher is not None,
        gate=inputs.gate is not None,
        checkpoints=bool(inputs.checkpoints),
        config=inputs.config is not None,
    )

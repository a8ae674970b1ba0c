"""The report's cards from the gate and the run: gate checks, forecast, memory, watcher, power-only verdicts.

Each card has one home here: `<card>_record` builds its numbers (summary.json's entry of that name) and
`<card>_section` draws them on the page, so the keys one writes and the other reads sit side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from wattgate.power.triage import power_only
from wattgate.records.summary import (
    ActualFigures,
    ForecastCard,
    ForecastError,
    ForecastFigures,
    GateCard,
    GateCheck,
    ImportedTrace,
    MemoryCard,
    MemoryPhase,
    PowerOnlyCard,
    Signals,
    Summary,
    WatcherCard,
)
from wattgate.records.trained import MEMORY_PHASES, PhasePeak, Trained
from wattgate.records.base import ABSENT
from wattgate.records.watcher import WatcherRecord
from wattgate.records.gate import PHASE_HOST, PhaseEstimate
from wattgate.report.gate_input import UsableGate
from wattgate.report.inputs import RunInputs
from wattgate.report.steps import num
from wattgate.durations import duration
from wattgate.report.markup import Raw, fmt, note, pct, section, table, utc_of


def short_list(items: Sequence[object], limit: int = 8) -> str:
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "") if items else "-"


def gate_record(gate: UsableGate | None) -> GateCard | None:
    if gate is None:
        return None
    checks = tuple(GateCheck(name=c.name, passed=c.passed, detail=c.detail) for c in gate.checks)
    return GateCard(
        passed=gate.passed,  # None: gate.json's verdict was damaged (report/gate_input.py)
        enforce=gate.enforce,
        failed_checks=tuple(c.name for c in checks if not c.passed),
        checks=checks,
    )


def gate_section(s: Summary) -> str:
    g = s.gate
    if g is None:
        return section("gate", "Invariant gate", note("not available: no gate.json"))
    verdict = {True: "passed", False: "FAILED", None: "of unknown outcome (gate.json's verdict is damaged)"}[g.passed]
    went_ahead = g.passed is False and g.enforce is False
    enforce = " (gate.enforce was false: the run went ahead anyway)" if went_ahead else ""
    mark = {True: '<b style="color:#135e2c">pass</b>', False: '<b style="color:#8a1414">FAIL</b>'}
    rows = [[c.name, Raw(mark[c.passed]), c.detail] for c in g.checks]
    return section(
        "gate",
        "Invariant gate",
        f"<p>Gate <b>{verdict}</b>{escape(enforce)}.</p>" + table(["check", "result", "detail"], rows),
    )


def forecast_record(gate: UsableGate | None, trained: Trained, kwh: float | None) -> ForecastCard | None:
    """The gate's forecast of the train job beside what the run measured (TRAINED job_s, ranks, energy)."""
    fc = gate.forecast if gate is not None else None
    failure = gate.failure if gate is not None else None
    if fc is None and failure is None:
        return None
    figures = actual = error = None
    if fc is not None:
        assert fc.throughput is not None, "usable_gate drops a forecast without a throughput (forecast_view)"
        figures = ForecastFigures(  # the shapes report/gate_input.py vouched for
            wall_s=fc.wall_s,
            gpu_hours=fc.gpu_hours,
            kwh=fc.kwh,
            source=fc.throughput.source,
            detail=fc.throughput.detail,
            terms_s=dict(fc.terms_s),
        )
    wall, world = trained.job_s, trained.world_size
    if wall:
        actual = ActualFigures(wall_s=wall, gpu_hours=num(wall * world / 3600) if world else None, kwh=kwh)
        if figures is not None:
            error = ForecastError(
                wall_s=_error(actual.wall_s, figures.wall_s),
                gpu_hours=_error(actual.gpu_hours, figures.gpu_hours),
                kwh=_error(actual.kwh, figures.kwh),
            )
    return ForecastCard(
        forecast=figures, actual=actual, error=error, failure=failure.line if failure is not None else None
    )


def resumed(s: Summary) -> bool:
    """Whether the run went on over several attempts: its training time is summed over them, while TRAINED's job
    time is the last attempt's."""
    return "resumed" in (s.wall_source or "")


FORECAST_MISS = 0.25  # a forecast further off than this is called out, with where the time went


def forecast_miss(s: Summary) -> str | None:
    """One sentence when the job time missed its forecast by more than FORECAST_MISS: which part of the job missed
    most (the training steps, or start-up and export), measured against forecast, and what to do about it."""
    f = s.forecast
    if not f or not f.forecast or not f.actual or not f.error or f.error.wall_s is None:
        return None
    if abs(f.error.wall_s) <= FORECAST_MISS or s.wall_s is None or f.actual.wall_s is None:
        return None
    if resumed(s):  # the job time is the last attempt's alone: no whole job to compare
        return None
    terms = f.forecast.terms_s or {}
    steps_fc = sum(terms.get(k, 0.0) for k in ("steps_s", "validation_s", "checkpoints_s", "warmup_s"))
    edges_fc = sum(terms.get(k, 0.0) for k in ("startup_s", "load_s", "export_s"))
    steps_actual, edges_actual = s.wall_s, max(f.actual.wall_s - s.wall_s, 0.0)
    longer = "longer" if f.error.wall_s > 0 else "less time"
    head = f"The job took {pct(abs(f.error.wall_s))} {longer} than the gate forecast. "
    if abs(steps_actual - steps_fc) >= abs(edges_actual - edges_fc):
        ratio = steps_actual / steps_fc if steps_fc else None
        how = f" ({ratio:.1f}x)" if ratio else ""
        return head + (
            f"Most of it is the training steps: {duration(steps_actual)} measured against {duration(steps_fc)} "
            f"forecast{how}, so the throughput it assumed ({f.forecast.source}) was off; this run's measured rate "
            "goes into the throughput ledger (forecast.ledger), which the next forecast on this GPU model uses."
        )
    return head + (
        f"Most of it is start-up, loading and export: {duration(edges_actual)} measured against {duration(edges_fc)} "
        "forecast; a cold start (imports, compilation, a model read from slow storage) costs more than the gate "
        "assumes."
    )


def _error(actual: float | None, forecast: float | None) -> float | None:
    """actual / forecast - 1 (None where either is missing or zero)."""
    return num(actual / forecast - 1, 4) if actual and forecast else None


def forecast_section(s: Summary) -> str:
    f = s.forecast
    if not f:
        return section("forecast", "Forecast against actual", note("not available: no forecast in gate.json"))
    fc, act, err = f.forecast, f.actual, f.error

    def row(label: str, forecast, actual, error, digits: int | None) -> list:
        def shown(v):
            return "n/a" if v is None else duration(v) if digits is None else fmt(v, digits)

        return [label, shown(forecast), shown(actual), "n/a" if error is None else pct(error)]

    hours = "GPU-hours (job time x GPUs)" if s.gpus else "rank-hours (job time x ranks)"
    rows = [
        row(
            "job time (start to export" + ("; the last attempt's" if resumed(s) else "") + ")",
            fc and fc.wall_s,
            act and act.wall_s,
            err and err.wall_s,
            None,
        ),
        row(hours, fc and fc.gpu_hours, act and act.gpu_hours, err and err.gpu_hours, 4),
        row("energy (kWh, GPUs)", fc and fc.kwh, act and act.kwh, err and err.kwh, 4),
    ]
    text = (
        (
            f"The gate's forecast ({fc.source}: {fc.detail}) beside what the run measured (TRAINED job_s: "
            "rank 0's process from start to the end of export)."
        )
        if fc
        else "No forecast."
    )
    body = f"<p>{escape(text)}</p>" + table(["", "forecast", "actual", "error"], rows, {1, 2, 3})
    miss = forecast_miss(s)
    if miss:
        body += f'<p class="highlight">{escape(miss)}</p>'
    if f.failure:
        body += f"<p>{escape('Gate: ' + f.failure)}</p>"
    segs = s.segments
    if len(segs) > 1:
        body += "<h3>World size over the run</h3>" + table(
            ["steps", "ranks", "optimizer steps", "tokens"],
            [[f"{g.first_step}-{g.last_step}", g.world_size, g.steps, g.tokens] for g in segs],
            {1, 2, 3},
        )
    return section("forecast", "Forecast against actual", body)


def memory_record(trained: Trained | None, gate: UsableGate | None) -> MemoryCard | None:
    """Measured peaks per phase (TRAINED, max over ranks) beside the gate's estimate of the same phase.

    The gate estimates device memory per rank (on CPU runs the device is the host) and host RAM per
    node; measured host peaks are per rank, so the node figure is the sum over the node's ranks.
    """
    trained = trained or Trained()
    measured = trained.memory
    estimates = gate.memory_estimate_phases if gate is not None else {}
    if measured is None and not estimates:
        return None
    worst = measured.max_over_ranks if measured is not None else {}
    gib = float(1 << 30)
    rows = []
    for phase in MEMORY_PHASES:
        m, e = worst.get(phase) or PhasePeak(), estimates.get(phase) or PhaseEstimate()
        rows.append(
            MemoryPhase(
                phase=phase,
                seconds=num(m.seconds, 3),
                measured_host_peak_gib=num(m.host_peak_gib, 4),
                measured_device_peak_gib=num(m.cuda_peak_gib, 4),
                estimated_device_gib=num(e.total_bytes / gib, 4) if e.total_bytes else None,
                usable_device_gib=num(e.usable_bytes / gib, 4) if e.usable_bytes else None,
                largest_term=max(e.terms_bytes, key=e.terms_bytes.__getitem__) if e.terms_bytes else None,
            )
        )
    per_host: dict[str, float] = {}
    for r in measured.per_rank if measured is not None else ():
        peak = max((p.host_peak_gib or 0.0) for p in r.phases.values()) if r.phases else 0.0
        per_host[str(r.host)] = per_host.get(str(r.host), 0.0) + peak
    host = estimates.get(PHASE_HOST) or PhaseEstimate()
    return MemoryCard(
        phases=tuple(rows),
        measured_host_per_node_gib={h: num(v, 4) for h, v in sorted(per_host.items())},
        estimated_host_per_node_gib=num(host.total_bytes / gib, 4) if host.total_bytes else None,
        host_budget_gib=num(host.usable_bytes / gib, 4) if host.usable_bytes else None,
        load_s=num(trained.load_s, 3),
        export_s=num(trained.export_s, 3),
        export_dtype=trained.export_dtype,
    )


def memory_section(s: Summary) -> str:
    m = s.memory
    if m is None:
        return section(
            "memory", "Memory: measured and estimated", note("not available: no TRAINED memory or gate.json")
        )
    rows = [
        [
            r.phase,
            fmt(r.seconds, 2, " s"),
            fmt(r.measured_host_peak_gib, 2, " GiB"),
            fmt(r.measured_device_peak_gib, 2, " GiB"),
            fmt(r.estimated_device_gib, 2, " GiB"),
            fmt(r.usable_device_gib, 2, " GiB"),
            r.largest_term or "-",
        ]
        for r in m.phases
    ]
    measured_nodes = ", ".join(f"{h} {fmt(v, 2, ' GiB')}" for h, v in m.measured_host_per_node_gib.items()) or "n/a"
    text = (
        f"Host RAM per node: measured {measured_nodes} (sum of the node's ranks' peaks); gate estimate "
        f"{fmt(m.estimated_host_per_node_gib, 2, ' GiB')} of {fmt(m.host_budget_gib, 2, ' GiB')} usable. "
        f"Export dtype {m.export_dtype or 'n/a'}. Device peaks are per rank (on CPU runs the device is "
        "the host); measured values are the maximum over ranks"
        + (" in the last attempt (TRAINED is its record; a failed attempt records none)." if resumed(s) else ".")
    )
    return section(
        "memory",
        "Memory: measured and estimated",
        f"<p>{escape(text)}</p>"
        + table(
            [
                "phase",
                "time",
                "host peak / rank",
                "device peak / rank",
                "gate estimate / rank",
                "usable / rank",
                "largest estimated term",
            ],
            rows,
            numeric={1, 2, 3, 4, 5},
        ),
    )


def watcher_record(watcher: WatcherRecord | None) -> WatcherCard | None:
    """summary.json `watcher`: watcher.json's verdict fields that it holds."""
    if watcher is None:
        return None
    return WatcherCard(
        verdict=watcher.verdict,
        cost=watcher.cost,
        reason=watcher.reason,
        action=watcher.action,
        stalled_for_s=watcher.stalled_for_s,
        longest_stall_s=watcher.longest_stall_s,
        limit_s=watcher.limit_s,
        limit_phase=watcher.limit_phase,
        stuck_ranks=watcher.stuck_ranks,
        ran_ahead=watcher.ran_ahead,
        behind=watcher.behind,
        power_signal=watcher.power_signal,
        detected_at=watcher.detected_at,
        started=watcher.started,
        ended=watcher.ended,
        table=watcher.table,
    )


def watcher_section(s: Summary) -> str:
    w = s.watcher
    if w is None:
        return section("watcher", "Watcher diagnosis", note("not available: no watcher.json"))
    rows: list[list[object]] = [["cost", w.cost.line]] if w.cost else []
    for value, label in (
        (w.verdict, "verdict"),
        (w.reason, "reason"),
        (w.action, "action"),
        (w.stalled_for_s, "stalled for (s)"),
        (w.longest_stall_s, "longest stall seen (s)"),
        (w.limit_s, "limit (s)"),
        (w.limit_phase, "limit phase"),
        (w.stuck_ranks, "stuck ranks"),
        (w.ran_ahead, "ran ahead"),
        (w.behind, "behind"),
        (w.power_signal, "power signal"),
        (w.table, "triage table"),
    ):
        if value not in (None, (), "", ABSENT):
            rows.append([label, short_list(value, 32) if isinstance(value, tuple) else value])
    return section("watcher", "Watcher diagnosis", table(["field", "value"], rows))


def power_only_record(inputs: RunInputs, sig: Signals, found: list, t0: float | None) -> PowerOnlyCard | None:
    """Without heartbeats the pauses rest on power alone: what was missing, what could not be told
    apart, the wait rule, the verdict, and where an imported trace came from."""
    if sig.heartbeats or not sig.phases:
        return None
    had = dict(  # the signals power_only.limits weighs
        heartbeats=sig.heartbeats,
        metrics=sig.metrics,
        util=sig.util,
        gate=sig.gate,
        watcher=sig.watcher,
        energy_counter=sig.energy_counter,
        trained=sig.trained,
        config=sig.config,
    )
    inferred = any(m.gpu_index_inferred for m in inputs.trace_metas)
    limits = power_only.limits(had, inputs.deadlock_after_s, inferred)  # mode, missing, cannot_tell, wait_rule
    imported = tuple(
        ImportedTrace(
            file=str(p),
            source=m.source,
            notes=tuple(m.notes or ()),
            skipped_lines=m.skipped_lines or {},
            gpu_index_inferred=bool(m.gpu_index_inferred),
        )
        for p, m in zip(inputs.trace_paths, inputs.trace_metas)
        if m.power_source == "imported"
    )
    return PowerOnlyCard(
        **limits,
        verdict=tuple(power_only.verdict(found, t0, inputs.window_s)),
        deadlock_after_s=inputs.deadlock_after_s,
        imported=imported,
    )


def power_only_section(s: Summary) -> str:
    """The verdict on power alone: the pauses, what was missing, what it could not tell apart, the rule."""
    po = s.power_only
    if not po:
        return ""
    title = "Power-only verdict" if po.mode == "power only" else "Verdict without heartbeats"
    body = "<ul>" + "".join(f"<li><b>{escape(v)}</b></li>" for v in po.verdict) + "</ul>"
    pauses = s.pauses
    if pauses:
        rows = [
            [
                p.kind,
                utc_of(p.start),
                duration(p.start_offset_s),
                duration(p.duration_s),
                short_list(p.waiting),
                short_list(p.idle),
                "-" if not p.power_w else f"{p.power_w[0]:.0f}-{p.power_w[1]:.0f}",
                fmt(p.util_waiting, 0, "%"),
                fmt(p.util_idle, 0, "%"),
                "no: runs to the end of the trace" if p.open else "yes",
            ]
            for p in pauses[:200]
        ]
        body += table(
            [
                "pause",
                "start (UTC)",
                "from start",
                "duration",
                "waiting GPUs",
                "idle GPUs",
                "waiting power (W)",
                "util waiting",
                "util idle",
                "ended",
            ],
            rows,
            {2, 3, 6, 7, 8},
        )
    body += "<h3>Missing signals</h3><ul>" + "".join(f"<li>{escape(m)}</li>" for m in po.missing) + "</ul>"
    body += (
        "<h3>What it therefore could not tell apart</h3><ul>"
        + "".join(f"<li>{escape(c)}</li>" for c in po.cannot_tell)
        + "</ul>"
    )
    body += f'<h3>The wait rule</h3><p id="wait-rule">{escape(po.wait_rule)}</p>'
    for imp in po.imported:
        skipped = sum(imp.skipped_lines.values())
        extra = [f"{skipped} unreadable line(s) skipped"] if skipped else []
        body += note(f"Imported from {imp.source}: {imp.file}. " + " ".join(f"{x}." for x in extra + list(imp.notes)))
    return section("power-only", title, body)

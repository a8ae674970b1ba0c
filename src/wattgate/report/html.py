"""index.html: one self-contained page (inline CSS; Plotly figures, plotly.js embedded in the page: no external URL)."""

from __future__ import annotations

from html import escape

from wattgate.power.triage.phases import LABELS
from wattgate.records.summary import Energy, GpuPhases, NodePhases, Stragglers, Summary, Validation
from wattgate.records.triage import Gaps
from wattgate.report.cards import (
    resumed,
    short_list,
    gate_section,
    forecast_section,
    memory_section,
    watcher_section,
    power_only_section,
)
from wattgate.durations import duration
from wattgate.report.figures import Figures
from wattgate.report.stragglers import straggler_section
from wattgate.report.markup import Raw, badge, fmt, note, pct, phase_name, section, table
from wattgate.report.plotly_page import LOADER, figure_element, plotly_js_element

CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
main{max-width:1180px;margin:0 auto;padding:20px 28px 40px}
h1{font-size:24px;margin:8px 0 4px}h2{font-size:18px;margin:0 0 10px;border-bottom:1px solid #dde1e7;padding-bottom:6px}
section{background:#fff;border:1px solid #dde1e7;border-radius:8px;padding:16px 20px;margin:16px 0}
.sub{color:#5a6475;margin:0 0 12px}.badges span{display:inline-block;padding:3px 10px;border-radius:12px;
margin:0 8px 6px 0;font-weight:600;font-size:13px}.ok{background:#dcf3e3;color:#135e2c}
.bad{background:#fbe0e0;color:#8a1414}.na{background:#eceef2;color:#505a6b}.warn{background:#fff1d6;color:#7a4b00}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:10px;margin-top:10px}
.card{background:#f3f5f8;border-radius:6px;padding:8px 10px}.card b{display:block;font-size:17px}
.card small{color:#5a6475}table{border-collapse:collapse;font-size:13px;margin:8px 0;width:100%}
th,td{border-bottom:1px solid #e5e8ed;padding:4px 8px;text-align:left;vertical-align:top}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f5f8}
div.figure{width:100%;margin:6px 0}.note{color:#5a6475;font-size:13px}
.notes li{color:#6b5200}.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
#no-gpu-telemetry{border-left:5px solid #e0a800}code{background:#f0f2f5;padding:0 3px;border-radius:3px}
.highlight{border-left:5px solid #e0a800;padding:4px 10px;background:#fff8e1}
"""


def header(s: Summary) -> str:
    run = s.run
    gate, watcher = s.gate, s.watcher
    if gate is None:
        g = badge("gate", "not available", "na")
    elif gate.passed:
        g = badge("gate", "passed", "ok")
    elif gate.passed is None:
        g = badge("gate", "unknown: gate.json damaged", "na")
    else:
        g = badge("gate", "FAILED: " + ", ".join(gate.failed_checks), "bad")
    if watcher is None:
        w = badge("watcher", "not available", "na")
    else:
        v = watcher.verdict
        w = badge("watcher", v, "ok" if v in ("healthy", "running") else "warn" if v == "stopped" else "bad")
    kinds = sorted({a.kind for a in s.anomalies})
    n = len(s.anomalies) + s.anomalies_omitted
    a = badge("anomalies", f"{n} ({', '.join(kinds)})" if n else "none", "warn" if n else "ok")
    device = f"device {run.device}" if run.device else ""
    names = ", ".join(run.gpu_names) or run.gpu_model or ""
    sub = " · ".join(
        x
        for x in [
            device,
            names,
            f"world size {fmt(s.world_size)}",
            f"{s.gpus} GPU(s) in the traces",
            f"started {run.start_utc or 'n/a'}",
        ]
        if x
    )
    e = s.energy
    loss = s.loss
    cards = [
        ("tokens", fmt(s.tokens)),
        ("steps", fmt(s.steps)),
        ("training time", duration(s.wall_s)),
        # the forecast's measure (TRAINED job_s: start to the end of export), so the card below it agrees
        (
            "job time (last attempt)" if resumed(s) else "job time",
            duration(s.forecast.actual.wall_s) if s.forecast and s.forecast.actual else "n/a",
        ),
        ("tokens/s", fmt(s.tokens_per_s, 0)),
        (
            "tokens/s per GPU" if s.gpus else "tokens/s per rank",
            fmt(s.tokens_per_s_per_gpu if s.gpus else s.tokens_per_s_per_rank, 0),
        ),
        ("energy", fmt(e.kwh, 4, " kWh") + (f" ({e.method.replace('_', ' ')})" if e.method else "")),
        ("J per token", fmt(e.j_per_token, 4)),
        *([("GPU-hours", fmt(s.gpu_hours, 4))] if s.gpus else []),  # a CPU run has rank-hours only
        ("waited for stragglers", _waited(s.stragglers)),
        ("rank-hours (training)", fmt(s.rank_hours, 4)),
        ("loss first → final", f"{fmt(loss.first, 4)} → {fmt(loss.final, 4)}"),
        ("MFU", pct(s.mfu) or "n/a"),
        _peak_memory(s),
    ]
    # a card without a value is left out, and named once below the others: no grid of n/a
    shown = [(k, v) for k, v in cards if not v.startswith("n/a")]
    missing = [k for k, v in cards if v.startswith("n/a")]
    grid = "".join(f'<div class="card"><small>{escape(k)}</small><b>{escape(v)}</b></div>' for k, v in shown)
    if missing:
        grid += f'<p class="note" style="grid-column:1/-1">Not measured in this run: {escape(", ".join(missing))}.</p>'
    notes = ""
    if s.notes:
        notes = '<ul class="notes">' + "".join(f"<li>{escape(x)}</li>" for x in s.notes) + "</ul>"
    return (
        f'<header><h1>wattgate report: {escape(run.name)}</h1><p class="sub">{escape(sub)}</p>'
        f'<div class="badges">{g}{w}{a}</div><div class="grid">{grid}</div>{notes}</header>'
    )


def _peak_memory(s: Summary) -> tuple[str, str]:
    """The header's memory card: the device peak (TRAINED, max over ranks), else on a CPU run the host peak per rank
    the Memory section shows (the same number, from the same record). TRAINED is the last attempt's: a failed
    attempt records no peak, so a resumed run's card says whose peak it is."""
    whose = " (last attempt)" if resumed(s) else ""
    if s.peak_memory_gib is not None:
        return f"peak device memory{whose}", fmt(s.peak_memory_gib, 2, " GiB")
    phases = s.memory.phases if s.memory else ()
    host = [p.measured_host_peak_gib for p in phases if p.measured_host_peak_gib is not None]
    return f"peak host memory per rank{whose}", fmt(max(host), 2, " GiB") if host else "n/a"


def _waited(st: Stragglers) -> str:
    """The header card: GPU-hours the run spent waiting for stragglers (rank-hours on CPU), or none."""
    if not st.checked:
        return "n/a"
    if not st.entries:
        return "none"
    if st.wait_gpu_hours:
        return fmt(st.wait_gpu_hours, 4, " GPU-h")
    return fmt(st.wait_rank_hours, 4, " rank-h")


def power_section(s: Summary, fig: dict | None, panels_shown: int) -> str:
    sig = s.signals
    if fig is None:
        why = (
            "the telemetry traces hold no rows: the sampler found no NVML on this host (a CPU run), "
            "so it wrote an empty trace with the schema."
            if sig.traces
            else "the run folder has no telemetry/*.parquet traces."
        )
        nvml = s.run.nvml
        if nvml:
            why += f" The sampler said: {nvml}."
        body = (
            f"<p><b>No power, energy or phase data:</b> {escape(why)}</p>"
            "<p>Every other section below comes from the run's metrics, heartbeats, TRAINED, the gate and "
            "the watcher and is complete where those exist. Throughput per rank stands in for per GPU.</p>"
        )
        return section("no-gpu-telemetry", "No GPU telemetry on this host", body)
    source = s.phases.source or "no phases (triage could not run): raw power, uncoloured"
    more = "" if panels_shown >= s.gpus else f" First {panels_shown} of {s.gpus} GPUs shown."
    # only what the figure draws: shading and step ends need heartbeats and metrics, which a power-only run lacks
    shaded = " Shaded: checkpoint intervals from the heartbeat events." if s.signals.heartbeats else ""
    steps = " Top row: step ends from metrics." if s.signals.metrics else ""
    phased = bool(s.phases.by_phase)
    caption = (
        "One row per GPU, each with its watt axis, all on one scale, and one time axis (zoom by dragging; "
        "double-click to zoom out): the line is the mean power in each time bin"
        + (
            ", coloured by the phase that holds most of the bin's time, and the strip under it is the same "
            "phase per bin; the grey band, where a bin holds several windows, spans their lowest and highest "
            "mean power."
            if phased
            else "; the grey band, where a bin holds several samples, spans their lowest and highest power."
        )
        + f"{shaded}{steps} Hovering a line shows the bin's watts"
        + (", phase" if phased else "")
        + (" and step" if s.signals.metrics else "")
        + f". Phases: {source}.{more}"
    )
    return section(
        "power", "Power per GPU over time", figure_element(fig, "power", "power per GPU over time") + note(caption)
    )


def gaps_text(g: Gaps | None) -> str:
    """The telemetry gaps in one sentence: unknown time is time no sample covers."""
    if not g:
        return ""
    if not g.unknown_s:
        text = "Telemetry gaps: none unknown"
    else:
        text = (
            f"Telemetry gaps: {g.unknown_s:.0f} GPU-seconds unknown (no sample; {g.unknown_gaps} gap(s), "
            f"longest {g.longest_gap_s:.0f} s)"
        )
    if g.filled_s:
        text += f"; {g.filled_s:.0f} s of gaps of a few sampling periods took the phase around them"
    return text + "."


def phase_tables(s: Summary, fig: dict | None) -> str:
    p = s.phases
    if not p.by_phase:
        return section(
            "phases",
            "Phase breakdown",
            note("not available: no phase windows (no GPU telemetry, or triage could not pick a table)"),
        )
    rows = [
        [phase_name(ph), fmt(v.seconds, 0), pct(v.time_share), fmt(v.energy_kwh, 4), pct(v.energy_share)]
        for ph, v in _in_label_order(p.by_phase)
    ]
    overall = table(["phase", "GPU-seconds", "time share", "energy (kWh)", "energy share"], rows, {1, 2, 3, 4})
    present = [ph for ph in LABELS if ph in p.by_phase]

    def breakdown(items: tuple[GpuPhases | NodePhases, ...], first: list[str], lead) -> str:
        headers = first + [f"{ph} time" for ph in present] + ["energy (kWh)"]
        body = [
            lead(r)
            + [pct(r.time_share.get(ph, 0.0)) for ph in present]
            + [fmt(sum(v for v in r.energy_kwh.values() if v is not None), 4)]
            for r in items
        ]
        return table(headers, body, set(range(len(first), len(headers))))

    per_node = breakdown(p.per_node, ["node", "GPUs"], lambda r: [r.host, r.gpus])
    per_gpu = breakdown(p.per_gpu, ["node", "GPU"], lambda r: [r.host, r.gpu])
    shares = figure_element(fig, "phase-share", "phase shares per GPU") if fig else ""
    text = (
        f"Windows of {p.window_s:g} s labelled by power triage ({p.source}). Energy per phase is "
        "each window's mean power times its length. " + gaps_text(p.gaps)
    )
    return section(
        "phases",
        "Phase breakdown",
        note(text)
        + shares
        + "<h3>All GPUs</h3>"
        + overall
        + "<h3>Per node</h3>"
        + per_node
        + "<h3>Per GPU</h3>"
        + per_gpu,
    )


def _in_label_order(d: dict):
    return [(ph, d[ph]) for ph in LABELS if ph in d]


def energy_section(s: Summary) -> str:
    e: Energy = s.energy
    if e.kwh is None:
        return section("energy", "Energy", note("not available: no power samples"))
    text = {
        "energy_counter": "NVML total-energy counter (last minus first reading per GPU; the seconds before "
        "the first and after the last reading integrated from power)",
        "integrated_power": "power integrated over time (trapezoid per GPU): the trace has no energy counter",
        "mixed": "the energy counter where a GPU has one, integrated power elsewhere",
        "phase_window_means": "window mean power times window length (no raw trace)",
    }.get(e.method or "", "")
    check = ""
    if e.counter_kwh is not None and e.integrated_kwh:
        diff = e.counter_kwh / e.integrated_kwh - 1
        check = (
            f" Counter {fmt(e.counter_kwh, 5)} kWh vs integrated power {fmt(e.integrated_kwh, 5)} kWh "
            f"({100 * diff:+.2f}%)."
        )
    rows = [
        [r.host, r.gpu, fmt(r.kwh, 5), fmt(r.mean_power_w, 1), duration(r.span_s), r.method.replace("_", " ")]
        for r in e.per_gpu
    ]
    body = note(
        f"Total {fmt(e.kwh, 5)} kWh by {text}; {fmt(e.j_per_token, 4)} J per token (every traced "
        f"second, start-up and teardown included, over the tokens trained).{check}"
        + (
            f" {duration(e.gap_s)} of gaps between samples are counted nowhere (no energy, no GPU-hours)."
            if e.gap_s
            else ""
        )
    )
    if rows:
        body += table(["node", "GPU", "energy (kWh)", "mean power (W)", "traced for", "method"], rows, {1, 2, 3})
    return section("energy", "Energy", body)


def figure_section(sid: str, title: str, fig: dict | None, missing: str, caption: str = "") -> str:
    if fig is None:
        return section(sid, title, note(f"not available: {missing}"))
    return section(sid, title, figure_element(fig, sid, title) + (note(caption) if caption else ""))


def validation_section(v: Validation | None) -> str:
    """Every validation pass: the held-out documents' loss after its step, the best one marked."""
    if not v:
        return ""
    best = v.best.step if v.best is not None else None
    sources = v.sources or ()  # two or more held-out sources: each one's loss beside the whole's
    rows = [
        [
            f"{r.step}" + (" (best)" if r.step == best else ""),
            r.epoch,
            fmt(r.loss, 4),
            *(fmt((r.per_source or {}).get(name), 4) for name in sources),
            fmt(r.perplexity, 4),
            r.tokens,
            duration(r.seconds),
        ]
        for r in v.passes
    ]
    heads = ["after step", "epoch", "loss", *(f"loss: {name}" for name in sources), "perplexity", "tokens", "time"]
    body = table(heads, rows, set(range(1, 5 + len(sources))))
    if sources:
        body += note(
            "loss: every held-out document; loss: <source>: that source's held-out documents alone (its summed "
            "token losses / its loss tokens, over every rank)."
        )
    return section("validation", "Validation", body)


def anomalies_section(s: Summary) -> str:
    rows = s.anomalies
    checked = (
        "Checked: hangs (deadlock windows from power triage, the watcher's verdict), data starvation "
        "(data_starvation runs of >= 5 s, steps waiting >= 20% for data) and stragglers (a rank's median "
        "step time less data wait >= 1.10x the median over ranks; the GPU or rank the others waited for, from "
        "power triage or the watcher: see Stragglers)."
    )
    if not rows:
        return section("anomalies", "Anomalies", note("None found. " + checked))
    body = table(
        ["kind", "start (UTC)", "from run start", "duration", "GPUs", "ranks", "evidence"],
        [
            [
                a.kind,
                a.start_utc,
                duration(a.start_offset_s),
                duration(a.duration_s),
                short_list(a.gpus),
                short_list(a.ranks),
                a.detail,
            ]
            for a in rows
        ],
        {2, 3},
    )
    more = f" {s.anomalies_omitted} more are not listed." if s.anomalies_omitted else ""
    return section("anomalies", "Anomalies", body + note(checked + more))


def inputs_section(s: Summary) -> str:
    sig = s.signals.to_json()  # each input by name, as summary.json names it
    rows = [[k.replace("_", " "), Raw("<b>yes</b>" if v else "no")] for k, v in sorted(sig.items())]
    ck = s.checkpoints
    steps = ", ".join(str(x) for x in ck.steps) or "none"
    if s.run.dir is None:
        text = f"No run folder: traces {', '.join(s.run.traces)} only."
    else:
        text = f"Run folder {s.run.dir}. Checkpoints kept: {steps}; final export: {'yes' if ck.final else 'no'}."
    return section("inputs", "Inputs", note(text) + table(["input", "present"], rows))


def render_page(s: Summary, figures: Figures, panels_shown: int) -> str:
    body = "".join(
        [
            header(s),
            power_only_section(s),
            power_section(s, figures.power, panels_shown),
            phase_tables(s, figures.phase_share),
            energy_section(s),
            straggler_section(s, figures.lag),
            figure_section(
                "steps",
                "Step time and data wait over time",
                figures.steps,
                "no step_time_s in metrics.parquet (or no metrics)",
                "Per step: the slowest rank's step time and the mean data wait over ranks; shaded: "
                "checkpoint intervals."
                + (" Dotted: where a later attempt began (the run was resumed)." if figures.later_attempts else ""),
            ),
            figure_section(
                "loss",
                "Loss",
                figures.loss,
                "no loss in metrics.parquet (or no metrics)",
                "Training loss per step (grey) and validation loss after each pass (red), both token-weighted over "
                "every rank."
                + (
                    " Dashed: each source's own validation loss (its held-out documents alone)."
                    if s.validation.sources
                    else ""
                )
                if s.validation
                else "",
            ),
            validation_section(s.validation),
            anomalies_section(s),
            gate_section(s),
            forecast_section(s),
            memory_section(s),
            watcher_section(s),
            inputs_section(s),
        ]
    )
    title = escape(f"wattgate report: {s.run.name}")
    # plotly.js only where there is a figure to draw; the loader always runs (it counts the figures drawn)
    plotly_js = plotly_js_element() if figures.has_any() else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title>'
        f"<style>{CSS}</style></head><body><main>{body}"
        '<footer class="note">Written by <code>wattgate report</code>; the numbers are in summary.json.</footer>'
        f"</main>{plotly_js}<script>{LOADER}</script></body></html>\n"
    )

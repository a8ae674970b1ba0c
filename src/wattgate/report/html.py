"""index.html: one self-contained page (inline CSS, figures as inline SVG, no external URL, no script library)."""

from __future__ import annotations

from datetime import datetime, timezone
from html import escape

from wattgate.report.phases import PHASE_COLORS
from wattgate.power.triage.power_only import clock
from wattgate.power.triage.phases import LABELS

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
svg.figure{max-width:100%;height:auto;display:block;margin:6px 0}.note{color:#5a6475;font-size:13px}
.notes li{color:#6b5200}.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
#no-gpu-telemetry{border-left:5px solid #e0a800}code{background:#f0f2f5;padding:0 3px;border-radius:3px}
"""

# counts the figures the browser laid out with something drawn in them: broken markup leaves no box
SCRIPT = (
    "window.addEventListener('load',function(){var f=document.querySelectorAll('svg.figure'),n=0;"
    "for(var i=0;i<f.length;i++){var r=f[i].getBoundingClientRect(),b=f[i].getBBox();"
    "if(r.width>0&&r.height>0&&b.width>0&&b.height>0)n++;}"
    "document.body.setAttribute('data-figures-rendered',n+'/'+f.length);});"
)

# ---------------------------------------------------------------- formatting


def fmt(x, digits: int = 3, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}{unit}"
    return f"{x:,.{digits}f}{unit}" if abs(x) < 1e15 else f"{x:.3g}{unit}"


def pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def duration(s) -> str:
    if s is None:
        return "n/a"
    return f"{float(s):.1f} s" if float(s) < 120 else clock(s)


def table(headers: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    """Cells are escaped unless wrapped in Raw."""
    head = "".join(
        f'<th class="n">{escape(h)}</th>' if i in numeric else f"<th>{escape(h)}</th>" for i, h in enumerate(headers)
    )
    body = []
    for row in rows:
        cells = []
        for i, c in enumerate(row):
            text = c.html if isinstance(c, Raw) else escape(str(c))
            cells.append(f'<td class="n">{text}</td>' if i in numeric else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class Raw:
    def __init__(self, html: str):
        self.html = html


def badge(label: str, value: str, kind: str) -> str:
    return f'<span class="{kind}">{escape(label)}: {escape(value)}</span>'


def figure(svg: str, alt: str) -> str:
    """A figure's SVG markup inline, labelled for screen readers."""
    if not svg.startswith("<svg "):
        raise ValueError("a figure must be <svg> markup")
    return f'<svg class="figure" role="img" aria-label="{escape(alt)}" {svg[5:]}'


def section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2>{body}</section>'


def note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def phase_name(p: str) -> Raw:
    return Raw(f'<span class="swatch" style="background:{PHASE_COLORS.get(p, "#999")}"></span>{escape(p)}')


# ---------------------------------------------------------------- sections


def header(s: dict) -> str:
    run = s["run"]
    gate, watcher = s["gate"], s["watcher"]
    if gate is None:
        g = badge("gate", "not available", "na")
    elif gate["passed"]:
        g = badge("gate", "passed", "ok")
    else:
        g = badge("gate", "FAILED: " + ", ".join(gate["failed_checks"]), "bad")
    if watcher is None:
        w = badge("watcher", "not available", "na")
    else:
        v = str(watcher.get("verdict"))
        w = badge("watcher", v, "ok" if v in ("healthy", "running") else "bad")
    kinds = sorted({a["kind"] for a in s["anomalies"]})
    n = len(s["anomalies"]) + s["anomalies_omitted"]
    a = badge("anomalies", f"{n} ({', '.join(kinds)})" if n else "none", "warn" if n else "ok")
    device = f"device {run['device']}" if run.get("device") else ""
    names = ", ".join(run.get("gpu_names") or []) or run.get("gpu_model") or ""
    sub = " · ".join(
        x
        for x in [
            device,
            names,
            f"world size {fmt(s['world_size'])}",
            f"{s['gpus']} GPU(s) in the traces",
            f"started {run.get('start_utc') or 'n/a'}",
        ]
        if x
    )
    e = s["energy"]
    loss = s["loss"]
    cards = [
        ("tokens", fmt(s["tokens"])),
        ("steps", fmt(s["steps"])),
        ("wall time", duration(s["wall_s"])),
        ("tokens/s", fmt(s["tokens_per_s"], 0)),
        (
            "tokens/s per GPU" if s["gpus"] else "tokens/s per rank",
            fmt(s["tokens_per_s_per_gpu"] if s["gpus"] else s["tokens_per_s_per_rank"], 0),
        ),
        ("energy", fmt(e["kwh"], 4, " kWh") + (f" ({e['method'].replace('_', ' ')})" if e["method"] else "")),
        ("J per token", fmt(e["j_per_token"], 4)),
        ("GPU-hours", fmt(s["gpu_hours"], 4)),
        ("rank-hours", fmt(s["rank_hours"], 4)),
        ("loss first → final", f"{fmt(loss['first'], 4)} → {fmt(loss['final'], 4)}"),
        ("MFU", pct(s["mfu"]) or "n/a"),
        ("peak memory", fmt(s["peak_memory_gib"], 2, " GiB")),
    ]
    grid = "".join(f'<div class="card"><small>{escape(k)}</small><b>{escape(v)}</b></div>' for k, v in cards)
    notes = ""
    if s["notes"]:
        notes = '<ul class="notes">' + "".join(f"<li>{escape(x)}</li>" for x in s["notes"]) + "</ul>"
    return (
        f'<header><h1>wattgate report: {escape(run["name"])}</h1><p class="sub">{escape(sub)}</p>'
        f'<div class="badges">{g}{w}{a}</div><div class="grid">{grid}</div>{notes}</header>'
    )


def power_section(s: dict, svg: str | None, panels_shown: int) -> str:
    sig = s["signals"]
    if svg is None:
        why = (
            "the telemetry traces hold no rows: the sampler found no NVML on this host (a CPU run), "
            "so it wrote an empty trace with the schema."
            if sig["traces"]
            else "the run folder has no telemetry/*.parquet traces."
        )
        nvml = s["run"].get("nvml")
        if nvml:
            why += f" The sampler said: {nvml}."
        body = (
            f"<p><b>No power, energy or phase data:</b> {escape(why)}</p>"
            "<p>Every other section below comes from the run's metrics, heartbeats, TRAINED, the gate and "
            "the watcher and is complete where those exist. Throughput per rank stands in for per GPU.</p>"
        )
        return section("no-gpu-telemetry", "No GPU telemetry on this host", body)
    p = s["phases"]
    source = p.get("source") or "no phases (triage could not run): raw power, uncoloured"
    more = "" if panels_shown >= s["gpus"] else f" First {panels_shown} of {s['gpus']} GPUs shown."
    caption = (
        f"One lane per GPU, all on one power scale (the lane's height, in the time axis label): power, "
        f"each bin coloured by the phase that holds most of its time; the strip at the bottom of each lane "
        f"is the same phase per bin. Shaded: checkpoint intervals from the heartbeat events. Top row: step "
        f"ends from metrics. Phases: {source}.{more}"
    )
    return section("power", "Power per GPU over time", figure(svg, "power per GPU over time") + note(caption))


def gaps_text(g: dict | None) -> str:
    """The telemetry gaps in one sentence: unknown time is time no sample covers."""
    if not g:
        return ""
    if not g["unknown_s"]:
        text = "Telemetry gaps: none unknown"
    else:
        text = (
            f"Telemetry gaps: {g['unknown_s']:.0f} GPU-seconds unknown (no sample; {g['unknown_gaps']} gap(s), "
            f"longest {g['longest_gap_s']:.0f} s)"
        )
    if g.get("filled_s"):
        text += f"; {g['filled_s']:.0f} s of gaps of a few sampling periods took the phase around them"
    return text + "."


def phase_tables(s: dict, svg: str | None) -> str:
    p = s["phases"]
    if not p.get("by_phase"):
        return section(
            "phases",
            "Phase breakdown",
            note("not available: no phase windows (no GPU telemetry, or triage could not pick a table)"),
        )
    rows = [
        [phase_name(ph), fmt(v["seconds"], 0), pct(v["time_share"]), fmt(v["energy_kwh"], 4), pct(v["energy_share"])]
        for ph, v in _in_label_order(p["by_phase"])
    ]
    overall = table(["phase", "GPU-seconds", "time share", "energy (kWh)", "energy share"], rows, {1, 2, 3, 4})
    present = [ph for ph in LABELS if ph in p["by_phase"]]

    def breakdown(items, first: list[str], lead) -> str:
        headers = first + [f"{ph} time" for ph in present] + ["energy (kWh)"]
        body = [
            lead(r)
            + [pct(r["time_share"].get(ph, 0.0)) for ph in present]
            + [fmt(sum(v for v in r["energy_kwh"].values() if v is not None), 4)]
            for r in items
        ]
        return table(headers, body, set(range(len(first), len(headers))))

    per_node = breakdown(p["per_node"], ["node", "GPUs"], lambda r: [r["host"], r["gpus"]])
    per_gpu = breakdown(p["per_gpu"], ["node", "GPU"], lambda r: [r["host"], r["gpu"]])
    shares = figure(svg, "phase shares per GPU") if svg else ""
    text = (
        f"Windows of {p['window_s']:g} s labelled by power triage ({p.get('source')}). Energy per phase is "
        "each window's mean power times its length. " + gaps_text(p.get("gaps"))
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


def energy_section(s: dict) -> str:
    e = s["energy"]
    if e["kwh"] is None:
        return section("energy", "Energy", note("not available: no power samples"))
    text = {
        "energy_counter": "NVML total-energy counter (last minus first reading per GPU; the seconds before "
        "the first and after the last reading integrated from power)",
        "integrated_power": "power integrated over time (trapezoid per GPU): the trace has no energy counter",
        "mixed": "the energy counter where a GPU has one, integrated power elsewhere",
        "phase_window_means": "window mean power times window length (no raw trace)",
    }.get(e["method"], "")
    check = ""
    if e.get("counter_kwh") is not None and e.get("integrated_kwh"):
        diff = e["counter_kwh"] / e["integrated_kwh"] - 1
        check = (
            f" Counter {fmt(e['counter_kwh'], 5)} kWh vs integrated power {fmt(e['integrated_kwh'], 5)} kWh "
            f"({100 * diff:+.2f}%)."
        )
    rows = [
        [
            r["host"],
            r["gpu"],
            fmt(r["kwh"], 5),
            fmt(r["mean_power_w"], 1),
            duration(r["span_s"]),
            r["method"].replace("_", " "),
        ]
        for r in e["per_gpu"]
    ]
    body = note(
        f"Total {fmt(e['kwh'], 5)} kWh by {text}; {fmt(e['j_per_token'], 4)} J per token (every traced "
        f"second, start-up and teardown included, over the tokens trained).{check}"
        + (
            f" {duration(e['gap_s'])} of gaps between samples are counted nowhere (no energy, no GPU-hours)."
            if e.get("gap_s")
            else ""
        )
    )
    if rows:
        body += table(["node", "GPU", "energy (kWh)", "mean power (W)", "traced for", "method"], rows, {1, 2, 3})
    return section("energy", "Energy", body)


def figure_section(sid: str, title: str, svg: str | None, missing: str, caption: str = "") -> str:
    if svg is None:
        return section(sid, title, note(f"not available: {missing}"))
    return section(sid, title, figure(svg, title) + (note(caption) if caption else ""))


def validation_section(s: dict) -> str:
    """Every validation pass: the held-out documents' loss after its step, the best one marked."""
    v = s.get("validation")
    if not v:
        return ""
    best = (v.get("best") or {}).get("step")
    rows = [
        [
            f"{r['step']}" + (" (best)" if r["step"] == best else ""),
            r["epoch"],
            fmt(r["loss"], 4),
            fmt(r["perplexity"], 4),
            r["tokens"],
            duration(r["seconds"]),
        ]
        for r in v["passes"]
    ]
    body = table(["after step", "epoch", "loss", "perplexity", "tokens", "time"], rows, {1, 2, 3, 4})
    return section("validation", "Validation", body)


def anomalies_section(s: dict) -> str:
    rows = s["anomalies"]
    checked = (
        "Checked: hangs (deadlock windows from power triage, the watcher's verdict), data starvation "
        "(data_starvation runs of >= 5 s, steps waiting >= 20% for data) and stragglers (a rank's median "
        "step time less data wait >= 1.10x the median over ranks)."
    )
    if not rows:
        return section("anomalies", "Anomalies", note("None found. " + checked))
    body = table(
        ["kind", "start (UTC)", "from run start", "duration", "GPUs", "ranks", "evidence"],
        [
            [
                a["kind"],
                a["start_utc"],
                duration(a["start_offset_s"]),
                duration(a["duration_s"]),
                _short_list(a["gpus"]),
                _short_list(a["ranks"]),
                a["detail"],
            ]
            for a in rows
        ],
        {2, 3},
    )
    more = f" {s['anomalies_omitted']} more are not listed." if s["anomalies_omitted"] else ""
    return section("anomalies", "Anomalies", body + note(checked + more))


def _short_list(items: list, limit: int = 8) -> str:
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "") if items else "-"


def gate_section(s: dict) -> str:
    g = s["gate"]
    if g is None:
        return section("gate", "Invariant gate", note("not available: no gate.json"))
    verdict = "passed" if g["passed"] else "FAILED"
    went_ahead = not g["passed"] and g.get("enforce") is False
    enforce = " (gate.enforce was false: the run went ahead anyway)" if went_ahead else ""
    mark = {True: '<b style="color:#135e2c">pass</b>', False: '<b style="color:#8a1414">FAIL</b>'}
    rows = [[c["name"], Raw(mark[c["passed"]]), c["detail"]] for c in g["checks"]]
    return section(
        "gate",
        "Invariant gate",
        f"<p>Gate <b>{verdict}</b>{escape(enforce)}.</p>" + table(["check", "result", "detail"], rows),
    )


def forecast_section(s: dict) -> str:
    f = s.get("forecast")
    if not f:
        return section("forecast", "Forecast against actual", note("not available: no forecast in gate.json"))
    fc, act, err = f["forecast"], f["actual"], f["error"] or {}
    rows = []
    for key, label, digits in (
        ("wall_s", "wall time", None),
        ("gpu_hours", "GPU-hours", 4),
        ("kwh", "energy (kWh, GPUs)", 4),
    ):

        def shown(v, digits=digits):
            return duration(v) if digits is None else fmt(v, digits)

        rows.append(
            [
                label,
                shown(fc[key]) if fc and fc[key] is not None else "n/a",
                shown(act[key]) if act and act.get(key) is not None else "n/a",
                pct(err.get(key)) if err.get(key) is not None else "n/a",
            ]
        )
    text = (
        (
            f"The gate's forecast ({fc['source']}: {fc['detail']}) beside what the run measured (TRAINED job_s: "
            "rank 0's process from start to the end of export)."
        )
        if fc
        else "No forecast."
    )
    body = f"<p>{escape(text)}</p>" + table(["", "forecast", "actual", "error"], rows, {1, 2, 3})
    if f.get("failure"):
        body += f"<p>{escape('Gate: ' + f['failure'])}</p>"
    segs = s.get("segments") or []
    if len(segs) > 1:
        body += "<h3>World size over the run</h3>" + table(
            ["steps", "ranks", "optimizer steps", "tokens"],
            [[f"{g['first_step']}-{g['last_step']}", g["world_size"], g["steps"], g["tokens"]] for g in segs],
            {1, 2, 3},
        )
    return section("forecast", "Forecast against actual", body)


def memory_section(s: dict) -> str:
    m = s.get("memory")
    if m is None:
        return section(
            "memory", "Memory: measured and estimated", note("not available: no TRAINED memory or gate.json")
        )
    rows = [
        [
            r["phase"],
            fmt(r["seconds"], 2, " s"),
            fmt(r["measured_host_peak_gib"], 2, " GiB"),
            fmt(r["measured_device_peak_gib"], 2, " GiB"),
            fmt(r["estimated_device_gib"], 2, " GiB"),
            fmt(r["usable_device_gib"], 2, " GiB"),
            r["largest_term"] or "-",
        ]
        for r in m["phases"]
    ]
    measured_nodes = ", ".join(f"{h} {fmt(v, 2, ' GiB')}" for h, v in m["measured_host_per_node_gib"].items()) or "n/a"
    text = (
        f"Host RAM per node: measured {measured_nodes} (sum of the node's ranks' peaks); gate estimate "
        f"{fmt(m['estimated_host_per_node_gib'], 2, ' GiB')} of {fmt(m['host_budget_gib'], 2, ' GiB')} usable. "
        f"Export dtype {m['export_dtype'] or 'n/a'}. Device peaks are per rank (on CPU runs the device is "
        "the host); measured values are the maximum over ranks."
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


def watcher_section(s: dict) -> str:
    w = s["watcher"]
    if w is None:
        return section("watcher", "Watcher diagnosis", note("not available: no watcher.json"))
    rows = [["cost", w["cost"]["line"]]] if w.get("cost") else []
    for key, label in (
        ("verdict", "verdict"),
        ("reason", "reason"),
        ("action", "action"),
        ("stalled_for_s", "stalled for (s)"),
        ("longest_stall_s", "longest stall seen (s)"),
        ("limit_s", "limit (s)"),
        ("limit_phase", "limit phase"),
        ("stuck_ranks", "stuck ranks"),
        ("ran_ahead", "ran ahead"),
        ("behind", "behind"),
        ("power_signal", "power signal"),
        ("table", "triage table"),
    ):
        if key in w and w[key] not in (None, [], ""):
            rows.append([label, _short_list(w[key], 32) if isinstance(w[key], list) else w[key]])
    return section("watcher", "Watcher diagnosis", table(["field", "value"], rows))


def power_only_section(s: dict) -> str:
    """The verdict on power alone: the pauses, what was missing, what it could not tell apart, the rule."""
    po = s.get("power_only")
    if not po:
        return ""
    title = "Power-only verdict" if po["mode"] == "power only" else "Verdict without heartbeats"
    body = "<ul>" + "".join(f"<li><b>{escape(v)}</b></li>" for v in po["verdict"]) + "</ul>"
    pauses = s.get("pauses") or []
    if pauses:
        rows = [
            [
                p["kind"],
                utc_of(p["start"]),
                duration(p["start_offset_s"]),
                duration(p["duration_s"]),
                _short_list(p["waiting"]),
                _short_list(p["idle"]),
                "-" if not p["power_w"] else f"{p['power_w'][0]:.0f}-{p['power_w'][1]:.0f}",
                fmt(p["util_waiting"], 0, "%"),
                fmt(p["util_idle"], 0, "%"),
                "no: runs to the end of the trace" if p["open"] else "yes",
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
    body += "<h3>Missing signals</h3><ul>" + "".join(f"<li>{escape(m)}</li>" for m in po["missing"]) + "</ul>"
    body += (
        "<h3>What it therefore could not tell apart</h3><ul>"
        + "".join(f"<li>{escape(c)}</li>" for c in po["cannot_tell"])
        + "</ul>"
    )
    body += f'<h3>The wait rule</h3><p id="wait-rule">{escape(po["wait_rule"])}</p>'
    for imp in po.get("imported") or []:
        skipped = sum((imp.get("skipped_lines") or {}).values())
        extra = [f"{skipped} unreadable line(s) skipped"] if skipped else []
        body += note(
            f"Imported from {imp['source']}: {imp['file']}. "
            + " ".join(f"{x}." for x in extra + list(imp.get("notes") or []))
        )
    return section("power-only", title, body)


def utc_of(t) -> str:
    return "n/a" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def inputs_section(s: dict) -> str:
    sig = s["signals"]
    rows = [[k.replace("_", " "), Raw("<b>yes</b>" if v else "no")] for k, v in sorted(sig.items())]
    ck = s["checkpoints"]
    steps = ", ".join(str(x) for x in ck["steps"]) or "none"
    if s["run"]["dir"] is None:
        text = f"No run folder: traces {', '.join(s['run'].get('traces') or [])} only."
    else:
        text = (
            f"Run folder {s['run']['dir']}. Checkpoints kept: {steps}; final export: {'yes' if ck['final'] else 'no'}."
        )
    return section("inputs", "Inputs", note(text) + table(["input", "present"], rows))


# ---------------------------------------------------------------- the page


def render_page(s: dict, figures: dict[str, str | None], panels_shown: int) -> str:
    body = "".join(
        [
            header(s),
            power_only_section(s),
            power_section(s, figures.get("power"), panels_shown),
            phase_tables(s, figures.get("phase_share")),
            energy_section(s),
            figure_section(
                "steps",
                "Step time and data wait over time",
                figures.get("steps"),
                "no step_time_s in metrics.parquet (or no metrics)",
                "Per step: the slowest rank's step time and the mean data wait over ranks; shaded: "
                "checkpoint intervals.",
            ),
            figure_section(
                "loss",
                "Loss",
                figures.get("loss"),
                "no loss in metrics.parquet (or no metrics)",
                "Training loss per step (grey) and validation loss after each pass (red), both token-weighted over "
                "every rank."
                if s.get("validation")
                else "",
            ),
            validation_section(s),
            anomalies_section(s),
            gate_section(s),
            forecast_section(s),
            memory_section(s),
            watcher_section(s),
            inputs_section(s),
        ]
    )
    title = escape(f"wattgate report: {s['run']['name']}")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title>'
        f"<style>{CSS}</style></head><body><main>{body}"
        '<footer class="note">Written by <code>wattgate report</code>; the numbers are in summary.json.</footer>'
        f"</main><script>{SCRIPT}</script></body></html>\n"
    )

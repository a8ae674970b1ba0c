"""The report's cards from the gate and the run: gate checks, forecast, memory, watcher, power-only verdicts."""

from __future__ import annotations

from html import escape

from wattgate.report.markup import Raw, duration, fmt, note, pct, section, table, utc_of


def short_list(items: list, limit: int = 8) -> str:
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
            rows.append([label, short_list(w[key], 32) if isinstance(w[key], list) else w[key]])
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
                short_list(p["waiting"]),
                short_list(p["idle"]),
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

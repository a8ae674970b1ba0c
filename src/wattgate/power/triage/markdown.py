"""triage.md: the Markdown report of a Triage record (records/triage.py) and its phase summary."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import cast

import pandas as pd

from wattgate.power.triage.phases import LABELS, PHASE, SHARE
from wattgate.records.triage import STATUS_OK, Triage
from wattgate.trace import GPU, HOST


def triage_markdown(result: Triage, summary: pd.DataFrame) -> str:
    lines = ["# Power triage", ""]
    if result.status != STATUS_OK:
        found = _stragglers_md(result) if result.stragglers else []
        return "\n".join(lines + [f"{result.status}.", ""] + found + _notes_md(result))
    t = result.table
    assert t is not None  # a triage with telemetry always has its table
    kind = t.provenance.get("kind", "no provenance")
    lines += [
        f"Table: {t.gpu_model} ({result.table_source}; {kind}), "
        f"windows of {result.window_s:g} s, deadlock after {result.deadlock_after_s:g} s. "
        f"Signals: {', '.join(k for k, v in asdict(result.signals).items() if v) or 'none'}.",
        "",
        "| phase | seconds | share | energy (kJ) |",
        "|---|---:|---:|---:|",
    ]
    for ph in LABELS:
        r = result.phases.get(ph)
        if r:
            assert r.share is not None and r.energy_j is not None  # totals() computes both
            lines.append(f"| {ph} | {r.seconds:.0f} | {100 * r.share:.1f}% | {r.energy_j / 1e3:.1f} |")
    lines += [
        "",
        "Share of each GPU's time:",
        "",
        "| host | gpu | " + " | ".join(LABELS) + " |",
        "|---|---:|" + "---:|" * len(LABELS),
    ]
    pivot = summary.pivot_table(index=[HOST, GPU], columns=PHASE, values=SHARE, fill_value=0.0)
    # the pivot's index: (host, gpu)
    for (host, gpu), row in cast("Iterable[tuple[tuple[str, int], pd.Series]]", pivot.iterrows()):
        lines.append(f"| {host} | {gpu} | " + " | ".join(f"{100 * row.get(ph, 0.0):.1f}%" for ph in LABELS) + " |")
    lines += _gaps_and_peers_md(result)
    lines += _stragglers_md(result)
    po = result.power_only
    if po:
        lines += ["", f"## Power-only verdict ({po.mode})", ""] + [f"- {v}" for v in po.verdict]
        lines += [
            "",
            "Missing: " + "; ".join(po.missing) + "." if po.missing else "Missing: nothing.",
            "",
            "Could therefore not tell apart:",
            "",
        ] + [f"- {c}" for c in po.cannot_tell]
        lines += ["", po.wait_rule]
    return "\n".join(lines + _notes_md(result)) + "\n"


def _stragglers_md(result: Triage) -> list[str]:
    lag, found = result.lag, result.stragglers
    lines = ["", "## Stragglers", ""]
    if not found:
        lines.append(
            "None: no GPU ever waited for a peer long enough to count, so none was a straggler."
            if not lag.wait_windows
            else f"None: in the {lag.wait_windows} window(s) in which GPUs waited for a peer, no GPU was the one "
            f"waited for in more than {100 * lag.settings.share:.0f}% of them."
        )
        return lines
    lines += [
        "| host | gpu | rank | lag share | wait GPU-hours | wait kWh | cause | evidence |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for e in found:
        hours = "-" if e.wait_gpu_hours is None else f"{e.wait_gpu_hours:.4g}"
        kwh = "-" if e.wait_kwh is None else f"{e.wait_kwh:.4g}"
        rank = "-" if e.rank is None else str(e.rank)
        gpu = "-" if e.gpu is None else str(e.gpu)
        share = "-" if e.lag_share is None else f"{100 * e.lag_share:.0f}%"  # None: a watcher's, without counts
        lines.append(f"| {e.host} | {gpu} | {rank} | {share} | {hours} | {kwh} | {e.cause} | {e.evidence} |")
    if lag.wait_gpu_hours:
        lines += ["", f"Waiting for them: {lag.wait_gpu_hours:.4g} GPU-hours, {lag.wait_kwh:.4g} kWh."]
    return lines


def _notes_md(result: Triage) -> list[str]:
    return ["", "## Notes", ""] + [f"- {n}" for n in result.notes] if result.notes else []


def _gaps_and_peers_md(result: Triage) -> list[str]:
    g, peers = result.gaps, result.peers
    assert g is not None  # triage computes them (gap_summary); only a record written before they were kept lacks them
    lines = [""]
    if g.unknown_s or g.filled_s:
        lines.append(
            f"Telemetry gaps: {g.unknown_s:.0f} s unknown over all GPUs ({g.unknown_gaps} gap(s), "
            f"longest {g.longest_gap_s:.0f} s); {g.filled_s:.0f} s of short gaps (a few sampling "
            "periods) took the phase around them."
        )
    else:
        lines.append("Telemetry gaps: none (every window has samples).")
    if peers.departures:
        lines += ["", "GPUs departing from their peers (the label most GPUs share in the same window):", ""]
        for d in peers.departures:
            what = ", ".join(f"{x.phase} while peers read {x.peers} {x.seconds:.0f} s" for x in d.read_vs_peers[:3])
            lines.append(f"- {d.gpu}: {d.seconds:.0f} s ({what})")
    elif peers.agree_share is not None:
        lines.append(
            f"Peers: every GPU read the same as most of its peers in {100 * peers.agree_share:.1f}% "
            "of the compared windows; none departed for long."
        )
    if result.levels:
        lines += [
            "",
            "Levels learned from the run (W; the table's values where the run showed too little):",
            "",
            "| GPU | idle | wait | compute plateau | low band top | compute from | cap |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        for gpu, lv in result.levels.items():
            lines.append(
                f"| {gpu} | {fmt(lv.idle_w)} | {fmt(lv.wait_w)} | {fmt(lv.plateau_w)} | "
                f"{fmt(lv.low_max_w)} | {fmt(lv.compute_min_w)} | {fmt(lv.cap_w)} |"
            )
    return lines

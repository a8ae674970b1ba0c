"""The report's Stragglers card: the GPU (or, without GPU telemetry, the rank) everyone waited for, why, and what
the waiting cost; and its figure, each such GPU's share of time its peers waited for it, over the run.

The numbers come from triage (triage.json `stragglers` and `lag`, power/triage/stragglers.py) and from the
watcher (watcher.json `stragglers`: ranks it warned about live, from power or, without it, the ranks' CPU
time). As the other cards: `straggler_record` builds summary.json's entry, `straggler_section` draws it.
Both records are checked when read (records/triage.py, records/watcher.py).
"""

from __future__ import annotations

from html import escape

import numpy as np

from wattgate.durations import duration
from wattgate.records.summary import StragglerEntry, Stragglers, Summary
from wattgate.records.triage import Lagging, Timeline
from wattgate.records.watcher import WatcherRecord
from wattgate.report.markup import fmt, note, pct, section, table, utc_of
from wattgate.report.plotly_page import figure_element
from wattgate.report.plot_spec import (
    ROW_GAP_PX,
    axis_key,
    axis_ref,
    base_layout,
    digits_for,
    evenly_spaced,
    row_label,
    stacked_domains,
    text,
    time_axis,
    time_unit,
    values,
)

CAUSE_COLORS = {
    "thermal": "#d62728",
    "power_cap": "#ff7f0e",
    "hw_slowdown": "#9467bd",
    "data": "#17becf",
    "rank0_work": "#1f77b4",
    "unknown": "#7f7f7f",
}
MAX_LANES = 16


def straggler_record(
    lag: Lagging | None, watcher: WatcherRecord | None, gpu_hours, kwh, notes: list[str]
) -> Stragglers:
    """summary.json's `stragglers`: triage's entries (else, without GPU telemetry, the watcher's CPU ones), the
    waiting they cost against the run's GPU-hours and energy, and the watcher's live warnings."""
    found = [StragglerEntry.of(e) for e in lag.stragglers] if lag is not None else []  # checked on read
    live = [StragglerEntry.of(e) for e in (watcher.stragglers or ())] if watcher is not None else []
    totals = lag.lag if lag is not None else None
    if not found and not (totals and totals.wait_windows) and any(e.gpu is None for e in live):
        found = [e for e in live if e.gpu is None]  # no GPU telemetry: the ranks' CPU time is the evidence
    cpu = bool(found) and all(e.gpu is None for e in found)
    source = "watcher: rank CPU time" if cpu else "power triage" if lag else None
    hours = sum(e.wait_gpu_hours or 0.0 for e in found)
    energy = sum(e.wait_kwh or 0.0 for e in found)
    rank_hours = sum(e.wait_rank_hours or 0.0 for e in found)
    return Stragglers(
        checked=lag is not None or watcher is not None,
        source=source,
        share=totals.settings.share if totals else None,
        wait_windows=totals.wait_windows if totals else None,
        entries=tuple(found),
        wait_gpu_hours=round(hours, 6),
        wait_kwh=round(energy, 6),
        wait_rank_hours=round(rank_hours, 6),
        share_of_gpu_hours=round(hours / gpu_hours, 6) if gpu_hours else None,
        share_of_energy=round(energy / kwh, 6) if kwh else None,
        live=tuple(live),
    )


def straggler_section(s: Summary, lag: dict | None) -> str:
    st = s.stragglers
    if not st.checked:
        return section("stragglers", "Stragglers", note("not checked: no GPU telemetry and no watcher record"))
    found = st.entries
    if not found:
        share = st.share
        waits = st.wait_windows
        if share is None or not s.gpus:
            text = "None: the watcher named no rank the others waited for" + (
                "." if share is None else " (no GPU telemetry to compare GPUs by)."
            )
        else:
            text = (
                "None: no GPU ever waited for a peer long enough to count, so none was a straggler."
                if not waits
                else f"None: in the {waits} window(s) in which GPUs waited for a peer, no GPU was the one waited "
                f"for in more than {100 * share:.0f}% of them."
            )
        body = f"<p>{escape(text)}</p>"
    else:
        body = f"<p><b>{escape(_cost_line(st))}</b></p>"
        rows = [
            [
                e.host or "-",
                "-" if e.gpu is None else e.gpu,
                "-" if e.rank is None else e.rank,
                pct(e.lag_share),
                fmt(e.wait_gpu_hours if e.gpu is not None else e.wait_rank_hours, 4),
                fmt(e.wait_kwh, 4),
                e.cause,
                e.evidence,
            ]
            for e in found
        ]
        heads = ["node", "GPU", "rank", "lag share", "wait GPU-h (CPU: rank-h)", "wait kWh", "cause", "evidence"]
        body += table(heads, rows, {3, 4, 5})
    if lag:
        body += figure_element(lag, "lag", "per-GPU lag over time") + note(
            "Per GPU its peers waited for: the share of each stretch of time in which they waited for it (it kept "
            "working at compute power while most of them had dropped to the wait level), coloured by its cause; "
            "the grey line is the share of time the job waited for any one GPU."
        )
    live = st.live
    if live:
        items = "".join(
            f"<li>rank {e.rank} ({escape(e.signal or '')}), from {escape(utc_of(e.first))} "
            f"UTC: {escape(str(e.cause))}: {escape(str(e.evidence))}</li>"
            for e in live
        )
        body += f"<h3>Warned during the run (the watcher)</h3><ul>{items}</ul>"
    body += note(
        "A straggler is the GPU (or rank) the others keep waiting for: in a synchronous step every rank waits for "
        "the slowest. Lag share: of the windows in which the others waited, the share they waited for it. Wait "
        "GPU-hours and kWh: its peers' time and energy spent waiting for it. Causes: thermal, power_cap, "
        "hw_slowdown (its clocks-event reasons, SM clock, temperature or power limit against its peers'), data "
        "(its rank's data wait), rank0_work (work only rank 0 does), unknown."
    )
    return section("stragglers", "Stragglers", body)


def _cost_line(st: Stragglers) -> str:
    names = ", ".join(f"{e.host}:{e.gpu}" if e.gpu is not None else f"rank {e.rank} on {e.host}" for e in st.entries)
    if st.wait_gpu_hours or st.wait_kwh:
        of_hours = f" ({pct(st.share_of_gpu_hours)} of the run's GPU-hours)" if st.share_of_gpu_hours else ""
        of_energy = f" ({pct(st.share_of_energy)} of its energy)" if st.share_of_energy else ""
        return (
            f"Waiting for {names} cost {st.wait_gpu_hours:.4g} GPU-hours{of_hours} and {st.wait_kwh:.4g} "
            f"kWh{of_energy}."
        )
    if st.wait_rank_hours:
        return f"Waiting for {names} cost about {duration(st.wait_rank_hours * 3600)} of the other ranks' time."
    return f"Straggler(s): {names}."


def lag_figure(
    timeline: Timeline | None, entries: tuple[StragglerEntry, ...], window_s: float, t0: float | None, t1: float | None
) -> dict | None:
    """One row per GPU last in any window (stragglers first): the share of each time bin its peers spent
    waiting for it, a step area in its cause's colour (grey for a GPU no straggler), and the job's share of
    waited time as a grey line. None without a timeline."""
    if not timeline or not timeline.last or t0 is None or t1 is None:
        return None
    start, bin_s, bins = float(timeline.start), float(timeline.bin_s), timeline.bins
    waits = np.asarray(timeline.wait_windows, float)
    last = {k: np.asarray(v, float) for k, v in timeline.last.items()}
    if bins < 1 or bin_s <= 0 or len(waits) != bins or any(len(v) != bins for v in last.values()):
        return None
    cause = {f"{e.host}:{e.gpu}": e.cause for e in entries if e.gpu is not None}
    lanes = sorted(last, key=lambda k: (k not in cause, -last[k].sum(), k))[:MAX_LANES]
    per_bin = max(bin_s / window_s, 1.0)
    unit, uname = time_unit(max(t1 - t0, 1e-9))
    digits = digits_for(bin_s / unit)
    # bins are evenly spaced: the first edge and the width place them; a bin's share holds from its start to
    # the next bin's, so its value is repeated at the last edge
    edges = evenly_spaced((start - t0) / unit, bin_s / unit, digits)
    domains, plot_px = stacked_domains([(ROW_GAP_PX, 46.0)] * len(lanes))
    layout = base_layout(plot_px)
    data, notes, causes = [], [], set()
    job = values(np.r_[waits, waits[-1]] / per_bin, 3)
    for k, key in enumerate(lanes):
        label = key + (f" ({cause[key]})" if key in cause else "")
        yaxis = axis_ref("y", k)
        why = cause.get(key, "not a straggler")
        assert why is not None, "every straggler record names its cause (records/triage.py, records/watcher.py)"
        color = CAUSE_COLORS.get(why, "#c7c7c7")
        share = values(np.clip(np.r_[last[key], last[key][-1]] / per_bin, 0, 1), 3)
        data.append(_step_area(edges, share, color, label, yaxis, why, why not in causes))
        causes.add(why)
        data.append(_job_line(edges, job, yaxis, k == 0))
        layout[axis_key("y", k)] = {
            "anchor": "x",
            "domain": list(domains[k]),
            "range": [0, 1],
            "tickformat": ".0%",
            "tickvals": [0, 0.5, 1],
            "title": {"text": "waited"} if k == 0 else {},
            "zeroline": False,
        }
        notes.append(row_label(label, domains[k]))
    title = f"time since run start ({uname}); each row 0-100% of the time, per {duration(bin_s)}"
    layout["xaxis"] = time_axis(title, (t1 - t0) / unit, digits, anchor=axis_ref("y", len(lanes) - 1))
    layout["annotations"] = notes
    return {"data": data, "layout": layout}


def _step_area(x: dict, y: list, color: str, label: str, yaxis: str, cause: str, legend: bool) -> dict:
    """A row's share of waited time as a filled step area (its cause's colour), in the legend once per cause."""
    return x | {
        "fill": "tozeroy",
        "hovertemplate": f"{text(label)}: its peers waited for it %{{y:.0%}} of the time<extra></extra>",
        "legendgroup": cause,
        "line": {"color": color, "shape": "hv", "width": 0.6},
        "mode": "lines",
        "name": cause.replace("_", " "),
        "opacity": 0.8,
        "showlegend": legend,
        "type": "scatter",
        "y": y,
        "yaxis": yaxis,
    }


def _job_line(x: dict, y: list, yaxis: str, legend: bool) -> dict:
    return x | {
        "hovertemplate": "the job waited for one GPU %{y:.0%} of the time<extra></extra>",
        "legendgroup": "job",
        "line": {"color": "#999999", "shape": "hv", "width": 0.8},
        "mode": "lines",
        "name": "the job waited for any one GPU",
        "showlegend": legend,
        "type": "scatter",
        "y": y,
        "yaxis": yaxis,
    }

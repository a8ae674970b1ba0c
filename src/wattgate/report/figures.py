"""The report's figures as Plotly figure specs (the JSON plotly.js draws; report/plotly_page.py embeds them),
built with numpy from the analysis (the pieces they share are in report/plot_spec.py).

Long runs are binned before drawing: power to at most POWER_BINS bins over the run, each its lowest, mean and
highest value and the phase holding most of its time; the other series to at most MAX_POINTS. So a 16 GPU x
24 h run draws as fast, and its page is about as large, as an hour's. Specs depend on the data alone
(rounded numbers, no ids, no clock), so the same data gives the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wattgate.heartbeats import EVENT_PHASE, EVENT_RANK, EVENT_TIME
from wattgate.power.triage.phases import LABELS
from wattgate.report.binning import (
    bin_edges,
    bin_majority,
    bin_max,
    bin_mean,
    bin_min,
    code_runs,
)
from wattgate.report.loss_figure import loss_figure
from wattgate.report.phases import PHASE_COLORS
from wattgate.report.plot_spec import (
    INK,
    ROW_GAP_PX,
    axis_key,
    axis_ref,
    base_layout,
    checkpoint_shapes,
    digits_for,
    evenly_spaced,
    row_label,
    stacked_domains,
    text,
    time_axis,
    time_unit,
    values,
)
from wattgate.report.stragglers import lag_figure
from wattgate.report.summary import Analysis
from wattgate.run_tables import DATA_WAIT_S, STEP, STEP_TIME_S, TIME

POWER_BINS = 1000  # per GPU: bins over the run, each drawn as its min, mean and max
MAX_STEP_TICKS = 120  # step boundaries drawn; more are thinned to every n-th
MAX_PANELS = 32  # GPUs drawn, one row each
NO_PHASE = "#555555"  # power of bins without a phase (no triage)
BAND = "rgba(90,100,117,0.25)"  # the min-max band of the power rows
STRIP_PX = 8  # the phase strip under each GPU's row
STEPS_ROW_PX = 22

# ---------------------------------------------------------------- what the time figures mark


def time_span(analysis: Analysis) -> tuple[float, float]:
    """The run's first and last time (t0, t1), for a figure drawn from timed data: run_span sets both whenever
    there are power samples, phase windows, metrics or heartbeat events."""
    t0, t1 = analysis.t0, analysis.t1
    assert t0 is not None and t1 is not None, "a figure drawn from timed data, but the run has no time span"
    return t0, t1


def checkpoint_spans(analysis: Analysis) -> list[tuple[float, float]]:
    """Closed checkpoint/export intervals of any rank (heartbeat events), merged, in unix seconds."""
    ev = analysis.inputs.events
    if ev is None or ev.empty:
        return []
    ev = ev.sort_values([EVENT_RANK, EVENT_TIME], kind="stable")
    nxt = ev.groupby(EVENT_RANK)[EVENT_TIME].shift(-1)
    ck = ev[EVENT_PHASE].isin(["checkpoint", "export"]) & nxt.notna()
    spans = sorted(zip(ev[EVENT_TIME][ck].astype(float), nxt[ck].astype(float)))
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def attempt_starts(analysis: Analysis) -> list[float]:
    """When each attempt after the first started (the earliest rank's `init` heartbeat of it), in unix seconds: a
    resumed run's steps over time have a gap there, and a rerun's export or checkpoints beyond it."""
    ev = analysis.inputs.events
    if ev is None or ev.empty:
        return []
    # every rank beats `init` once as each attempt starts: a rank's n-th `init` is attempt n's, however soon the
    # attempt followed the one before (a rank that joined later counts its own attempts, never earlier ones)
    inits = ev.loc[ev[EVENT_PHASE] == "init", [EVENT_RANK, EVENT_TIME]].sort_values([EVENT_RANK, EVENT_TIME])
    attempt = inits.groupby(EVENT_RANK).cumcount()
    starts = inits[EVENT_TIME].astype(float).groupby(attempt.to_numpy()).min().sort_index()
    return [float(t) for t in starts.to_numpy()[1:]]


def step_ends_of(analysis: Analysis) -> tuple[np.ndarray, np.ndarray, float | None]:
    """Each step's end (its last rank's) and number, in time order, and when the first step began (None when
    no step time says)."""
    if analysis.steps is not None:  # the same per-step maximum, already grouped
        table = analysis.steps
    else:
        m = analysis.inputs.metrics
        if m is None or m.empty:
            return np.zeros(0), np.zeros(0, np.int64), None
        table = m.groupby(STEP, sort=True, as_index=False).agg({TIME: "max"})
    ends, steps = table[TIME].to_numpy(float), table[STEP].to_numpy()
    order = np.argsort(ends, kind="stable")
    ends, steps = ends[order], steps[order]
    began = None
    if STEP_TIME_S in table and len(ends) and np.isfinite(table[STEP_TIME_S].to_numpy(float)[order[0]]):
        began = float(ends[0] - table[STEP_TIME_S].to_numpy(float)[order[0]])
    return ends, steps, began


def step_ticks(ends: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Step ends thinned to at most MAX_STEP_TICKS, their steps, and the thinning factor."""
    every = max(1, int(np.ceil(len(ends) / MAX_STEP_TICKS)))
    return ends[every - 1 :: every], steps[every - 1 :: every], every


def step_labels(t: np.ndarray, ends: np.ndarray, steps: np.ndarray, began: float | None) -> list[str]:
    """The step running at each time ("step 12"), "" before the first step began or after the last ended."""
    if not len(ends):
        return [""] * len(t)
    i = np.searchsorted(ends, t, side="left")
    known = (i < len(ends)) & (t >= (began if began is not None else ends[0]))
    names = steps[np.minimum(i, len(ends) - 1)]
    return [f"step {int(n)}" if k else "" for n, k in zip(names.tolist(), known.tolist())]


# ---------------------------------------------------------------- power per GPU


@dataclass(frozen=True)
class PowerBins:
    """One GPU's power per bin: lowest, mean and highest value, and the phase holding most of the bin's time
    (-1 where none)."""

    low: np.ndarray
    mean: np.ndarray
    high: np.ndarray
    phase: np.ndarray


def binned_power(analysis: Analysis, k: int, edges: np.ndarray) -> PowerBins:
    """GPU k's power in the bins: its phase windows' mean power where triage ran, else its samples."""
    w = analysis.windows
    if len(w):
        a, b = np.searchsorted(w.gid, [k, k + 1])
        x, p = w.start[a:b], w.power[a:b]
        phase = bin_majority(x, w.code[a:b], edges, w.seconds[a:b])
    else:
        samples = analysis.inputs.samples
        assert samples is not None, "power_figure draws samples only when there are some"
        series = samples.series[k]
        x, p = series.time, np.asarray(series.power, np.float64)
        phase = np.full(len(edges) - 1, -1)
    return PowerBins(bin_min(x, p, edges), bin_mean(x, p, edges), bin_max(x, p, edges), phase)


def _with_breaks(idx: np.ndarray, *columns: list) -> list[list]:
    """The columns at idx, a None after each place idx skips (a line drawn through them breaks there)."""
    cuts = (np.flatnonzero(np.diff(idx) > 1) + 1).tolist()
    out = []
    for col in columns:
        picked = [col[i] for i in idx.tolist()]
        for c in reversed(cuts):
            picked.insert(c, None)
        out.append(picked)
    return out


def phase_lines(
    bins: PowerBins, x: list, steps: list[str] | None, label: str, yaxis: str, shown: set[str]
) -> list[dict]:
    """GPU's mean power per bin as one line per phase (the bin's majority phase gives its colour), each
    piece of a phase's line running on to the next bin's point so that the pieces join."""
    mean = values(bins.mean, 0)
    traces = []
    for code in sorted(set(bins.phase.tolist())):
        phase = LABELS[code] if code >= 0 else ""
        mine = bins.phase == code
        idx = np.flatnonzero(mine | np.r_[False, mine[:-1]])
        xs, ys, tips = _with_breaks(idx, x, mean, steps or [""] * len(x))
        name = phase.replace("_", " ") if phase else "power (no phase)"
        trace = {
            "hovertemplate": f"%{{y}} W, {name}" + ("<br>%{text}" if steps else "") + f"<extra>{text(label)}</extra>",
            "legendgroup": phase or "power",
            "line": {"color": PHASE_COLORS.get(phase, NO_PHASE), "width": 1.4},
            "mode": "lines",
            "name": name,
            "showlegend": (phase or "power") not in shown,
            "type": "scatter",
            "x": xs,
            "y": ys,
            "yaxis": yaxis,
        }
        if steps:
            trace["text"] = [s if s is not None else "" for s in tips]
        shown.add(phase or "power")
        traces.append(trace)
    return traces


def band(bins: PowerBins, x: dict, label: str, yaxis: str, legend: str | None) -> list[dict]:
    """The lowest and highest value per bin, the space between them filled; in the legend when named."""
    common = x | {"legendgroup": "range", "mode": "lines", "type": "scatter", "yaxis": yaxis}
    low = dict(
        common,
        hovertemplate=f"min %{{y}} W<extra>{text(label)}</extra>",
        line={"color": BAND, "width": 0},
        name="min",
        showlegend=False,
        y=values(bins.low, 0),
    )
    high = dict(
        common,
        fill="tonexty",
        fillcolor=BAND,
        hovertemplate=f"max %{{y}} W<extra>{text(label)}</extra>",
        line={"color": BAND, "width": 0},
        name=legend or "max",
        showlegend=legend is not None,
        y=values(bins.high, 0),
    )
    return [low, high]


def phase_strip(phase: np.ndarray, edges_x: list, yaxis: str) -> list[dict]:
    """The bins' phases as a strip of rectangles, one filled trace per phase (hidden with its phase's line)."""
    first, end, code = code_runs(phase)
    traces = []
    for c in sorted(set(code.tolist()) - {-1}):
        xs, ys = [], []
        for a, b in zip(first[code == c].tolist(), end[code == c].tolist()):
            xs += [edges_x[a], edges_x[b], edges_x[b], edges_x[a], edges_x[a], None]
            ys += [0, 0, 1, 1, 0, None]
        traces.append(
            {
                "fill": "toself",
                "fillcolor": PHASE_COLORS[LABELS[c]],
                "hoverinfo": "skip",
                "legendgroup": LABELS[c],
                "line": {"width": 0},
                "mode": "lines",
                "showlegend": False,
                "type": "scatter",
                "x": xs,
                "y": ys,
                "yaxis": yaxis,
            }
        )
    return traces


def step_end_trace(ticks: np.ndarray, steps: np.ndarray, every: int, t0: float, unit: float, digits: int) -> dict:
    """Step ends as short vertical lines in the row above the GPUs, each naming its step on hover."""
    xs, ys, tips = [], [], []
    for t, n in zip(values((ticks - t0) / unit, digits), steps.tolist()):
        xs += [t, t, None]
        ys += [0.1, 0.9, None]
        tips += [f"step {int(n)}", f"step {int(n)}", ""]
    return {
        "hovertemplate": "%{text} ended<extra></extra>",
        "legendgroup": "steps",
        "line": {"color": INK, "width": 0.8},
        "mode": "lines",
        "name": "step end" if every == 1 else f"every {every}th step end",
        "text": tips,
        "type": "scatter",
        "x": xs,
        "y": ys,
        "yaxis": "y",
    }


def hidden_axis(domain: tuple[float, float]) -> dict:
    """A row without a value scale (the phase strip, the step ends): 0..1, not zoomable."""
    return {"anchor": "x", "domain": list(domain), "fixedrange": True, "range": [0, 1], "visible": False}


def watt_axis(domain: tuple[float, float], top: float) -> dict:
    """A GPU row's power axis: 0 to `top` W, the scale every row shares so that rows compare at a glance."""
    return {
        "anchor": "x",
        "domain": list(domain),
        "gridcolor": "#eeeeee",
        "nticks": 4,
        "range": [0, round(top)],
        "title": {"text": "W"},
        "zeroline": False,
    }


def power_rows_px(gpus: int, strips: bool, steps: bool) -> list[tuple[float, float]]:
    """(gap above, height) in px of the power figure's rows, top to bottom: the step ends, then per GPU its
    power and its phase strip; a few GPUs get taller rows."""
    lane_px = 110 if gpus <= 4 else 90 if gpus <= 8 else 70
    rows: list[tuple[float, float]] = [(0.0, STEPS_ROW_PX)] if steps else []
    for _ in range(gpus):
        rows += [(ROW_GAP_PX, lane_px)] + ([(2.0, STRIP_PX)] if strips else [])
    return rows


def power_span(analysis: Analysis) -> tuple[float, float, float]:
    """First and last time of the power data and its resolution (window length, or sampling period)."""
    w, energy, s = analysis.windows, analysis.energy, analysis.inputs.samples
    if len(w):
        return float(w.start.min()), float(w.end.max()), analysis.inputs.window_s
    assert energy is not None and s is not None, "power_figure draws without phase windows only from samples"
    period = max(float(np.median(np.diff(x.time[:1000]))) if len(x.time) > 1 else 1.0 for x in s.series)
    return float(np.nanmin(energy.first)), float(np.nanmax(energy.last)), period


def power_figure(analysis: Analysis) -> dict | None:
    """Power over time, one row per GPU (the first on top) with its own watt axis on one shared scale, the
    time axis shared by all rows: mean power per bin coloured by the bin's phase, its min-max band, a phase
    strip under the row; checkpoints shaded and step ends in a row on top."""
    w, energy, s = analysis.windows, analysis.energy, analysis.inputs.samples
    if not len(w) and (energy is None or s is None):
        return None
    if len(w):
        keys = w.keys[:MAX_PANELS]
    else:
        assert energy is not None, "checked above"
        keys = energy.keys[:MAX_PANELS]
    t0, t1 = time_span(analysis)
    unit, uname = time_unit(t1 - t0)
    lo, hi, resolution = power_span(analysis)
    edges = bin_edges(lo, hi, max(resolution, 1e-3), POWER_BINS)
    width = float(edges[1] - edges[0])
    digits = digits_for(width / unit)
    centers = (edges[:-1] + edges[1:]) / 2
    x = values((centers - t0) / unit, digits)
    even_x = evenly_spaced(float(centers[0] - t0) / unit, width / unit, digits)
    edges_x = values((edges - t0) / unit, digits)
    ends, step_numbers, began = step_ends_of(analysis)
    steps = step_labels(centers, ends, step_numbers, began) if len(ends) else None
    ticks, tick_steps, every = step_ticks(ends, step_numbers)
    several = width > 1.5 * resolution  # a bin holds several windows (samples): the band shows their spread
    what = f"{resolution:g} s windows" if len(w) else "samples"
    band_name = f"min-max of the {what} in each {width:.3g} s bin"

    domains, plot_px = stacked_domains(power_rows_px(len(keys), strips=bool(len(w)), steps=bool(len(ticks))))
    layout = base_layout(plot_px)
    data, notes, shown = [], [], set()
    r = 0
    if len(ticks):
        layout["yaxis"] = hidden_axis(domains[0])
        notes.append(row_label("steps", domains[0]))
        data.append(step_end_trace(ticks, tick_steps, every, t0, unit, digits))
        r = 1
    all_bins = [binned_power(analysis, k, edges) for k in range(len(keys))]
    top = max([float(np.nanmax(b.high)) for b in all_bins if np.isfinite(b.high).any()] or [1.0]) * 1.05
    for k, ((host, gpu), bins) in enumerate(zip(keys, all_bins)):
        label = f"{host}:{gpu}"
        power_axis = axis_ref("y", r)
        layout[axis_key("y", r)] = watt_axis(domains[r], top)
        notes.append(row_label(label, domains[r]))
        if several:
            data += band(bins, even_x, label, power_axis, None if k else band_name)
        data += phase_lines(bins, x, steps, label, power_axis, shown)
        r += 1
        if len(w):
            layout[axis_key("y", r)] = hidden_axis(domains[r])
            data += phase_strip(bins.phase, edges_x, axis_ref("y", r))
            r += 1
    xmax = max((t1 - t0) / unit, 1e-9)  # the whole run: steps and heartbeats may outlast the trace
    layout["xaxis"] = time_axis(f"time since run start ({uname})", xmax, digits, anchor=axis_ref("y", r - 1))
    layout["annotations"] = notes
    layout["hovermode"] = "x"
    spans = [((a - t0) / unit, (b - t0) / unit) for a, b in checkpoint_spans(analysis)]
    if spans:
        layout["shapes"] = checkpoint_shapes(spans, digits)
    return {"data": data, "layout": layout}


# ---------------------------------------------------------------- phase shares


def phase_share_figure(analysis: Analysis) -> dict | None:
    """Stacked bars per GPU: share of time and of energy in each phase, a hover label on every piece.

    The shares are the summary's per-GPU ones (the numbers the page's tables print), not a second pass
    over every window."""
    rows = analysis.summary.phases.per_gpu[:MAX_PANELS]
    if not rows:
        return None
    labels = [text(f"{r.host}:{r.gpu}") for r in rows]
    shares = {
        "time": [[r.time_share.get(p) or 0.0 for p in LABELS] for r in rows],
        "energy": [[r.energy_share.get(p) or 0.0 for p in LABELS] for r in rows],
    }
    data = []
    for j, phase in enumerate(LABELS):
        if not any(row[j] for share in shares.values() for row in share):
            continue
        name = phase.replace("_", " ")
        for i, (what, share) in enumerate(shares.items()):
            data.append(
                {
                    "hovertemplate": f"%{{y}}: {name} %{{x:.1%}} of {what}<extra></extra>",
                    "legendgroup": phase,
                    "marker": {"color": PHASE_COLORS[phase]},
                    "name": name,
                    "orientation": "h",
                    "showlegend": i == 0,
                    "type": "bar",
                    "x": values([row[j] for row in share], 5),
                    "xaxis": axis_ref("x", i),
                    "y": labels,
                }
            )
    layout = base_layout(26.0 * len(rows) + 10)
    layout["barmode"] = "stack"
    layout["bargap"] = 0.25
    for i, (what, domain) in enumerate((("time", [0, 0.48]), ("energy", [0.52, 1]))):
        layout[axis_key("x", i)] = {
            "anchor": "y",
            "domain": domain,
            "range": [0, 1],
            "tickformat": ".0%",
            "title": {"text": f"share of {what}"},
        }
    layout["yaxis"] = {"autorange": "reversed", "automargin": True, "type": "category"}
    return {"data": data, "layout": layout}


# ---------------------------------------------------------------- steps


def steps_figure(analysis: Analysis, steps) -> dict | None:
    """Step time (slowest rank) and data wait (mean over ranks) over time, checkpoints shaded."""
    if steps is None or STEP_TIME_S not in steps or not len(steps):
        return None
    t0, t1 = time_span(analysis)
    x = steps[TIME].to_numpy(float)
    unit, uname = time_unit(t1 - t0)
    edges = bin_edges(float(x.min()), float(x.max()), 1e-6)
    binned = len(edges) - 1 < len(x)
    digits = digits_for(float(edges[1] - edges[0]) / unit) if binned else digits_for(_spacing(x) / unit)
    st = steps[STEP_TIME_S].to_numpy(float)
    if binned:  # evenly spaced bins: their first centre and width place them
        tx = evenly_spaced(((edges[0] + edges[1]) / 2 - t0) / unit, float(edges[1] - edges[0]) / unit, digits)
    else:
        tx = {"x": values((x - t0) / unit, digits)}
    data = []
    if binned:
        data.append(_line(tx, bin_max(x, st, edges), "step time (max in bin)", "#1f77b4", 0.8, opacity=0.5))
        data.append(_line(tx, bin_mean(x, st, edges), "step time (mean in bin)", "#1f77b4", 1.4))
    else:
        data.append(_line(tx, st, "step time (slowest rank)", "#1f77b4", 1.4, markers=True))
    if DATA_WAIT_S in steps:
        dw = steps[DATA_WAIT_S].to_numpy(float)
        wait = np.nan_to_num(bin_mean(x, dw, edges) if binned else dw)
        name = "data wait (mean over ranks" + (", bin mean)" if binned else ")")
        area = _line(tx, wait, name, "#ff7f0e", 0.0)
        # unbinned: a step's wait holds from the step before it to its own end
        area.update(fill="tozeroy", fillcolor="rgba(255,127,14,0.6)")
        area["line"]["shape"] = "linear" if binned else "vh"
        data.append(area)
    layout = base_layout(230.0)
    xmax = max((t1 - t0) / unit, 1e-9)  # the power figure's time range, so the two line up
    layout["xaxis"] = time_axis(f"time since run start ({uname})", xmax, digits)
    layout["yaxis"] = {"gridcolor": "#eeeeee", "rangemode": "tozero", "title": {"text": "seconds"}}
    layout["hovermode"] = "x"
    spans = [((a - t0) / unit, (b - t0) / unit) for a, b in checkpoint_spans(analysis)]
    shapes = checkpoint_shapes(spans, digits)
    notes = []
    for seg in analysis.summary.segments[1:]:  # a resized run: where the world size changed
        if seg.start is None:  # every rank's time of its first step was damaged: the marker costs what it held
            continue
        sx = values([(seg.start - t0) / unit], digits)[0]
        shapes.append(
            {"line": {"color": "#8a1414", "dash": "dash", "width": 1}, "type": "line", "x0": sx, "x1": sx}
            | {"xref": "x", "y0": 0, "y1": 1, "yref": "paper"}
        )
        notes.append(
            {"font": {"color": "#8a1414", "size": 10}, "showarrow": False, "x": sx, "xanchor": "left", "xref": "x"}
            | {"text": f"{seg.world_size} ranks from step {seg.first_step}", "y": 0, "yanchor": "bottom"}
            | {"yref": "paper"}
        )
    for n, start in enumerate(attempt_starts(analysis), 2):  # a resumed run: where each later attempt began
        ax = values([(start - t0) / unit], digits)[0]
        shapes.append(
            {"line": {"color": "#555555", "dash": "dot", "width": 1}, "type": "line", "x0": ax, "x1": ax}
            | {"xref": "x", "y0": 0, "y1": 1, "yref": "paper"}
        )
        notes.append(
            {"font": {"color": "#555555", "size": 10}, "showarrow": False, "x": ax, "xanchor": "right", "xref": "x"}
            | {"text": f"attempt {n}", "y": 1, "yanchor": "top", "yref": "paper"}
        )
    if shapes:
        layout["shapes"] = shapes
    if notes:
        layout["annotations"] = notes
    return {"data": data, "layout": layout}


def _spacing(x: np.ndarray) -> float:
    """The typical distance between neighbouring values (1 when there are fewer than two)."""
    d = np.diff(np.sort(x))
    d = d[d > 0]
    return float(np.median(d)) if len(d) else 1.0


def _line(x: dict, y, name: str, color: str, width: float, *, opacity: float = 1.0, markers: bool = False) -> dict:
    """A line over `x` (its "x" values, or "x0" and "dx")."""
    trace = x | {
        "line": {"color": color, "width": width},
        "mode": "lines+markers" if markers else "lines",
        "name": text(name),
        "type": "scatter",
        "y": values(y, 4),
    }
    if markers:
        trace["marker"] = {"color": color, "size": 5}
    if opacity < 1:
        trace["opacity"] = opacity
    return trace


# ---------------------------------------------------------------- all of them


@dataclass(frozen=True, slots=True)
class Figures:
    """The page's figures as Plotly specs (data and layout), each None where its inputs are missing."""

    lag: dict | None = None  # per-GPU lag over time (the Stragglers card)
    power: dict | None = None  # power per GPU over time
    phase_share: dict | None = None  # phase shares per GPU
    steps: dict | None = None  # step time and data wait over time
    later_attempts: int = 0  # the attempts after the first that the step figure marks (a resumed run)
    loss: dict | None = None  # training and validation loss

    def has_any(self) -> bool:
        return any(f is not None for f in (self.lag, self.power, self.phase_share, self.steps, self.loss))


def render_all(analysis: Analysis, steps, evals=None) -> Figures:
    """Every figure's spec (None where its inputs are missing); `evals` the validation passes."""
    lagging = analysis.inputs.lag
    timeline = lagging.lag.timeline if lagging is not None and lagging.lag is not None else None
    entries = analysis.summary.stragglers.entries
    return Figures(
        lag=lag_figure(timeline, entries, analysis.inputs.window_s, analysis.t0, analysis.t1),
        power=power_figure(analysis),
        phase_share=phase_share_figure(analysis),
        steps=steps_figure(analysis, steps),
        loss=loss_figure(steps, evals),
        later_attempts=len(attempt_starts(analysis)),
    )

"""Report figures as inline SVG markup, built with numpy and f-strings (no plotting library to import);
the markup primitives and axes are in report/svg.py.

Long runs are binned to at most MAX_POINTS points per series before drawing,
so a 16 GPU x 24 h run draws as fast as a short one. To keep the page small,
coordinates are pixels rounded to a tenth, a polyline is one path of relative
moves that skips points lying straight between their neighbours, and a run of
bins of one phase is one rectangle. Markup depends on the data alone (no ids,
no clock), so the same data gives the same bytes; every text is escaped, since
host names come from user files.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

import numpy as np

from wattgate.report.phases import PHASE_COLORS
from wattgate.run_tables import DATA_WAIT_S, LOSS, STEP, STEP_TIME_S, TIME, eval_sources_of, source_loss_column
from wattgate.heartbeats import EVENT_PHASE, EVENT_RANK, EVENT_TIME
from wattgate.report.stragglers import lag_figure
from wattgate.report.summary import Analysis
from wattgate.report.svg import (
    CHECKPOINT_SHADE,
    INK,
    LABEL_FONT,
    WIDTH,
    Box,
    Entry,
    clipped,
    code_runs,
    dots,
    fit,
    hlines_d,
    label_margin,
    legend,
    nice_ticks,
    num,
    padded,
    path_d,
    phase_entries,
    rects_d,
    shade,
    svg,
    text,
    tooltip,
    vlines_d,
    x_axis,
    x_grid,
    y_axis,
    y_grid,
    y_margin,
)
from wattgate.power.triage.phases import LABELS

MAX_POINTS = 2000  # per series: about one point per pixel column
MAX_STEP_TICKS = 120  # step boundaries drawn; more are thinned to every n-th
MAX_PANELS = 32  # GPUs drawn, one lane each
NO_PHASE = "#555555"  # power of bins without a phase (no triage)

# ---------------------------------------------------------------- helpers


def time_unit(span_s: float) -> tuple[float, str]:
    """Divisor and name of the axis unit that keeps tick labels short."""
    if span_s <= 600:
        return 1.0, "s"
    if span_s <= 10 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def bin_edges(x0: float, x1: float, n: int, step: float) -> np.ndarray:
    """At most MAX_POINTS equal bins over [x0, x1], none finer than `step` (the data's own resolution)."""
    bins = int(min(MAX_POINTS, max(1, np.ceil((x1 - x0) / step)))) if x1 > x0 else 1
    return np.linspace(x0, x1 if x1 > x0 else x0 + step, bins + 1)


def bin_index(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The bin of each x: i where edges[i] <= x < edges[i + 1], values beyond the ends in the end bins."""
    last = len(edges) - 2
    if len(x) > 1 and np.all(x[1:] >= x[:-1]):
        # a time series: finding the few edges among the values beats finding every value among the edges
        first = np.searchsorted(x, edges[1:-1], side="left")
        return np.repeat(np.arange(last + 1), np.diff(np.r_[0, first, len(x)]))
    return np.clip(np.searchsorted(edges, x, side="right") - 1, 0, last)


def bin_mean(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of y per bin (NaN for an empty bin or one with only NaN)."""
    ok = np.isfinite(y)
    b = bin_index(x[ok], edges)
    n = np.bincount(b, minlength=len(edges) - 1)
    s = np.bincount(b, weights=y[ok], minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def bin_max(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    ok = np.isfinite(y)
    b = bin_index(x[ok], edges)
    out = np.full(len(edges) - 1, -np.inf)
    np.maximum.at(out, b, y[ok])
    return np.where(np.isfinite(out), out, np.nan)


def bin_majority(x: np.ndarray, code: np.ndarray, edges: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The phase holding most of each bin's time (-1 for an empty bin)."""
    nl = len(LABELS)
    b = bin_index(x, edges)
    counts = np.bincount(b * nl + code, weights=weight, minlength=(len(edges) - 1) * nl).reshape(-1, nl)
    best = counts.argmax(axis=1)
    return np.where(counts.sum(axis=1) > 0, best, -1)


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


def step_ends(analysis: Analysis) -> tuple[np.ndarray, int]:
    """Step end times (the last rank's) thinned to at most MAX_STEP_TICKS, and the thinning factor."""
    if analysis.steps is not None:  # the same per-step maximum, already grouped
        ends = analysis.steps[TIME].to_numpy(float)
    else:
        m = analysis.inputs.metrics
        if m is None or m.empty:
            return np.zeros(0), 1
        ends = m.groupby(STEP, sort=True)[TIME].max().to_numpy(float)
    every = max(1, int(np.ceil(len(ends) / MAX_STEP_TICKS)))
    return ends[every - 1 :: every], every


# ---------------------------------------------------------------- figures

LANE = 1.0  # power lanes on one axes: GPU k's strip and 0..ymax drawn in [base, base + 0.92 LANE)
STRIP = 0.1  # its phase strip at the bottom of the lane (share of LANE)
STEPS_LANE = 0.45  # the step ticks above the GPUs
RIGHT = 16  # px right of every plot


def _lane(box: Box, base: float, x: np.ndarray, y: np.ndarray, codes: np.ndarray, edges_px, strip: bool) -> str:
    """One GPU's lane: its phase strip (a rectangle per run of one phase) and its power line, each piece in
    its bin's phase colour, over a transparent hit area so that the whole lane shows the group's tooltip."""
    top, bottom = float(box.py(base + LANE)), float(box.py(base))
    out = [
        f'<rect x="{num(box.left)}" y="{num(top)}" width="{num(box.width)}" height="{num(bottom - top)}" '
        'fill="#fff" fill-opacity="0"/>'
    ]
    if strip:
        first, end, code = code_runs(codes)
        strip_top = float(box.py(base + STRIP * LANE))
        for i, p in enumerate(LABELS):
            on = code == i
            if on.any():
                d = rects_d(edges_px[first[on]], edges_px[end[on]], strip_top, bottom - strip_top)
                out.append(f'<path d="{d}" fill="{PHASE_COLORS[p]}" shape-rendering="crispEdges"/>')
    for i, p in enumerate(LABELS + ("",)):
        mine = codes == (i if p else -1)
        if not mine.any():
            continue
        # a bin's piece runs from its point to the next one, so each run of the phase keeps the point after it
        keep = mine | np.r_[False, mine[:-1]]
        d = path_d(x, np.where(keep, y, np.nan))
        if d:
            out.append(f'<path d="{d}" stroke="{PHASE_COLORS.get(p, NO_PHASE)}" stroke-width="1.2" fill="none"/>')
    return "".join(out)


def power_figure(analysis: Analysis) -> str | None:
    """Power over time per GPU, coloured by phase, with a phase strip, checkpoints shaded and step ticks.

    One plot, one lane per GPU (offset series sharing one power scale), the first GPU on top."""
    w, energy, s = analysis.windows, analysis.energy, analysis.inputs.samples
    if not len(w) and (energy is None or s is None):
        return None
    keys = w.keys if len(w) else energy.keys
    shown = keys[:MAX_PANELS]
    t0 = analysis.t0
    if len(w):
        lo, hi, step = float(w.start.min()), float(w.end.max()), analysis.inputs.window_s
    else:
        lo, hi = float(np.nanmin(energy.first)), float(np.nanmax(energy.last))
        step = max(float(np.median(np.diff(x.time[:1000]))) if len(x.time) > 1 else 1.0 for x in s.series)
    unit, uname = time_unit(analysis.t1 - t0)
    edges = bin_edges(lo, hi, 0, max(step, 1e-3))
    centers = ((edges[:-1] + edges[1:]) / 2 - t0) / unit
    gap = 1.5 * (edges[1] - edges[0]) / unit
    spans = checkpoint_spans(analysis)
    ticks, every = step_ends(analysis)

    n = len(shown)
    ymax = 1.0
    series = []
    seconds = w.seconds
    for k in range(n):
        if len(w):
            a, b = np.searchsorted(w.gid, [k, k + 1])
            x, p, c = w.start[a:b], w.power[a:b], w.code[a:b]
            y = bin_mean(x, p, edges)
            codes = bin_majority(x, c, edges, seconds[a:b])
        else:
            y = bin_mean(s.series[k].time, np.asarray(s.series[k].power, np.float64), edges)
            codes = np.full(len(y), -1)
        series.append((y, codes))
        if np.isfinite(y).any():
            ymax = max(ymax, float(np.nanmax(y)))
    ymax *= 1.08
    # lane k (top to bottom: the first GPU on top) spans [base, base + LANE); power 0..ymax fills its upper part
    base = [(n - 1 - k) * LANE for k in range(n)]
    floor = STRIP * LANE if len(w) else 0.0
    scale = (LANE * 0.92 - floor) / ymax

    present = [p for p in LABELS if len(w) and np.any(w.code == LABELS.index(p))]
    entries = phase_entries(present)
    if spans:
        entries.append(Entry("checkpoint interval (heartbeats)", CHECKPOINT_SHADE, opacity=0.6))
    if len(ticks):
        entries.append(Entry("step end" if every == 1 else f"every {every}th step end", INK, "line", width=1))
    head, head_h = legend(entries, 6)
    labels = [f"{h}:{g}" for h, g in shown]
    left = label_margin(labels + ["steps"])
    lane_px = 90 if n <= 4 else 72 if n <= 8 else 55  # a few GPUs get taller lanes
    top = n * LANE
    xmax = max((analysis.t1 - t0) / unit, 1e-9)  # the whole run: steps and heartbeats may outlast the trace
    box = Box(left, head_h + 16, WIDTH - left - RIGHT, lane_px * (n + STEPS_LANE), 0.0, xmax, 0.0, top + STEPS_LANE)

    x_px, edges_px = box.px(centers), box.px((edges - t0) / unit)
    broken = np.r_[False, np.diff(centers) > gap]  # a gap in the trace breaks the line
    plot = [shade(box, spans, t0, unit)]
    plot.append(
        f'<path d="{hlines_d(box.py(np.add(base, floor)), box.left, box.right)}" stroke="#bbb" stroke-width=".6"/>'
    )
    # each lane's watt scale: a faint line at its top (ymax) and half way, the top labelled in watts
    tops = box.py(np.add(base, floor + ymax * scale))
    halves = box.py(np.add(base, floor + 0.5 * ymax * scale))
    plot.append(f'<path d="{hlines_d(tops, box.left, box.right)}" stroke="#e3e3e3" stroke-width=".6"/>')
    plot.append(f'<path d="{hlines_d(halves, box.left, box.right)}" stroke="#eee" stroke-dasharray="3 3"/>')
    watts = "".join(text(box.right - 2, float(y) + 9, f"{ymax:.0f} W") for y in tops)
    plot.append(f'<g text-anchor="end" fill="#888" font-size="9">{watts}</g>')
    names = []
    for k, (y, codes) in enumerate(series):
        y_px = box.py(base[k] + floor + np.where(broken, np.nan, y) * scale)
        plot.append(tooltip(labels[k], _lane(box, base[k], x_px, y_px, codes, edges_px, bool(len(w)))))
        name = text(box.left - 7, float(box.py(base[k] + LANE / 2)), fit(labels[k], box.left - 14), ' dy=".35em"')
        names.append(tooltip(labels[k], name))
    if len(ticks):
        names.append(text(box.left - 7, float(box.py(top + 0.5 * STEPS_LANE)), "steps", ' dy=".35em"'))
        d = vlines_d(box.px((ticks - t0) / unit), box.py(top + 0.9 * STEPS_LANE), 0.8 * STEPS_LANE * lane_px)
        plot.append(f'<path d="{d}" stroke="{INK}" stroke-width=".7"/>')
    body = [head, clipped(box, "".join(plot)), f'<g text-anchor="end" fill="{INK}">{"".join(names)}</g>']
    xt, xl = nice_ticks(0.0, xmax, 8)
    body.append(f'<path d="M{num(box.left)} {num(box.top)}V{num(box.bottom)}" stroke="{INK}"/>')
    body.append(x_axis(box, xt, xl, f"time since run start ({uname}); each GPU's lane spans 0-{ymax:.0f} W"))
    return svg(box.bottom + 44, "".join(body))


def phase_share_figure(analysis: Analysis) -> str | None:
    """Stacked bars per GPU: share of time and of energy in each phase, a tooltip on every piece.

    The shares are the summary's per-GPU ones (the numbers the page's tables print), not a second pass
    over every window."""
    rows = analysis.summary.phases.per_gpu[:MAX_PANELS]
    if not rows:
        return None
    labels = [f"{r.host}:{r.gpu}" for r in rows]
    shares = [
        np.array([[r.time_share.get(p) or 0.0 for p in LABELS] for r in rows]),
        np.array([[r.energy_share.get(p) or 0.0 for p in LABELS] for r in rows]),
    ]
    present = [p for j, p in enumerate(LABELS) if any(s[:, j].any() for s in shares)]
    head, head_h = legend(phase_entries(present), 6)
    left, gap, row = label_margin(labels), 40.0, 25.0
    panel_w = (WIDTH - left - RIGHT - gap) / 2
    top = head_h + 16 + LABEL_FONT + 10
    n = len(rows)
    body = [head]
    xt = np.linspace(0, 1, 6)
    for i, (share, title) in enumerate(zip(shares, ("share of time", "share of energy"))):
        box = Box(left + i * (panel_w + gap), top, panel_w, row * n, 0.0, 1.0, n - 0.5, -0.5)
        cum = np.concatenate([np.zeros((n, 1)), np.cumsum(share, axis=1)], axis=1)
        xs = box.px(cum)
        bars = []
        for k in range(n):
            y0 = num(box.py(k - 0.375))
            for j in np.flatnonzero(share[k] > 0).tolist():
                tip = f"{labels[k]}: {LABELS[j].replace('_', ' ')} {100 * share[k, j]:.1f}% of {title[9:]}"
                bars.append(
                    f'<rect x="{num(xs[k, j])}" y="{y0}" width="{num(xs[k, j + 1] - xs[k, j])}" '
                    f'height="{num(0.75 * row)}" fill="{PHASE_COLORS[LABELS[j]]}"><title>{escape(tip)}</title></rect>'
                )
        body.append(f'<g shape-rendering="crispEdges">{"".join(bars)}</g>')
        body.append(
            text(box.left + box.width / 2, box.top - 8, title, f' text-anchor="middle" font-size="{LABEL_FONT}"')
        )
        yl = [fit(s, left - 14) for s in labels] if i == 0 else [""] * n
        body.append(y_axis(box, np.arange(n), yl))
        body.append(x_axis(box, xt, [f"{100 * t:.0f}%" for t in xt]))
    return svg(top + row * n + 26, "".join(body))


def steps_figure(analysis: Analysis, steps) -> str | None:
    """Step time (slowest rank) and data wait (mean over ranks) over time, checkpoints shaded."""
    if steps is None or STEP_TIME_S not in steps or not len(steps):
        return None
    t0 = analysis.t0
    x = steps[TIME].to_numpy(float)
    unit, uname = time_unit(analysis.t1 - t0)
    edges = bin_edges(float(x.min()), float(x.max()), 0, 1e-6)
    binned = len(edges) - 1 < len(x)
    st = steps[STEP_TIME_S].to_numpy(float)
    if binned:
        t = ((edges[:-1] + edges[1:]) / 2 - t0) / unit
        lines = [
            (bin_max(x, st, edges), Entry("step time (max in bin)", "#1f77b4", "line", 0.5, 0.8)),
            (bin_mean(x, st, edges), Entry("step time (mean in bin)", "#1f77b4", "line")),
        ]
    else:
        t = (x - t0) / unit
        lines = [(st, Entry("step time (slowest rank)", "#1f77b4", "line"))]
    wait = None
    if DATA_WAIT_S in steps:
        dw = steps[DATA_WAIT_S].to_numpy(float)
        if binned:
            wait = np.nan_to_num(bin_mean(x, dw, edges))
            lines.append((wait, Entry("data wait (mean over ranks, bin mean)", "#ff7f0e", opacity=0.6)))
        else:
            wait = np.nan_to_num(dw)
            lines.append((wait, Entry("data wait (mean over ranks)", "#ff7f0e", opacity=0.6)))
    top_y = max([float(np.nanmax(y)) for y, _ in lines if np.isfinite(y).any()] or [1.0])
    top_y = top_y * 1.05 if top_y > 0 else 1.0
    head, head_h = legend([e for _, e in lines], 6)
    yt, yl = nice_ticks(0.0, top_y, 5)
    left = y_margin(yl, True)
    xmax = max((analysis.t1 - t0) / unit, 1e-9)  # the power figure's time range, so the two line up
    box = Box(left, head_h + 16, WIDTH - left - RIGHT, 220.0, 0.0, xmax, 0.0, top_y)
    tx = box.px(t)
    plot = [shade(box, checkpoint_spans(analysis), t0, unit)]
    for y, e in lines:
        if e.kind == "line":
            alpha = f' stroke-opacity="{e.opacity:g}"' if e.opacity < 1 else ""
            d = path_d(tx, box.py(y))
            plot.append(f'<path d="{d}" stroke="{e.color}" stroke-width="{e.width:g}"{alpha} fill="none"/>')
    if not binned:
        plot.append(dots(tx, box.py(st), "#1f77b4", 2.8))
    if wait is not None:
        plot.append(f'<path d="{_area_d(box, tx, wait, step_pre=not binned)}" fill="#ff7f0e" fill-opacity=".6"/>')
    for seg in analysis.summary.segments[1:]:  # a resized run: where the world size changed
        sx = float(box.px((seg.start - t0) / unit))
        note = f"{seg.world_size} ranks from step {seg.first_step}"
        plot.append(
            f'<path d="M{num(sx)} {num(box.top)}V{num(box.bottom)}" stroke="#8a1414" stroke-dasharray="5 3"/>'
            + text(sx + 3, box.bottom - 4, note, ' font-size="10" fill="#8a1414"')
        )
    body = [head, y_grid(box, yt), clipped(box, "".join(plot)), y_axis(box, yt, yl, "seconds")]
    xt, xl = nice_ticks(0.0, xmax, 8)
    body.append(x_axis(box, xt, xl, f"time since run start ({uname})"))
    return svg(box.bottom + 44, "".join(body))


def _area_d(box: Box, x: np.ndarray, y: np.ndarray, step_pre: bool) -> str:
    """The area between 0 and y, closed along the x axis; step_pre: y[i] holds over (x[i-1], x[i]]."""
    if step_pre:
        x = np.r_[x[0], np.column_stack([x[:-1], x[1:]]).ravel()]
        y = np.r_[y[0], np.repeat(y[1:], 2)]
    zero = float(box.py(0.0))
    d = path_d(np.r_[x[0], x, x[-1]], np.r_[zero, box.py(y), zero])
    return d + "z" if d else ""


TRAIN_COLOR, VALIDATION_COLOR = "#444", "#c0392b"
# one per held-out source's validation curve (dashed), in the sources' order, repeating past the eighth
SOURCE_COLORS = ("#2471a3", "#229954", "#b9770e", "#7d3c98", "#17a589", "#a04000", "#5d6d7e", "#d4ac0d")
LEGEND_STEP, LEGEND_CHAR = 130, 7  # px: the least room a legend entry takes, and about a character's at 11 px


def legend_row(box: Box, entries: list[tuple[str, str]]) -> str:
    """A line mark and a name per (name, color), left to right from the plot's top left corner, wrapping to a
    new row of 14 px where the plot's width ends."""
    out, x, y = [], 0, 0
    for name, color in entries:
        step = max(LEGEND_STEP, 26 + LEGEND_CHAR * len(name))
        if x and box.left + 10 + x + step > box.left + box.width:
            x, y = 0, y + 14
        out.append(
            f'<rect x="{box.left + 10 + x}" y="{20 + y}" width="12" height="3" fill="{color}"/>'
            f'<text x="{box.left + 26 + x}" y="{25 + y}" font-size="11">{escape(name)}</text>'
        )
        x += step
    return "".join(out)


def source_curves(evals, has_eval: bool) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(source, steps, losses) of each held-out source's validation curve: eval.parquet's `loss/<source>`
    columns (with two or more sources), passes without a value left out."""
    if not has_eval:
        return []
    out = []
    for name in eval_sources_of(evals.columns):
        x = evals[STEP].to_numpy(float)
        y = evals[source_loss_column(name)].to_numpy(float, na_value=np.nan)
        keep = np.isfinite(y)
        out.append((name, x[keep], y[keep]))
    return out


def loss_figure(steps, evals=None) -> str | None:
    """Training loss per step and, on the same axes, the validation loss of every pass (eval.parquet), with
    each held-out source's own validation curve (dashed) when there are two or more."""
    has_train = steps is not None and LOSS in steps and steps[LOSS].notna().any()
    has_eval = evals is not None and len(evals) and evals[LOSS].notna().any()
    if not has_train and not has_eval:
        return None
    x = steps[STEP].to_numpy(float) if has_train else np.zeros(0)
    y = steps[LOSS].to_numpy(float) if has_train else np.zeros(0)
    if len(x) > MAX_POINTS:
        edges = bin_edges(float(x.min()), float(x.max()), 0, 1.0)
        x, y = (edges[:-1] + edges[1:]) / 2, bin_mean(x, y, edges)
    ex = evals[STEP].to_numpy(float) if has_eval else np.zeros(0)
    ey = evals[LOSS].to_numpy(float) if has_eval else np.zeros(0)
    curves = source_curves(evals, has_eval)
    all_x = np.concatenate([x, ex, *(cx for _, cx, _ in curves)])
    all_y = np.concatenate([y, ey, *(cy for _, _, cy in curves)])
    x0, x1 = padded(float(np.nanmin(all_x)), float(np.nanmax(all_x)))
    y0, y1 = padded(float(np.nanmin(all_y)), float(np.nanmax(all_y)))
    yt, yl = nice_ticks(y0, y1, 6)
    xt, xl = nice_ticks(x0, x1, 8)
    left = y_margin(yl, True)
    box = Box(left, 14, WIDTH - left - RIGHT, 230.0, x0, x1, y0, y1)
    line = ""
    if len(x):
        line += f'<path d="{path_d(box.px(x), box.py(y))}" stroke="{TRAIN_COLOR}" stroke-width="1.2" fill="none"/>'
        if len(x) <= 200:
            line += dots(box.px(x), box.py(y), TRAIN_COLOR, 3.5)
    if len(ex):
        order = np.argsort(ex)
        px, py = box.px(ex[order]), box.py(ey[order])
        line += f'<path d="{path_d(px, py)}" stroke="{VALIDATION_COLOR}" stroke-width="2" fill="none"/>'
        line += dots(px, py, VALIDATION_COLOR, 5)
    entries = [
        (n, c)
        for n, c, shown in (("training", TRAIN_COLOR, len(x)), ("validation", VALIDATION_COLOR, len(ex)))
        if shown
    ]
    for i, (name, cx, cy) in enumerate(curves):
        color = SOURCE_COLORS[i % len(SOURCE_COLORS)]
        order = np.argsort(cx)
        px, py = box.px(cx[order]), box.py(cy[order])
        line += (
            f'<path d="{path_d(px, py)}" stroke="{color}" stroke-width="1.6" stroke-dasharray="5 3" fill="none">'
            f"<title>{escape(f'validation: {name}')}</title></path>"
        )
        line += dots(px, py, color, 4)
        entries.append((f"validation: {name}", color))
    legend = legend_row(box, entries)
    body = [
        x_grid(box, xt),
        y_grid(box, yt),
        clipped(box, line),
        legend,
        y_axis(box, yt, yl, "loss (token-weighted over ranks)"),
    ]
    body.append(x_axis(box, xt, xl, "optimizer step"))
    return svg(box.bottom + 44, "".join(body))


@dataclass(frozen=True, slots=True)
class Figures:
    """The page's figures as SVG markup, each None where its inputs are missing."""

    lag: str | None = None  # per-GPU lag over time (the Stragglers card)
    power: str | None = None  # power per GPU over time
    phase_share: str | None = None  # phase shares per GPU
    steps: str | None = None  # step time and data wait over time
    loss: str | None = None  # training and validation loss


def render_all(analysis: Analysis, steps, evals=None) -> Figures:
    """Every figure as SVG markup (None where its inputs are missing); `evals` the validation passes."""
    lagging = analysis.inputs.lag
    timeline = lagging.lag.timeline if lagging is not None and lagging.lag is not None else None
    entries = analysis.summary.stragglers.entries
    return Figures(
        lag=lag_figure(timeline, entries, analysis.inputs.window_s, analysis.t0, analysis.t1),
        power=power_figure(analysis),
        phase_share=phase_share_figure(analysis),
        steps=steps_figure(analysis, steps),
        loss=loss_figure(steps, evals),
    )

"""Report figures as PNG bytes (matplotlib's Agg canvas, no pyplot state).

Long runs are binned to at most MAX_POINTS points per series before drawing,
so a 16 GPU x 24 h run draws as fast as a short one. Many GPUs share one axes
(a lane each) and stacked bars are one collection of rectangles: matplotlib's
per-axes tick machinery and per-patch drawing, not the data, were the cost.
PNGs carry no software or time stamp, so the same data gives the same bytes.
"""

from __future__ import annotations

import io

import numpy as np

from wattgate.report.phases import PHASE_COLORS
from wattgate.report.summary import Analysis
from wattgate.power.triage.phases import LABELS

MAX_POINTS = 2000  # per series: about one point per pixel column
MAX_STEP_TICKS = 120  # step boundaries drawn; more are thinned to every n-th
MAX_PANELS = 32  # GPUs drawn, one lane each
DPI = 100
LEGEND_IN = 0.4  # figure-level legend above the axes
AXIS_IN = 0.45  # x tick labels and axis label below them
WIDTH_IN = 11.0
CHECKPOINT_SHADE = "#c5b0d5"
STYLE = {
    "font.size": 8.5,
    "axes.titlesize": 10,
    "axes.labelsize": 8.5,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.hashsalt": "wattgate",
    "path.simplify": True,
}


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


def bin_mean(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of y per bin (NaN for an empty bin or one with only NaN)."""
    ok = np.isfinite(y)
    b = np.clip(np.searchsorted(edges, x[ok], side="right") - 1, 0, len(edges) - 2)
    n = np.bincount(b, minlength=len(edges) - 1)
    s = np.bincount(b, weights=y[ok], minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def bin_max(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    ok = np.isfinite(y)
    b = np.clip(np.searchsorted(edges, x[ok], side="right") - 1, 0, len(edges) - 2)
    out = np.full(len(edges) - 1, -np.inf)
    np.maximum.at(out, b, y[ok])
    return np.where(np.isfinite(out), out, np.nan)


def bin_majority(x: np.ndarray, code: np.ndarray, edges: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The phase holding most of each bin's time (-1 for an empty bin)."""
    nl = len(LABELS)
    b = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    counts = np.bincount(b * nl + code, weights=weight, minlength=(len(edges) - 1) * nl).reshape(-1, nl)
    best = counts.argmax(axis=1)
    return np.where(counts.sum(axis=1) > 0, best, -1)


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _figure(height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def checkpoint_spans(analysis: Analysis) -> list[tuple[float, float]]:
    """Closed checkpoint/export intervals of any rank (heartbeat events), merged, in unix seconds."""
    ev = analysis.inputs.events
    if ev is None or ev.empty:
        return []
    ev = ev.sort_values(["rank", "time"], kind="stable")
    nxt = ev.groupby("rank")["time"].shift(-1)
    ck = ev["phase"].isin(["checkpoint", "export"]) & nxt.notna()
    spans = sorted(zip(ev["time"][ck].astype(float), nxt[ck].astype(float)))
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def step_ends(analysis: Analysis) -> tuple[np.ndarray, int]:
    """Step end times (the last rank's) thinned to at most MAX_STEP_TICKS, and the thinning factor."""
    m = analysis.inputs.metrics
    if m is None or m.empty:
        return np.zeros(0), 1
    ends = m.groupby("step", sort=True)["time"].max().to_numpy(float)
    every = max(1, int(np.ceil(len(ends) / MAX_STEP_TICKS)))
    return ends[every - 1 :: every], every


def _shade_checkpoints(ax, spans, t0: float, unit: float) -> None:
    """Full-height bands (one collection per axes: hundreds of axvspans cost seconds)."""
    if not spans:
        return
    from matplotlib.collections import PolyCollection

    verts = [[((a - t0) / unit, 0), ((a - t0) / unit, 1), ((b - t0) / unit, 1), ((b - t0) / unit, 0)] for a, b in spans]
    ax.add_collection(
        PolyCollection(
            verts, facecolors=CHECKPOINT_SHADE, alpha=0.45, linewidths=0, zorder=0, transform=ax.get_xaxis_transform()
        ),
        autolim=False,
    )


# ---------------------------------------------------------------- figures


def _phase_lines(ax, x: np.ndarray, lanes: list[tuple[np.ndarray, np.ndarray]], gap: float) -> None:
    """Every lane's power line, each piece in the colour of its bin's phase, as one Line2D per phase:
    the lanes are laid end to end with a NaN between them (gaps and empty bins break a line too), so
    16 GPUs draw as fast as one."""
    if not lanes:
        return
    breaks = np.r_[False, np.diff(x) > gap]
    xs = np.concatenate([np.r_[x, np.nan] for _ in lanes])
    ys = np.concatenate([np.r_[np.where(breaks, np.nan, y), np.nan] for y, _ in lanes])
    cs = np.concatenate([np.r_[c, -2] for _, c in lanes])
    for i, p in enumerate(LABELS + ("",)):
        mine = cs == (i if p else -1)
        if not mine.any():
            continue
        # a bin's piece runs from its point to the next one, so each run of the phase keeps the point after it
        keep = mine | np.r_[False, mine[:-1]]
        ax.plot(xs, np.where(keep, ys, np.nan), color=PHASE_COLORS.get(p, "#555555"), lw=1.0)


def _code_rects(ax, rows: list[np.ndarray], edges: np.ndarray, y0: list[float], height: float) -> None:
    """Runs of one code per row as rectangles [edge_a, edge_b) x [y0, y0 + height), coloured by phase, in
    one collection (an image of the strips resamples the whole axes; hundreds of bar patches draw slowly)."""
    from matplotlib.collections import PolyCollection

    verts, colors = [], []
    palette = [PHASE_COLORS[p] for p in LABELS]
    for codes, y in zip(rows, y0):
        change = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        ends = np.r_[change[1:], len(codes)]
        for a, b in zip(change, ends):
            c = int(codes[a])
            if c < 0:
                continue
            xa, xb = float(edges[a]), float(edges[b])
            verts.append(((xa, y), (xa, y + height), (xb, y + height), (xb, y)))
            colors.append(palette[c])
    if verts:
        ax.add_collection(
            PolyCollection(verts, facecolors=colors, edgecolors="none", linewidths=0, zorder=1, antialiased=False),
            autolim=False,
        )


LANE = 1.0  # power lanes on one axes: GPU k's strip and 0..ymax drawn in [base, base + 0.92 LANE)
STRIP = 0.1  # its phase strip at the bottom of the lane (share of LANE)
STEPS_LANE = 0.45  # the step ticks above the GPUs


def power_figure(analysis: Analysis) -> bytes | None:
    """Power over time per GPU, coloured by phase, with a phase strip, checkpoints shaded and step ticks.

    One axes, one lane per GPU (offset series sharing one power scale): a figure of 17 axes spent most of
    its time in tick machinery."""
    w, energy, s = analysis.windows, analysis.energy, analysis.inputs.samples
    if not len(w) and (energy is None or s is None):
        return None
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator

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
    for k in range(n):
        if len(w):
            a, b = np.searchsorted(w.gid, [k, k + 1])
            x, p, c = w.start[a:b], w.power[a:b], w.code[a:b]
            y = bin_mean(x, p, edges)
            codes = bin_majority(x, c, edges, w.seconds[a:b])
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
    lanes = [(base[k] + floor + y * scale, c) for k, (y, c) in enumerate(series)]

    height = LEGEND_IN + 0.3 + (0.9 if n <= 4 else 0.55) * n + AXIS_IN  # a few GPUs get taller lanes
    fig = _figure(height)
    ax = fig.add_axes((0.09, AXIS_IN / height, 0.895, 1 - (LEGEND_IN + AXIS_IN) / height))
    _shade_checkpoints(ax, spans, t0, unit)
    ax.hlines([b + floor for b in base], 0, 1, transform=ax.get_yaxis_transform(), color="#bbbbbb", lw=0.4, zorder=0.5)
    _phase_lines(ax, centers, lanes, gap)
    if len(w):
        _code_rects(ax, [c for _, c in series], (edges - t0) / unit, base, STRIP * LANE)
    top = n * LANE
    if len(ticks):
        ax.vlines((ticks - t0) / unit, top + 0.1 * STEPS_LANE, top + 0.9 * STEPS_LANE, color="#333333", lw=0.5)
    ax.set_xlim(0, (analysis.t1 - t0) / unit)  # the whole run: steps and heartbeats may outlast the trace
    ax.set_ylim(0, top + STEPS_LANE)
    ax.yaxis.set_major_locator(FixedLocator([b + LANE / 2 for b in base] + [top + STEPS_LANE / 2]))
    ax.set_yticklabels([f"{h}:{g}" for h, g in shown] + ["steps"])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(f"time since run start ({uname}); each GPU's lane spans 0-{ymax:.0f} W")
    present = [p for p in LABELS if len(w) and np.any(w.code == LABELS.index(p))]
    handles = [Patch(color=PHASE_COLORS[p], label=p.replace("_", " ")) for p in present]
    handles.append(Patch(color=CHECKPOINT_SHADE, alpha=0.6, label="checkpoint interval (heartbeats)"))
    handles.append(Patch(color="#333333", label="step end" if every == 1 else f"every {every}th step end"))
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 5), frameon=False, bbox_to_anchor=(0.5, 1.0))
    return png_bytes(fig)


def phase_share_figure(analysis: Analysis) -> bytes | None:
    """Stacked bars per GPU: share of time and of energy in each phase (one collection of rectangles per
    axes: hundreds of bar patches cost more than the rest of the figure)."""
    w = analysis.windows
    if not len(w):
        return None
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator

    from wattgate.report.phases import totals

    keys = w.keys[:MAX_PANELS]
    secs, joules = totals(w, w.gid, len(w.keys))
    secs, joules = secs[: len(keys)], joules[: len(keys)]
    labels = [f"{h}:{g}" for h, g in keys]
    height = LEGEND_IN + 0.3 + 0.25 * len(keys) + AXIS_IN
    fig = _figure(height)
    bottom, top = AXIS_IN / height, 1 - (LEGEND_IN + 0.25) / height
    present = np.zeros(len(LABELS), bool)
    for i, (values, title) in enumerate(((secs, "share of time"), (joules, "share of energy"))):
        ax = fig.add_axes((0.09 + i * 0.4775, bottom, 0.4175, top - bottom))
        total = values.sum(axis=1, keepdims=True)
        share = np.divide(values, total, out=np.zeros_like(values), where=total > 0)
        present |= share.any(axis=0)
        cum = np.concatenate([np.zeros((len(keys), 1)), np.cumsum(share, axis=1)], axis=1)
        # 0.75-high stacked bars, one rectangle per (GPU, phase present), in one collection
        on = [(k, j) for k in range(len(keys)) for j in range(len(LABELS)) if share[k, j] > 0]
        ax.add_collection(
            PolyCollection(
                [
                    (
                        (cum[k, j], k - 0.375),
                        (cum[k, j], k + 0.375),
                        (cum[k, j + 1], k + 0.375),
                        (cum[k, j + 1], k - 0.375),
                    )
                    for k, j in on
                ],
                facecolors=[PHASE_COLORS[LABELS[j]] for _, j in on],
                edgecolors="none",
                linewidths=0,
                antialiased=False,
            ),
            autolim=False,
        )
        ax.set_xlim(0, 1)
        ax.set_ylim(len(keys) - 0.5, -0.5)
        ax.set_title(title)
        ax.xaxis.set_major_locator(FixedLocator([0, 0.2, 0.4, 0.6, 0.8, 1.0]))
        ax.xaxis.set_major_formatter(_percent())
        ax.yaxis.set_major_locator(FixedLocator(np.arange(len(keys))))
        if i == 0:
            ax.set_yticklabels(labels)
        else:
            ax.tick_params(axis="y", labelleft=False)
    handles = [Patch(color=PHASE_COLORS[p], label=p.replace("_", " ")) for i, p in enumerate(LABELS) if present[i]]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, 1.0))
    return png_bytes(fig)


def _percent():
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0, decimals=0)


def steps_figure(analysis: Analysis, steps) -> bytes | None:
    """Step time (slowest rank) and data wait (mean over ranks) over time, checkpoints shaded."""
    if steps is None or "step_time_s" not in steps or not len(steps):
        return None
    t0 = analysis.t0
    x = steps["time"].to_numpy(float)
    unit, uname = time_unit(analysis.t1 - t0)
    edges = bin_edges(float(x.min()), float(x.max()), 0, 1e-6)
    binned = len(edges) - 1 < len(x)
    fig = _figure(3.2)
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.09, right=0.985, top=0.88, bottom=0.16)
    _shade_checkpoints(ax, checkpoint_spans(analysis), t0, unit)
    st = steps["step_time_s"].to_numpy(float)
    if binned:
        cx = ((edges[:-1] + edges[1:]) / 2 - t0) / unit
        ax.plot(cx, bin_max(x, st, edges), color="#1f77b4", lw=0.6, alpha=0.5, label="step time (max in bin)")
        ax.plot(cx, bin_mean(x, st, edges), color="#1f77b4", lw=1.0, label="step time (mean in bin)")
    else:
        ax.plot((x - t0) / unit, st, color="#1f77b4", lw=1.0, marker=".", ms=2, label="step time (slowest rank)")
    if "data_wait_s" in steps:
        dw = steps["data_wait_s"].to_numpy(float)
        if binned:
            ax.fill_between(
                cx,
                0,
                np.nan_to_num(bin_mean(x, dw, edges)),
                color="#ff7f0e",
                alpha=0.6,
                lw=0,
                label="data wait (mean over ranks, bin mean)",
            )
        else:
            ax.fill_between(
                (x - t0) / unit,
                0,
                dw,
                color="#ff7f0e",
                alpha=0.6,
                lw=0,
                step="pre",
                label="data wait (mean over ranks)",
            )
    ax.set_ylim(bottom=0)
    for seg in analysis.summary.get("segments", [])[1:]:  # a resized run: where the world size changed
        ax.axvline((seg["start"] - t0) / unit, color="#8a1414", lw=1.0, ls="--")
        ax.annotate(
            f"{seg['world_size']} ranks from step {seg['first_step']}",
            ((seg["start"] - t0) / unit, 0),
            xycoords=("data", "axes fraction"),
            xytext=(3, 4),
            textcoords="offset points",
            fontsize=7,
            color="#8a1414",
        )
    ax.set_xlim(0, (analysis.t1 - t0) / unit)  # the power figure's time range, so the two line up
    ax.set_xlabel(f"time since run start ({uname})")
    ax.set_ylabel("seconds")
    ax.grid(axis="y", lw=0.3, alpha=0.5)
    ax.legend(loc="upper center", ncol=3, frameon=False, bbox_to_anchor=(0.5, 1.16))
    return png_bytes(fig)


def loss_figure(steps) -> bytes | None:
    if steps is None or "loss" not in steps or not steps["loss"].notna().any():
        return None
    x, y = steps["step"].to_numpy(float), steps["loss"].to_numpy(float)
    fig = _figure(2.8)
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.09, right=0.985, top=0.92, bottom=0.17)
    if len(x) > MAX_POINTS:
        edges = bin_edges(float(x.min()), float(x.max()), 0, 1.0)
        ax.plot((edges[:-1] + edges[1:]) / 2, bin_mean(x, y, edges), color="#444444", lw=1.0, label="loss (bin mean)")
    else:
        ax.plot(x, y, color="#444444", lw=1.0, marker="." if len(x) <= 200 else None, ms=3, label="loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token-weighted over ranks)")
    ax.grid(lw=0.3, alpha=0.5)
    return png_bytes(fig)


def render_all(analysis: Analysis, steps) -> dict[str, bytes | None]:
    """Every figure by name (None where its inputs are missing), drawn under one style."""
    import matplotlib

    with matplotlib.rc_context(STYLE):
        return {
            "power": power_figure(analysis),
            "phase_share": phase_share_figure(analysis),
            "steps": steps_figure(analysis, steps),
            "loss": loss_figure(steps),
        }

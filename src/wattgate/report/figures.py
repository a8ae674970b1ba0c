"""Report figures as inline SVG markup, built with numpy and f-strings (no plotting library to import).

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
from functools import lru_cache
from itertools import chain
from html import escape

import numpy as np

from wattgate.report.phases import PHASE_COLORS
from wattgate.report.summary import Analysis
from wattgate.power.triage.phases import LABELS

MAX_POINTS = 2000  # per series: about one point per pixel column
MAX_STEP_TICKS = 120  # step boundaries drawn; more are thinned to every n-th
MAX_PANELS = 32  # GPUs drawn, one lane each
WIDTH = 1100  # px: about the page's content width, so a figure shows near 1:1
CHECKPOINT_SHADE = "#c5b0d5"
NO_PHASE = "#555555"  # power of bins without a phase (no triage)
INK = "#333333"  # axes, ticks and text
FONT = 11  # px: tick labels and legend
LABEL_FONT = 12  # px: axis labels and titles
CHAR_W = 0.6  # average glyph width in em, to lay text out without measuring it
LEGEND_ROW = 17

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
    if analysis.steps is not None:  # the same per-step maximum, already grouped
        ends = analysis.steps["time"].to_numpy(float)
    else:
        m = analysis.inputs.metrics
        if m is None or m.empty:
            return np.zeros(0), 1
        ends = m.groupby("step", sort=True)["time"].max().to_numpy(float)
    every = max(1, int(np.ceil(len(ends) / MAX_STEP_TICKS)))
    return ends[every - 1 :: every], every


# ---------------------------------------------------------------- svg pieces


@lru_cache(maxsize=1 << 16)
def _tenth(k: int) -> str:
    """k tenths as the shortest decimal text: 5 -> '.5', -12 -> '-1.2', 20 -> '2'."""
    whole, frac = divmod(abs(k), 10)
    text = (str(whole) if whole or not frac else "") + (f".{frac}" if frac else "")
    return "-" + text if k < 0 else text


def tenths(v) -> np.ndarray:
    """Pixels as whole tenths of a pixel."""
    return np.rint(np.asarray(v, np.float64) * 10).astype(np.int64)


def num(v: float) -> str:
    """One coordinate or length, rounded to a tenth of a pixel."""
    return _tenth(int(np.rint(float(v) * 10)))


def _texts(k: np.ndarray) -> list[str]:
    return list(map(_tenth, k.tolist()))


def text_width(text: str, size: float = FONT) -> float:
    return len(text) * size * CHAR_W


def _shifted(a: np.ndarray, by: int, fill) -> np.ndarray:
    """a moved `by` places later (earlier when negative), `fill` in the places left empty."""
    out = np.full_like(a, fill)
    if by > 0:
        out[by:] = a[:-by]
    else:
        out[:by] = a[-by:]
    return out


def path_d(x: np.ndarray, y: np.ndarray) -> str:
    """Path data of a polyline in pixels, broken at NaN; a lone point draws nothing, as in a line plot.

    Each piece is its first point, then relative moves; a point that lies straight between its
    neighbours (a flat stretch, say) is left out, since the line through it is the same."""
    ok = np.isfinite(x) & np.isfinite(y)
    X, Y = tenths(np.where(ok, x, 0.0)), tenths(np.where(ok, y, 0.0))
    before, after = _shifted(ok, 1, False), _shifted(ok, -1, False)
    dx, dy = X - _shifted(X, 1, 0), Y - _shifted(Y, 1, 0)  # from the previous point
    nx, ny = _shifted(dx, -1, 0), _shifted(dy, -1, 0)  # to the next
    straight = before & after & (dx * ny == dy * nx) & (dx * nx + dy * ny > 0)
    keep = np.flatnonzero(ok & (before | after) & ~straight)
    if not len(keep):
        return ""
    start = (ok & ~before)[keep]
    X, Y = X[keep], Y[keep]
    xs, ys = _texts(X - _shifted(X, 1, 0)), _texts(Y - _shifted(Y, 1, 0))
    for i in np.flatnonzero(start).tolist():
        xs[i], ys[i] = "M" + _tenth(int(X[i])), _tenth(int(Y[i]))
        if i + 1 < len(xs):
            xs[i + 1] = "l" + xs[i + 1]
    # every number joined by a space, then the spaces the path grammar does without dropped
    return " ".join(chain.from_iterable(zip(xs, ys))).replace(" -", "-").replace(" M", "M").replace(" l", "l")


def dots_d(x: np.ndarray, y: np.ndarray) -> str:
    """Zero-length pieces at each point: with round caps they draw as dots (markers without ids)."""
    ok = np.isfinite(x) & np.isfinite(y)
    X, Y = tenths(x[ok]), tenths(y[ok])
    if not len(X):
        return ""
    moves = zip(_texts(np.diff(X)), _texts(np.diff(Y)))
    return (f"M{_tenth(int(X[0]))} {_tenth(int(Y[0]))}h0" + "".join([f"m{a} {b}h0" for a, b in moves])).replace(
        " -", "-"
    )


def dots(x: np.ndarray, y: np.ndarray, color: str, size: float) -> str:
    return f'<path d="{dots_d(x, y)}" stroke="{color}" stroke-width="{size:g}" stroke-linecap="round" fill="none"/>'


def rects_d(xa: np.ndarray, xb: np.ndarray, y: float, h: float) -> str:
    """Rectangles [xa, xb) x [y, y + h) in pixels as one path (wide enough to show only)."""
    A, W = tenths(xa), tenths(xb) - tenths(xa)
    on = W > 0
    top, tall = num(y), num(h)
    return "".join([f"M{a} {top}h{w}v{tall}h-{w}z" for a, w in zip(_texts(A[on]), _texts(W[on]))])


def vlines_d(x: np.ndarray, y: float, h: float) -> str:
    top, tall = num(y), num(h)
    return "".join([f"M{a} {top}v{tall}" for a in _texts(tenths(x))])


def hlines_d(y: np.ndarray, x0: float, x1: float) -> str:
    left, right = num(x0), num(x1)
    return "".join([f"M{left} {b}H{right}" for b in _texts(tenths(y))])


def text(x: float, y: float, s: str, attrs: str = "") -> str:
    return f'<text x="{num(x)}" y="{num(y)}"{attrs}>{escape(s)}</text>'


def svg(height: float, body: str) -> str:
    """The figure's root: WIDTH px wide, scaled down by the page when narrower (viewBox)."""
    h = num(height)
    return f'<svg viewBox="0 0 {WIDTH} {h}" width="{WIDTH}" height="{h}" font-size="{FONT}">{body}</svg>'


def fit(s: str, width: float, size: float = FONT) -> str:
    """s cut to about `width` px with an ellipsis in the middle: GPUs of one cluster differ at the end."""
    n = int(width / (size * CHAR_W))
    if len(s) <= n:
        return s
    head = max(1, (n - 1) * 2 // 5)
    return s[:head] + "…" + s[len(s) - max(1, n - 1 - head) :]


# ---------------------------------------------------------------- axes


@dataclass(frozen=True)
class Box:
    """A plot area: its pixel rectangle and the data range shown in it (y1 < y0 turns the y axis over)."""

    left: float
    top: float
    width: float
    height: float
    x0: float
    x1: float
    y0: float
    y1: float

    @property
    def right(self) -> float:
        return self.left + self.width

    @property
    def bottom(self) -> float:
        return self.top + self.height

    def px(self, x) -> np.ndarray:
        return self.left + (np.asarray(x, np.float64) - self.x0) * (self.width / (self.x1 - self.x0))

    def py(self, y) -> np.ndarray:
        return self.bottom - (np.asarray(y, np.float64) - self.y0) * (self.height / (self.y1 - self.y0))


def nice_ticks(lo: float, hi: float, target: int = 6) -> tuple[np.ndarray, list[str]]:
    """Round ticks inside [lo, hi], 1, 2, 2.5 or 5 times a power of ten apart, and their labels."""
    if not hi > lo:
        return np.array([lo]), [f"{lo:,g}"]
    raw = (hi - lo) / target
    mag = 10.0 ** np.floor(np.log10(raw))
    mult = next(m for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    step = mult * mag
    first = np.ceil(lo / step - 1e-9)
    ticks = (first + np.arange(int(np.floor(hi / step + 1e-9) - first) + 1)) * step
    decimals = max(0, -int(np.floor(np.log10(step) + 1e-9))) + (1 if mult == 2.5 and step < 10 else 0)
    return ticks, [f"{t + 0.0:,.{decimals}f}" for t in ticks]  # + 0.0: no "-0"


def padded(lo: float, hi: float, share: float = 0.05) -> tuple[float, float]:
    """The data range with a margin each side (a line plot's default view)."""
    if not hi > lo:
        return lo - 0.5, hi + 0.5
    m = (hi - lo) * share
    return lo - m, hi + m


def clipped(box: Box, body: str) -> str:
    """body drawn only inside the box, as a plot clips to its axes: a nested svg clips, with no id to refer to."""
    at = f'x="{num(box.left)}" y="{num(box.top)}" width="{num(box.width)}" height="{num(box.height)}"'
    view = f"{num(box.left)} {num(box.top)} {num(box.width)} {num(box.height)}"
    return f'<svg {at} viewBox="{view}">{body}</svg>'


def x_axis(box: Box, ticks: np.ndarray, labels: list[str], title: str = "") -> str:
    """Bottom spine, tick marks, tick labels and the axis title under them."""
    xs = box.px(ticks)
    spine = f"M{num(box.left)} {num(box.bottom)}H{num(box.right)}" + vlines_d(xs, box.bottom, 4)
    tick_text = "".join(text(x, box.bottom + 16, s) for x, s in zip(xs, labels))
    out = f'<path d="{spine}" stroke="{INK}" fill="none"/><g text-anchor="middle" fill="{INK}">{tick_text}'
    if title:
        out += text(box.left + box.width / 2, box.bottom + 34, title, f' font-size="{LABEL_FONT}"')
    return out + "</g>"


def y_axis(box: Box, ticks: np.ndarray, labels: list[str], title: str = "") -> str:
    """Left spine, tick marks, tick labels and the axis title turned up beside them."""
    ys = box.py(ticks)
    spine = f"M{num(box.left)} {num(box.top)}V{num(box.bottom)}" + hlines_d(ys, box.left - 4, box.left)
    tick_text = "".join(text(box.left - 7, y, s, ' dy=".35em"') for y, s in zip(ys, labels) if s)
    out = f'<path d="{spine}" stroke="{INK}" fill="none"/><g text-anchor="end" fill="{INK}">{tick_text}</g>'
    if title:
        x = box.left - 7 - max(text_width(s) for s in labels) - 8
        y = box.top + box.height / 2
        out += (
            f'<text transform="rotate(-90 {num(x)} {num(y)})" x="{num(x)}" y="{num(y)}" text-anchor="middle" '
            f'font-size="{LABEL_FONT}" fill="{INK}">{escape(title)}</text>'
        )
    return out


def y_grid(box: Box, ticks: np.ndarray) -> str:
    return f'<path d="{hlines_d(box.py(ticks), box.left, box.right)}" stroke="#000" stroke-opacity=".12"/>'


def x_grid(box: Box, ticks: np.ndarray) -> str:
    return f'<path d="{vlines_d(box.px(ticks), box.top, box.height)}" stroke="#000" stroke-opacity=".12"/>'


def y_margin(labels: list[str], title: bool) -> float:
    """Left margin for y tick labels (and a turned-up title beside them)."""
    return 7 + max(text_width(s) for s in labels) + (8 + LABEL_FONT + 8 if title else 10)


@dataclass(frozen=True)
class Entry:
    """A legend entry: its label and swatch ("patch": a filled square, "line": a stroke of `width`)."""

    label: str
    color: str
    kind: str = "patch"
    opacity: float = 1.0
    width: float = 1.4


def legend(entries: list[Entry], top: float) -> tuple[str, float]:
    """Entries centred in rows across the figure from `top` down, wrapped; the markup and its height."""
    if not entries:
        return "", 0.0
    widths = [22 + text_width(e.label) + 18 for e in entries]
    rows: list[list[int]] = [[]]
    for i, w in enumerate(widths):
        if rows[-1] and sum(widths[j] for j in rows[-1]) + w > WIDTH - 40:
            rows.append([])
        rows[-1].append(i)
    out = []
    for r, row in enumerate(rows):
        x = (WIDTH - sum(widths[j] for j in row) + 18) / 2
        y = top + r * LEGEND_ROW + LEGEND_ROW / 2
        for j in row:
            e = entries[j]
            if e.kind == "line":
                alpha = f' stroke-opacity="{e.opacity:g}"' if e.opacity < 1 else ""
                out.append(f'<path d="M{num(x)} {num(y)}h16" stroke="{e.color}" stroke-width="{e.width:g}"{alpha}/>')
            else:
                alpha = f' fill-opacity="{e.opacity:g}"' if e.opacity < 1 else ""
                out.append(f'<rect x="{num(x)}" y="{num(y - 5)}" width="16" height="10" fill="{e.color}"{alpha}/>')
            out.append(text(x + 22, y, e.label, ' dy=".35em"'))
            x += widths[j]
    return f'<g fill="{INK}">{"".join(out)}</g>', len(rows) * LEGEND_ROW


def shade(box: Box, spans: list[tuple[float, float]], t0: float, unit: float) -> str:
    """Checkpoint intervals as full-height bands (one path)."""
    if not spans:
        return ""
    a, b = (np.array(s, np.float64) for s in zip(*spans))
    xa = np.clip(box.px((a - t0) / unit), box.left, box.right)
    xb = np.clip(box.px((b - t0) / unit), box.left, box.right)
    d = rects_d(xa, xb, box.top, box.height)
    return f'<path d="{d}" fill="{CHECKPOINT_SHADE}" fill-opacity=".45"/>' if d else ""


def phase_entries(present: list[str]) -> list[Entry]:
    return [Entry(p.replace("_", " "), PHASE_COLORS[p]) for p in present]


def code_runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, end, code) of each run of equal codes."""
    first = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    return first, np.r_[first[1:], len(codes)], codes[first]


# ---------------------------------------------------------------- figures

LANE = 1.0  # power lanes on one axes: GPU k's strip and 0..ymax drawn in [base, base + 0.92 LANE)
STRIP = 0.1  # its phase strip at the bottom of the lane (share of LANE)
STEPS_LANE = 0.45  # the step ticks above the GPUs
RIGHT = 16  # px right of every plot


def label_margin(labels: list[str]) -> float:
    """Left margin for lane labels: the longest one, within bounds (longer names are cut, in full in the tooltip)."""
    return min(max(60.0, max(text_width(s) for s in labels) + 14), 240.0)


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


def tooltip(tip: str, body: str) -> str:
    """body in a group whose tooltip is `tip`."""
    return f"<g><title>{escape(tip)}</title>{body}</g>"


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
    lane_px = 90 if n <= 4 else 55  # a few GPUs get taller lanes
    top = n * LANE
    xmax = max((analysis.t1 - t0) / unit, 1e-9)  # the whole run: steps and heartbeats may outlast the trace
    box = Box(left, head_h + 16, WIDTH - left - RIGHT, lane_px * (n + STEPS_LANE), 0.0, xmax, 0.0, top + STEPS_LANE)

    x_px, edges_px = box.px(centers), box.px((edges - t0) / unit)
    broken = np.r_[False, np.diff(centers) > gap]  # a gap in the trace breaks the line
    plot = [shade(box, spans, t0, unit)]
    plot.append(
        f'<path d="{hlines_d(box.py(np.add(base, floor)), box.left, box.right)}" stroke="#bbb" stroke-width=".6"/>'
    )
    names = []
    for k, (y, codes) in enumerate(series):
        y_px = box.py(base[k] + floor + np.where(broken, np.nan, y) * scale)
        plot.append(tooltip(labels[k], _lane(box, base[k], x_px, y_px, codes, edges_px, bool(len(w)))))
        name = text(box.left - 7, float(box.py(base[k] + LANE / 2)), fit(labels[k], box.left - 14), ' dy=".35em"')
        names.append(tooltip(labels[k], name))
    names.append(text(box.left - 7, float(box.py(top + 0.5 * STEPS_LANE)), "steps", ' dy=".35em"'))
    if len(ticks):
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
    rows = analysis.summary["phases"].get("per_gpu", [])[:MAX_PANELS]
    if not rows:
        return None
    labels = [f"{r['host']}:{r['gpu']}" for r in rows]
    shares = [
        np.array([[r[key].get(p) or 0.0 for p in LABELS] for r in rows]) for key in ("time_share", "energy_share")
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
    if steps is None or "step_time_s" not in steps or not len(steps):
        return None
    t0 = analysis.t0
    x = steps["time"].to_numpy(float)
    unit, uname = time_unit(analysis.t1 - t0)
    edges = bin_edges(float(x.min()), float(x.max()), 0, 1e-6)
    binned = len(edges) - 1 < len(x)
    st = steps["step_time_s"].to_numpy(float)
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
    if "data_wait_s" in steps:
        dw = steps["data_wait_s"].to_numpy(float)
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
    for seg in analysis.summary.get("segments", [])[1:]:  # a resized run: where the world size changed
        sx = float(box.px((seg["start"] - t0) / unit))
        note = f"{seg['world_size']} ranks from step {seg['first_step']}"
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


def loss_figure(steps) -> str | None:
    if steps is None or "loss" not in steps or not steps["loss"].notna().any():
        return None
    x, y = steps["step"].to_numpy(float), steps["loss"].to_numpy(float)
    if len(x) > MAX_POINTS:
        edges = bin_edges(float(x.min()), float(x.max()), 0, 1.0)
        x, y = (edges[:-1] + edges[1:]) / 2, bin_mean(x, y, edges)
    x0, x1 = padded(float(np.nanmin(x)), float(np.nanmax(x)))
    y0, y1 = padded(float(np.nanmin(y)), float(np.nanmax(y)))
    yt, yl = nice_ticks(y0, y1, 6)
    xt, xl = nice_ticks(x0, x1, 8)
    left = y_margin(yl, True)
    box = Box(left, 14, WIDTH - left - RIGHT, 230.0, x0, x1, y0, y1)
    line = f'<path d="{path_d(box.px(x), box.py(y))}" stroke="#444" stroke-width="1.2" fill="none"/>'
    if len(x) <= 200:
        line += dots(box.px(x), box.py(y), "#444", 3.5)
    body = [
        x_grid(box, xt),
        y_grid(box, yt),
        clipped(box, line),
        y_axis(box, yt, yl, "loss (token-weighted over ranks)"),
    ]
    body.append(x_axis(box, xt, xl, "optimizer step"))
    return svg(box.bottom + 44, "".join(body))


def render_all(analysis: Analysis, steps) -> dict[str, str | None]:
    """Every figure by name as SVG markup (None where its inputs are missing)."""
    return {
        "power": power_figure(analysis),
        "phase_share": phase_share_figure(analysis),
        "steps": steps_figure(analysis, steps),
        "loss": loss_figure(steps),
    }

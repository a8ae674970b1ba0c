"""SVG markup primitives and axes for the report's figures (report/figures.py draws with them).

Pixel coordinates are rounded to tenths, every text is escaped, and nothing carries an id, so the same
data gives the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from html import escape

import numpy as np

from wattgate.report.phases import PHASE_COLORS

WIDTH = 1100  # px: about the page's content width, so a figure shows near 1:1
CHECKPOINT_SHADE = "#c5b0d5"
INK = "#333333"  # axes, ticks and text
FONT = 11  # px: tick labels and legend
LABEL_FONT = 12  # px: axis labels and titles
CHAR_W = 0.6  # average glyph width in em, to lay text out without measuring it
LEGEND_ROW = 17

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


def label_margin(labels: list[str]) -> float:
    """Left margin for lane labels: the longest one, within bounds (longer names are cut, in full in the tooltip)."""
    return min(max(60.0, max(text_width(s) for s in labels) + 14), 240.0)


def tooltip(tip: str, body: str) -> str:
    """body in a group whose tooltip is `tip`."""
    return f"<g><title>{escape(tip)}</title>{body}</g>"

"""Pieces of the report's Plotly figures, written as the JSON plotly.js draws from (report/figures.py and the
Stragglers card build their figures with them; report/plotly_page.py puts them on the page).

The figures are plain dicts, not plotly.graph_objects: building and validating those costs more than the whole
report of a day's trace, and the JSON must be the same bytes for the same data. So every number is rounded
here, NaN becomes null (a gap in a line), and every text the data brings (host names, source names) is
escaped, since plotly.js reads its texts as a little HTML.
"""

from __future__ import annotations

from html import escape

import numpy as np

CHECKPOINT_SHADE = "#c5b0d5"
INK = "#333333"  # step ends, texts
FONT = {"size": 11, "color": INK}
ROW_GAP_PX = 16  # between stacked rows: room for the row's name above it
MARGIN = {"l": 64, "r": 16, "t": 10, "b": 48}
LEGEND_PX = 34  # a legend row above the plot


def text(s: str) -> str:
    """A text from the data as plotly.js shows it: its HTML escaped, and % too (hover templates read %{...})."""
    return escape(s).replace("%", "&#37;")


def values(a, digits: int) -> list:
    """Numbers rounded to `digits` decimals (whole numbers as ints), NaN and infinities as null."""
    a = np.asarray(a, np.float64)
    ok = np.isfinite(a)
    if digits <= 0:
        out = np.where(ok, np.rint(a), 0).astype(np.int64).tolist()
    else:
        out = np.round(np.where(ok, a, 0.0), digits).tolist()
    if not ok.all():
        for i in np.flatnonzero(~ok).tolist():
            out[i] = None
    return out


def evenly_spaced(first: float, step: float, digits: int) -> dict:
    """A trace's x for evenly spaced points: the first and the step (not every value); the step kept to more
    decimals than the first, as its error adds up along the trace."""
    return {"dx": round(step, digits + 6), "x0": values([first], digits)[0]}


def digits_for(step: float) -> int:
    """Decimals that place a value to about a fiftieth of `step` (a bin's width): finer is invisible."""
    return max(0, int(np.ceil(-np.log10(step / 50)))) if step > 0 else 3


def time_unit(span_s: float) -> tuple[float, str]:
    """Divisor and name of the time axis unit that keeps tick labels short."""
    if span_s <= 600:
        return 1.0, "s"
    if span_s <= 10 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def axis_key(letter: str, k: int) -> str:
    """Layout key of the k-th axis (0 first): xaxis, xaxis2, ..."""
    return f"{letter}axis" if k == 0 else f"{letter}axis{k + 1}"


def axis_ref(letter: str, k: int) -> str:
    """How a trace names the k-th axis: y, y2, ..."""
    return letter if k == 0 else f"{letter}{k + 1}"


def stacked_domains(rows_px: list[tuple[float, float]]) -> tuple[list[tuple[float, float]], float]:
    """Paper domains of rows stacked top to bottom, each given as (gap above it, its height) in pixels, and
    the plot height they take."""
    total = sum(gap + h for gap, h in rows_px)
    out, top = [], total
    for gap, h in rows_px:
        top -= gap
        out.append((round((top - h) / total, 5), round(top / total, 5)))
        top -= h
    return out, total


def row_label(label: str, domain: tuple[float, float], hover: str | None = None) -> dict:
    """A row's name above its left corner (an annotation in paper coordinates)."""
    note = {
        "font": FONT,
        "showarrow": False,
        "text": text(label),
        "x": 0,
        "xanchor": "left",
        "xref": "paper",
        "y": domain[1],
        "yanchor": "bottom",
        "yref": "paper",
    }
    if hover:
        note["hovertext"] = text(hover)
    return note


def checkpoint_shapes(spans_x: list[tuple[float, float]], digits: int) -> list[dict]:
    """Checkpoint intervals as bands the plot's full height, behind the traces; the first one in the legend."""
    shapes = []
    for a, b in spans_x:
        x0, x1 = values([a, b], digits)
        shape = {
            "fillcolor": CHECKPOINT_SHADE,
            "layer": "below",
            "legendgroup": "checkpoint",
            "line": {"width": 0},
            "name": "checkpoint interval (heartbeats)",
            "opacity": 0.45,
            "showlegend": not shapes,
            "type": "rect",
            "x0": x0,
            "x1": x1,
            "xref": "x",
            "y0": 0,
            "y1": 1,
            "yref": "paper",
        }
        shapes.append(shape)
    return shapes


def legend_on_top() -> dict:
    return {"orientation": "h", "x": 0, "xanchor": "left", "y": 1, "yanchor": "bottom", "font": FONT}


def base_layout(height_px: float, legend: bool = True) -> dict:
    """What every figure's layout starts from: its height, margins (room for a legend row on top), fonts."""
    margin = dict(MARGIN, t=MARGIN["t"] + (LEGEND_PX if legend else 0))
    return {
        "font": FONT,
        "height": round(height_px + margin["t"] + margin["b"]),
        "hoverlabel": {"namelength": -1},
        "legend": legend_on_top(),
        "margin": margin,
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "showlegend": legend,
    }


def time_axis(title: str, xmax: float, digits: int, anchor: str = "y") -> dict:
    """The time axis every time figure shares: from the run's start to its end, so figures line up."""
    return {
        "anchor": anchor,
        "gridcolor": "#eeeeee",
        "range": [0, values([xmax], digits)[0]],
        "title": {"text": text(title)},
        "zeroline": False,
    }

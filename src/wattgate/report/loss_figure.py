"""The report's loss figure: training loss per step and every validation pass's, with each held-out source's own
curve, as a Plotly figure spec (report/figures.py gathers the page's figures)."""

from __future__ import annotations

import numpy as np

from wattgate.report.binning import MAX_POINTS, bin_edges, bin_mean
from wattgate.report.plot_spec import base_layout, text, values
from wattgate.run_tables import LOSS, STEP, eval_sources_of, source_loss_column

TRAIN_COLOR, VALIDATION_COLOR = "#444444", "#c0392b"
# one per held-out source's validation curve (dashed), in the sources' order, repeating past the eighth
SOURCE_COLORS = ("#2471a3", "#229954", "#b9770e", "#7d3c98", "#17a589", "#a04000", "#5d6d7e", "#d4ac0d")


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


def _curve(x: np.ndarray, y: np.ndarray, name: str, color: str, width: float, marker: float, dash: str = "") -> dict:
    """A loss curve in step order; markers of `marker` px (none when 0)."""
    order = np.argsort(x, kind="stable")
    trace = {
        "line": {"color": color, "width": width},
        "mode": "lines+markers" if marker else "lines",
        "name": text(name),
        "type": "scatter",
        "x": values(x[order], 1),
        "y": values(y[order], 5),
    }
    if dash:
        trace["line"]["dash"] = dash
    if marker:
        trace["marker"] = {"color": color, "size": marker}
    return trace


def loss_figure(steps, evals=None) -> dict | None:
    """Training loss per step and, on the same axes, the validation loss of every pass (eval.parquet), with
    each held-out source's own validation curve (dashed) when there are two or more."""
    has_train = steps is not None and LOSS in steps and steps[LOSS].notna().any()
    has_eval = evals is not None and len(evals) and evals[LOSS].notna().any()
    if not has_train and not has_eval:
        return None
    data = []
    if has_train:
        x, y = steps[STEP].to_numpy(float), steps[LOSS].to_numpy(float)
        if len(x) > MAX_POINTS:
            edges = bin_edges(float(x.min()), float(x.max()), 1.0)
            x, y = (edges[:-1] + edges[1:]) / 2, bin_mean(x, y, edges)
        data.append(_curve(x, y, "training", TRAIN_COLOR, 1.2, 4 if len(x) <= 200 else 0))
    if has_eval:
        ex, ey = evals[STEP].to_numpy(float), evals[LOSS].to_numpy(float)
        data.append(_curve(ex, ey, "validation", VALIDATION_COLOR, 2, 6))
    for i, (name, cx, cy) in enumerate(source_curves(evals, bool(has_eval))):
        color = SOURCE_COLORS[i % len(SOURCE_COLORS)]
        data.append(_curve(cx, cy, f"validation: {name}", color, 1.6, 5, dash="dash"))
    layout = base_layout(240.0)
    layout["xaxis"] = {"gridcolor": "#eeeeee", "title": {"text": "optimizer step"}, "zeroline": False}
    layout["yaxis"] = {"gridcolor": "#eeeeee", "title": {"text": "loss (token-weighted over ranks)"}}
    layout["hovermode"] = "closest"
    return {"data": data, "layout": layout}

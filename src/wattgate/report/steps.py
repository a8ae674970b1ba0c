"""Per-step analysis of the training metrics: the step table, throughput, loss and world-size segments.

step_table groups metrics.parquet's rows (one per rank and step) by step with numpy; the sections
built on it go into summary.json, rounded by num.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from wattgate.records.summary import Loss, Segment, Throughput, Validation, ValidationPass
from wattgate.records.trained import Trained
from wattgate.report.anomalies import group_codes
from wattgate.report.inputs import RunInputs
from wattgate.run_tables import STEP, eval_sources_of, source_loss_column


def num(x, digits: int = 6):
    """A JSON-safe rounded float (None for missing, NaN or infinite)."""
    if x is None:
        return None
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None


def step_table(metrics: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per step: end time, slowest rank's step time, mean data wait, tokens, ranks, token-weighted loss.

    NaN is skipped as pandas' groupby skips it (a step with no value: NaN; tokens: 0); sums run in row
    order, as pandas' do, without its compensation (the last bit of a float; summary.json rounds it away)."""
    if metrics is None or metrics.empty:
        return None
    group, steps = group_codes(metrics["step"].to_numpy())
    n = len(steps)
    rows = None if (group >= 0).all() else group >= 0  # a row whose step is NaN is in no step, as in pandas
    g = group if rows is None else group[rows]

    def column(name: str) -> np.ndarray:
        values = metrics[name].to_numpy()
        return values if rows is None else values[rows]

    out = {"step": steps, "time": _group_max(column("time"), g, n)}
    if "step_time_s" in metrics:
        out["step_time_s"] = _group_max(column("step_time_s"), g, n)
    if "data_wait_s" in metrics:
        out["data_wait_s"] = _group_mean(column("data_wait_s"), g, n)
    if "tokens" in metrics:
        out["tokens"] = _group_sum(column("tokens"), g, n)
    rank_group, ranks = group_codes(column("rank"))
    out["ranks"] = _distinct_per_group(g, rank_group, len(ranks), n)  # the world size each step ran on
    if "loss" in metrics:
        loss = column("loss").astype(float, copy=False)
        weight = column("loss_tokens") if "loss_tokens" in metrics else np.ones(len(g))
        weighted, weights = _group_sum(loss * weight, g, n), _group_sum(weight, g, n).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            out["loss"] = np.where(weights > 0, weighted / np.where(weights > 0, weights, 1.0), np.nan)
    return pd.DataFrame(out)


def _group_max(values: np.ndarray, group: np.ndarray, n: int) -> np.ndarray:
    """Per group the largest value, NaN skipped (NaN if none); integers stay integers."""
    if values.dtype.kind in "iu":
        out = np.full(n, np.iinfo(values.dtype).min, values.dtype)
        np.maximum.at(out, group, values)
        return out
    out = np.full(n, np.nan)
    np.fmax.at(out, group, values)
    return out


def _group_sum(values: np.ndarray, group: np.ndarray, n: int) -> np.ndarray:
    """Per group the sum, NaN skipped; integers summed exactly as integers."""
    if values.dtype.kind in "iu":
        out = np.zeros(n, np.int64)
        np.add.at(out, group, values.astype(np.int64, copy=False))
        return out
    values = values.astype(float, copy=False)
    nan = np.isnan(values)
    return np.bincount(group, weights=np.where(nan, 0.0, values) if nan.any() else values, minlength=n)


def _group_mean(values: np.ndarray, group: np.ndarray, n: int) -> np.ndarray:
    """Per group the mean, NaN skipped (NaN if none)."""
    values = values.astype(float, copy=False)
    nan = np.isnan(values)
    counts = np.bincount(group[~nan] if nan.any() else group, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        return _group_sum(values, group, n) / counts


def _distinct_per_group(group: np.ndarray, value_code: np.ndarray, values: int, n: int) -> np.ndarray:
    """Per group the number of distinct non-NaN values (value codes from group_codes, -1 for NaN)."""
    width = max(values, 1)
    ok = value_code >= 0
    key = group * width if ok.all() else group[ok] * width
    key += value_code if ok.all() else value_code[ok]
    seen = np.flatnonzero(np.bincount(key, minlength=n * width)) if n * width <= 1 << 24 else np.unique(key)
    return np.bincount(seen // width, minlength=n)


def throughput(inputs: RunInputs, steps: pd.DataFrame | None, gpus: int) -> Throughput:
    t = inputs.trained or Trained()
    tokens = int(steps["tokens"].sum()) if steps is not None and "tokens" in steps else None
    wall = t.wall_s
    wall_source = "TRAINED" if wall is not None else None
    if wall is None and steps is not None and inputs.metrics is not None:
        m = inputs.metrics
        begin = (m["time"] - m["step_time_s"]).min() if "step_time_s" in m else m["time"].min()
        wall, wall_source = float(m["time"].max() - begin), "metrics (first step start to last step end)"
    world = t.world_size
    if world is None and inputs.metrics is not None:
        world = int(inputs.metrics["rank"].nunique())
    if world is None and inputs.config:
        world = inputs.config.cluster.nodes * inputs.config.cluster.gpus_per_node
    tps = t.tokens_per_s
    if tps is None and tokens is not None and wall:
        tps = tokens / wall
    return Throughput(
        tokens=tokens,
        steps=t.steps if t.steps is not None else int(steps[STEP].max()) if steps is not None else None,
        wall_s=num(wall, 3),
        wall_source=wall_source,
        world_size=world,
        tokens_per_s=num(tps, 3),
        tokens_per_s_per_gpu=num(tps / gpus, 3) if tps is not None and gpus else None,
        tokens_per_s_per_rank=num(tps / world, 3) if tps is not None and world else None,
        rank_hours=num(world * wall / 3600.0, 6) if world and wall is not None else None,
    )


def loss(inputs: RunInputs, steps: pd.DataFrame | None) -> Loss:
    t = inputs.trained or Trained()
    first, final = t.first_loss, t.final_loss
    if (first is None or final is None) and steps is not None and "loss" in steps and len(steps):
        first = steps["loss"].iloc[0] if first is None else first
        final = steps["loss"].iloc[-1] if final is None else final
    return Loss(first=num(first), final=num(final))


def segments_section(steps: pd.DataFrame | None) -> tuple[Segment, ...]:
    """Runs of steps on the same world size: a resized run (pack/segments.py) shows each with its tokens."""
    if steps is None or "ranks" not in steps or not len(steps):
        return ()
    ranks = steps["ranks"].to_numpy()
    cut = np.flatnonzero(np.diff(ranks)) + 1
    out = []
    for a, b in zip(np.concatenate([[0], cut]), np.concatenate([cut, [len(ranks)]])):
        part = steps.iloc[a:b]
        out.append(
            Segment(
                first_step=int(part["step"].iloc[0]),
                last_step=int(part["step"].iloc[-1]),
                world_size=int(ranks[a]),
                steps=int(b - a),
                tokens=int(part["tokens"].sum()) if "tokens" in part else None,
                start=num(float(part["time"].iloc[0]), 3),
            )
        )
    return tuple(out)


def validation_section(evals: pd.DataFrame | None) -> Validation | None:
    """The validation passes (eval.parquet) for summary.json and the page: every pass, the final and the best."""
    if evals is None or not len(evals):
        return None
    sources = eval_sources_of(evals.columns)  # two or more held-out sources (issue 33): a loss per source too
    rows = []
    for r in evals.sort_values("step").to_dict("records"):
        rows.append(
            ValidationPass(
                step=int(r["step"]),
                epoch=int(r["epoch"]),
                loss=num(r["loss"]),
                perplexity=num(r["perplexity"]),
                tokens=int(r["tokens"]),
                seconds=num(r["seconds"], 3),
                per_source={name: num(r[source_loss_column(name)]) for name in sources} if sources else None,
            )
        )
    scored = [r for r in rows if r.loss is not None]
    return Validation(
        passes=tuple(rows),
        final=rows[-1],
        best=min(scored, key=lambda r: (r.loss, -r.step)) if scored else None,
        seconds=num(float(evals["seconds"].sum()), 3),
        sources=tuple(sources) if sources else None,
    )

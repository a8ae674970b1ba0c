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
from wattgate.power.triage.arrays import reduce_into
from wattgate.report.anomalies import group_codes
from wattgate.report.inputs import RunInputs
from wattgate.run_tables import (
    DATA_WAIT_S,
    EPOCH,
    LOSS,
    LOSS_TOKENS,
    PERPLEXITY,
    RANK,
    SECONDS,
    STEP,
    STEP_TIME_S,
    TIME,
    TOKENS,
    eval_sources_of,
    source_loss_column,
)

# step_table's columns: metrics.parquet's names (STEP, TIME, STEP_TIME_S, DATA_WAIT_S, TOKENS, LOSS) and
RANKS = "ranks"  # the number of ranks that logged the step (the world size it ran on)


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
    group, steps = group_codes(metrics[STEP].to_numpy())
    n = len(steps)
    rows = None if (group >= 0).all() else group >= 0  # a row whose step is NaN is in no step, as in pandas
    g = group if rows is None else group[rows]

    def column(name: str) -> np.ndarray:
        values = metrics[name].to_numpy()
        return values if rows is None else values[rows]

    out = {STEP: steps, TIME: _group_max(column(TIME), g, n)}
    if STEP_TIME_S in metrics:
        out[STEP_TIME_S] = _group_max(column(STEP_TIME_S), g, n)
    if DATA_WAIT_S in metrics:
        out[DATA_WAIT_S] = _group_mean(column(DATA_WAIT_S), g, n)
    if TOKENS in metrics:
        out[TOKENS] = _group_sum(column(TOKENS), g, n)
    rank_group, ranks = group_codes(column(RANK))
    out[RANKS] = _distinct_per_group(g, rank_group, len(ranks), n)  # the world size each step ran on
    if LOSS in metrics:
        loss = column(LOSS).astype(float, copy=False)
        weight = column(LOSS_TOKENS) if LOSS_TOKENS in metrics else np.ones(len(g))
        weighted, weights = _group_sum(loss * weight, g, n), _group_sum(weight, g, n).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[LOSS] = np.where(weights > 0, weighted / np.where(weights > 0, weights, 1.0), np.nan)
    return pd.DataFrame(out)


def _group_max(values: np.ndarray, group: np.ndarray, n: int) -> np.ndarray:
    """Per group the largest value, NaN skipped (NaN if none); integers stay integers."""
    if values.dtype.kind in "iu":
        out = np.full(n, np.iinfo(values.dtype).min, values.dtype)
        reduce_into(np.maximum, out, group, values)
        return out
    out = np.full(n, np.nan)
    reduce_into(np.fmax, out, group, values)
    return out


def _group_sum(values: np.ndarray, group: np.ndarray, n: int) -> np.ndarray:
    """Per group the sum, NaN skipped; integers summed exactly as integers."""
    if values.dtype.kind in "iu":
        out = np.zeros(n, np.int64)
        reduce_into(np.add, out, group, values.astype(np.int64, copy=False))
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
    tokens = int(steps[TOKENS].sum()) if steps is not None and TOKENS in steps else None
    wall = t.wall_s
    wall_source = "TRAINED" if wall is not None else None
    # TRAINED of a resumed run is its last attempt's (a forced rerun that resumed at the last step: 0 s, 0 tok/s);
    # the run's is every step's time, each step once, and every validation pass, over its attempts (what TRAINED's
    # wall holds for one attempt, but its checkpoint writes, which no table records)
    resumed = bool(t.resumed_from_step)
    if resumed and steps is not None and STEP_TIME_S in steps and len(steps):
        wall = float(np.nansum(steps[STEP_TIME_S].to_numpy(dtype=float)))
        wall_source = "metrics (every step's time, its slowest rank's, over the run's attempts: it was resumed)"
        evals = inputs.evals
        if evals is not None and "seconds" in evals and len(evals):
            wall += float(np.nansum(evals["seconds"].to_numpy(dtype=float)))
            wall_source = (
                "metrics and eval.parquet (every step's time, its slowest rank's, and every validation pass, over "
                "the run's attempts: it was resumed; checkpoint writes not counted)"
            )
    elif wall is None and steps is not None and inputs.metrics is not None:
        m = inputs.metrics
        begin = (m[TIME] - m[STEP_TIME_S]).min() if STEP_TIME_S in m else m[TIME].min()
        wall, wall_source = float(m[TIME].max() - begin), "metrics (first step start to last step end)"
    world = t.world_size
    if world is None and inputs.metrics is not None:
        world = inputs.metrics[RANK].nunique()
    if world is None and inputs.config:
        world = inputs.config.cluster.nodes * inputs.config.cluster.gpus_per_node
    tps = None if resumed else t.tokens_per_s
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
    if (first is None or final is None) and steps is not None and LOSS in steps and len(steps):
        first = steps[LOSS].iloc[0] if first is None else first
        final = steps[LOSS].iloc[-1] if final is None else final
    return Loss(first=num(first), final=num(final))


def segments_section(steps: pd.DataFrame | None) -> tuple[Segment, ...]:
    """Runs of steps on the same world size: a resized run (pack/segments.py) shows each with its tokens."""
    if steps is None or RANKS not in steps or not len(steps):
        return ()
    ranks = steps[RANKS].to_numpy()
    cut = np.flatnonzero(np.diff(ranks)) + 1
    out = []
    for a, b in zip(np.concatenate([[0], cut]), np.concatenate([cut, [len(ranks)]])):
        part = steps.iloc[a:b]
        out.append(
            Segment(
                first_step=int(part[STEP].iloc[0]),
                last_step=int(part[STEP].iloc[-1]),
                world_size=int(ranks[a]),
                steps=int(b - a),
                tokens=int(part[TOKENS].sum()) if TOKENS in part else None,
                start=num(float(part[TIME].iloc[0]), 3),
            )
        )
    return tuple(out)


def validation_section(evals: pd.DataFrame | None) -> Validation | None:
    """The validation passes (eval.parquet) for summary.json and the page: every pass, the final and the best."""
    if evals is None or not len(evals):
        return None
    sources = eval_sources_of(evals.columns)  # two or more held-out sources: a loss per source too
    rows = []
    for r in evals.sort_values(STEP).to_dict("records"):
        rows.append(
            ValidationPass(
                step=int(r[STEP]),
                epoch=int(r[EPOCH]),
                loss=num(r[LOSS]),
                perplexity=num(r[PERPLEXITY]),
                tokens=int(r[TOKENS]),
                seconds=num(r[SECONDS], 3),
                per_source={name: num(r[source_loss_column(name)]) for name in sources} if sources else None,
            )
        )
    scored = [r for r in rows if r.loss is not None]
    return Validation(
        passes=tuple(rows),
        final=rows[-1],
        best=min(scored, key=lambda r: (r.loss, -r.step)) if scored else None,
        seconds=num(float(evals[SECONDS].sum()), 3),
        sources=tuple(sources) if sources else None,
    )

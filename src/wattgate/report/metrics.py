"""metrics.parquet rows as far as they can be trusted: what the report and compare count.

A damaged record costs the values that are damaged, named in a note, never the whole table: a (step, rank)
written twice (a resumed run rewrites the steps after its checkpoint) counts once, the last row; a value
no step can have (missing, not finite, negative, a step longer than a week, a time past year 9999) is left
out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from wattgate.run_tables import DATA_WAIT_S, LOSS_TOKENS, RANK, STEP, STEP_TIME_S, TIME, TOKENS

MAX_STEP_S = 7 * 86400.0  # a step longer than a week is no measurement (the watcher's limits end there)
LAST_UNIX_TIME = 253402300799.0  # 9999-12-31 23:59:59 UTC: no date after it can be written
# column -> (lowest, highest) a real value takes; None: no bound that side
VALID_RANGE = {
    TIME: (0.0, LAST_UNIX_TIME),
    STEP_TIME_S: (0.0, MAX_STEP_S),
    DATA_WAIT_S: (0.0, MAX_STEP_S),
    TOKENS: (0.0, None),
    LOSS_TOKENS: (0.0, None),
}
KEYS = [STEP, RANK]


def trusted_metrics(metrics: pd.DataFrame, path: str | Path, note: Callable[[str], None]) -> pd.DataFrame:
    """`metrics` with duplicated (step, rank) rows but the last dropped and impossible values set to NaN
    (NaN is what every consumer skips), each kind of damage named once in `note`."""
    metrics = _last_of_duplicates(metrics, path, note)
    for column, (lo, hi) in VALID_RANGE.items():
        if column in metrics:
            metrics = _out_of_range_left_out(metrics, column, lo, hi, path, note)
    return metrics


def _last_of_duplicates(metrics: pd.DataFrame, path, note) -> pd.DataFrame:
    if not set(KEYS) <= set(metrics.columns):
        return metrics
    if _in_write_order(metrics[STEP].to_numpy(), metrics[RANK].to_numpy()):
        return metrics  # rank 0 writes each step's ranks in order, step after step: nothing can repeat
    repeated = metrics.duplicated(KEYS, keep="last").to_numpy()
    if not repeated.any():
        return metrics
    note(
        f"{path}: {int(repeated.sum())} row(s) repeat a (step, rank) written again later (as a resumed run "
        "rewrites the steps after its checkpoint): each (step, rank) counted once, its last row"
    )
    return metrics[~repeated].reset_index(drop=True)


def _in_write_order(step: np.ndarray, rank: np.ndarray) -> bool:
    """(step, rank) rises row by row, step first (rank 0's writes) or rank first (a table concatenated rank by
    rank), with no NaN: then no (step, rank) repeats."""
    if len(step) < 2 or step.dtype.kind not in "iu" or rank.dtype.kind not in "iu":
        return len(step) < 2
    ds, dr = np.diff(step), np.diff(rank)
    return bool(((ds > 0) | ((ds == 0) & (dr > 0))).all()) or bool(((dr > 0) | ((dr == 0) & (ds > 0))).all())


def _out_of_range_left_out(metrics: pd.DataFrame, column: str, lo, hi, path, note) -> pd.DataFrame:
    values = metrics[column].to_numpy()
    if values.dtype.kind not in "iuf":
        return metrics  # not a number column at all: read_metrics' schema check is the place for that
    values = values.astype(np.float64, copy=False)
    bad = ~np.isfinite(values)  # NaN too: a null in a column train always fills
    with np.errstate(invalid="ignore"):
        if lo is not None:
            bad |= values < lo
        if hi is not None:
            bad |= values > hi
    if not bad.any():
        return metrics
    example = values[np.flatnonzero(bad)[0]]
    bounds = f"{lo:g} to {hi:g}" if hi is not None else f"{lo:g} or more"
    note(
        f"{path}: column {column}: {int(bad.sum())} value(s) missing or outside {bounds} (e.g. {example:g}) left out "
        "as damaged: what they give (throughput, step times, the time axis) counts the other rows"
    )
    out = metrics.copy()
    out[column] = np.where(bad, np.nan, values)
    return out

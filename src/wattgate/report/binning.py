"""Binning for the report's figures: a long series drawn as at most a fixed number of equal bins over its span,
each its mean, lowest, highest or majority value, so a day of samples draws as fast as an hour's."""

from __future__ import annotations

import numpy as np

from wattgate.power.triage.arrays import reduce_into
from wattgate.power.triage.phases import LABELS

MAX_POINTS = 2000  # per series of the step and loss figures


def bin_edges(x0: float, x1: float, step: float, most: int = MAX_POINTS) -> np.ndarray:
    """At most `most` equal bins over [x0, x1], none finer than `step` (the data's own resolution)."""
    bins = int(min(most, max(1, float(np.ceil((x1 - x0) / step))))) if x1 > x0 else 1
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


def _bin_extreme(x: np.ndarray, y: np.ndarray, edges: np.ndarray, ufunc, start: float) -> np.ndarray:
    ok = np.isfinite(y)
    out = np.full(len(edges) - 1, start)
    reduce_into(ufunc, out, bin_index(x[ok], edges), y[ok])
    return np.where(np.isfinite(out), out, np.nan)


def bin_max(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Largest y per bin (NaN for an empty bin)."""
    return _bin_extreme(x, y, edges, np.maximum, -np.inf)


def bin_min(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Smallest y per bin (NaN for an empty bin)."""
    return _bin_extreme(x, y, edges, np.minimum, np.inf)


def bin_majority(x: np.ndarray, code: np.ndarray, edges: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The phase holding most of each bin's time (-1 for an empty bin)."""
    nl = len(LABELS)
    b = bin_index(x, edges)
    counts = np.bincount(b * nl + code, weights=weight, minlength=(len(edges) - 1) * nl).reshape(-1, nl)
    best = counts.argmax(axis=1)
    return np.where(counts.sum(axis=1) > 0, best, -1)


def code_runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, end, code) of each run of equal codes."""
    first = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    return first, np.r_[first[1:], len(codes)], codes[first]

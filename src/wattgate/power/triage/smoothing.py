"""Power triage's per-GPU smoothing filters: the rolling median of power (rule 1) and the majority filter (rule 3).

Apart from rules.py because they are generic window filters with their own fast paths, not phase rules.
"""

from __future__ import annotations

import numpy as np

from wattgate.power.triage.arrays import _bounds, _ranges

SMOOTH_RADIUS = 2  # majority filter and power median: windows on each side


def _edge_positions(gs: np.ndarray, ge: np.ndarray, radius: int) -> np.ndarray:
    """Positions within `radius` windows of their GPU's first or last window, sorted, once each."""
    starts = np.concatenate([gs, np.maximum(ge - radius, gs)])
    ends = np.concatenate([np.minimum(gs + radius, ge), ge])
    return np.unique(_ranges(starts, ends))


def rolling_median(x: np.ndarray, gpu: np.ndarray, ngpu: int, radius: int) -> np.ndarray:
    """Median of each window and `radius` known windows on each side on the same GPU."""
    if len(x) == 0 or radius <= 0:
        return x
    gs, ge = _bounds(gpu, ngpu)
    n = len(x)
    if radius != 2 or np.isnan(x).any():
        return _median_at(x, np.arange(n), gpu, gs, ge, radius)
    # away from a GPU's ends the neighbours are shifted views of x: no gathers, no index arrays
    out = np.empty_like(x)
    if n > 4:
        _median5(*(x[k : n - 4 + k] for k in range(5)), out=out[2 : n - 2])
    edge = _edge_positions(gs, ge, radius)
    out[edge] = _median_at(x, edge, gpu, gs, ge, radius)
    return out


def _median_at(x, pos, gpu, gs, ge, radius: int) -> np.ndarray:
    """The rolling median at `pos`; near a GPU's ends the neighbours mirror inside its range so the window
    stays centred and odd-sized."""
    g = gpu[pos]
    lo, hi = gs[g], ge[g] - 1
    cols = []
    for off in range(-radius, radius + 1):
        j = pos + off
        j = np.where(j < lo, 2 * lo - j, j)
        j = np.where(j > hi, 2 * hi - j, j)
        cols.append(x[np.clip(j, lo, hi)])
    if radius == 2 and not np.isnan(x).any():
        out = np.empty(len(pos), x.dtype)
        _median5(*cols, out=out)
        return out
    return np.partition(np.stack(cols, axis=1), radius, axis=1)[:, radius]


def _median5(a, b, c, d, e, out: np.ndarray) -> None:
    """The median of 5 (no NaN) by min/max, into out: it picks the same value a sort would."""
    np.minimum(a, b, out=out)
    t = np.minimum(c, d)
    np.maximum(out, t, out=out)  # out: the larger of the two pairs' minima
    g = np.maximum(a, b)
    np.maximum(c, d, out=t)
    np.minimum(g, t, out=g)  # g: the smaller of the two pairs' maxima
    np.minimum(e, out, out=t)
    np.maximum(e, out, out=out)
    np.minimum(out, g, out=out)
    np.maximum(t, out, out=out)


CLASS_BAND = np.array([2, 1, -1, -1, -1, 0, -1, 0, -1], np.int8)  # band a class implies; -1: any


def rolling_majority(
    cls: np.ndarray, gpu: np.ndarray, ngpu: int, radius: int, own_band: np.ndarray, keep: np.ndarray | None = None
) -> np.ndarray:
    """Most common class within `radius` windows on each side on the same GPU; ties keep the window's own,
    and so do a window whose own power is two bands from the winner's and the windows in `keep`."""
    if len(cls) == 0 or radius <= 0:
        return cls
    n = len(cls)
    gs, ge = _bounds(gpu, ngpu)
    # a window shared by more than `radius` of its 2 radius + 1 neighbourhood wins outright, so only the
    # others (and the windows near a GPU's end, whose neighbourhood is cut short) need the full count
    sub = [_edge_positions(gs, ge, radius)]
    if n > 2 * radius:
        agree = np.zeros(n - 2 * radius, np.int8)  # neighbours with the window's class, window radius + i
        for d in range(1, radius + 1):
            eq = cls[:-d] == cls[d:]  # eq[i]: windows i and i + d agree
            agree += eq[radius - d : n - radius - d]
            agree += eq[radius : n - radius]
        sub.append(np.flatnonzero(agree < radius) + radius)
    pos = np.unique(np.concatenate(sub))
    own, best, winner = _majority_at(cls, pos, gpu, gs, ge, radius)
    wb = CLASS_BAND[winner]
    stay = (own == best) | ((wb >= 0) & (np.abs(wb.astype(np.int16) - own_band[pos]) >= 2))
    if keep is not None:
        stay |= keep[pos]
    out = cls.copy()
    out[pos[~stay]] = winner[~stay]
    return out


def _majority_at(cls, pos, gpu, gs, ge, radius: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At `pos`: how many of the windows within `radius` on the same GPU share the window's class, how many
    share the most common one, and that class (the lowest of a tie)."""
    g = gpu[pos]
    j = pos[:, None] + np.arange(-radius, radius + 1)
    valid = (j >= gs[g][:, None]) & (j < ge[g][:, None])
    c = cls[np.where(valid, j, pos[:, None])]
    counts = ((c[:, :, None] == c[:, None, :]) & valid[:, None, :]).sum(axis=2) * valid
    best = counts.max(axis=1)
    winner = np.where(counts == best[:, None], c, np.iinfo(c.dtype).max).min(axis=1)
    return counts[:, radius], best, winner

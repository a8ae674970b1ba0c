"""Levels each GPU shows in its own run, learned on top of the triage table, and the band edges they give.

The table (published figures, a calibration, or one derived from the power
cap) is the prior. A run shows more: where its GPUs idle with a context held,
the power its kernels spin at while waiting, and the plateau(s) its compute
settles on (a small model on an H100 computes at 400 W, a large one at 690 W).
Windows are then banded against those levels, per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from wattgate.triage_tables import TriageTable
from wattgate.power.triage.arrays import _bounds, cumsum0, _ranges, gpu_runs

LEVEL_MIN_WINDOWS = 5  # windows a learned level needs; fewer and the table's value stands
IDLE_QUANTILE = 0.2  # idle level: this quantile of the quiet windows (the ramp after start-up reads above it)
WAIT_MIN_S = 10.0  # a wait level is learned from stretches of busy low-band windows this long
WAIT_SPREADS = 3.0  # the low band reaches this many robust spreads (1.4826 MAD) above the wait level
PLATEAU_MIN_S = 90.0  # a compute plateau lasts this long (communication phases last seconds, not minutes)
PLATEAU_MIN_WINDOWS = 10
PLATEAU_SHARE = 0.9  # share of a plateau's windows that are busy and above the plateau floor
PLATEAU_CV = 0.08  # a plateau's power varies by at most this share of its mean (sd)
PLATEAU_BAND = 0.12  # compute band starts this share below the run's lowest plateau


@dataclass
class Levels:
    """Per GPU (arrays indexed by GPU id): the levels learned from the run, and the bands they give.

    The table is the prior; the run refines it where it shows enough windows:
    - idle_w: the IDLE_QUANTILE of windows at <= idle_util_pct in the low band
      (idle with a context held), else the table's idle_w;
    - wait_w: the median of busy windows in the low band (a kernel spinning at
      near-idle power) in stretches of WAIT_MIN_S, NaN if none; the low band reaches
      WAIT_SPREADS robust spreads above it (a hang drawn just under the edge stays a wait);
    - plateau_w: the lowest compute plateau, PLATEAU_MIN_S of busy windows at a
      steady power above the middle of the communication band, NaN if none; the
      compute band starts PLATEAU_BAND below it (never above the table's);
    - cap_w: the power cap (NVML's enforced limit, --power-cap-w, else tdp_w).
    """

    idle_w: np.ndarray
    wait_w: np.ndarray
    plateau_w: np.ndarray
    cap_w: np.ndarray
    low_max_w: np.ndarray
    compute_min_w: np.ndarray

    def records(self, keys: list[tuple[str, int]]) -> dict:
        def r(x):
            return round(float(x), 1) if np.isfinite(x) else None

        return {
            f"{h}:{g}": {
                "idle_w": r(self.idle_w[i]),
                "wait_w": r(self.wait_w[i]),
                "plateau_w": r(self.plateau_w[i]),
                "cap_w": r(self.cap_w[i]),
                "low_max_w": r(self.low_max_w[i]),
                "compute_min_w": r(self.compute_min_w[i]),
            }
            for i, (h, g) in enumerate(keys)
        }


def learn_levels(p, u, gpu, ngpu: int, table: TriageTable, window_s: float, cap_w: np.ndarray) -> Levels:
    """Levels of each GPU from its known windows (p, u, gpu sorted by GPU, then time)."""
    gs, ge = _bounds(gpu, ngpu)
    low = p < table.low_max_w
    with np.errstate(invalid="ignore"):
        busy = u >= table.busy_util_pct
        quiet = u <= table.idle_util_pct
    quiet &= low
    waiting = busy & low
    floor = table.low_max_w + 0.5 * (table.compute_min_w - table.low_max_w)
    # plateau cores: centred spans of k windows on one GPU, nearly all candidates, at a steady power
    k = max(PLATEAU_MIN_WINDOWS, math.ceil(PLATEAU_MIN_S / window_s))
    mean, steady = span_stats(p, busy & (p >= floor), k)  # span [j, j + k): its centre is window j + k // 2

    # waits: stretches of WAIT_MIN_S of busy windows in the low band (a spinning kernel), not single
    # windows of a noisy communication phase that dip under the edge
    rs, re_ = gpu_runs(waiting, gpu)
    long_wait = waiting[rs] & ((re_ - rs) * window_s >= WAIT_MIN_S)
    in_wait = np.zeros(len(p), dtype=bool)
    in_wait[_ranges(rs[long_wait], re_[long_wait])] = True

    idle = np.full(ngpu, float(table.idle_w))
    wait = np.full(ngpu, np.nan)
    wait_spread = np.zeros(ngpu)
    plateau = np.full(ngpu, np.nan)
    for g in range(ngpu):
        sl = slice(gs[g], ge[g])
        q = p[sl][quiet[sl]]
        if len(q) >= LEVEL_MIN_WINDOWS:
            idle[g] = float(np.quantile(q, IDLE_QUANTILE))
        w = p[sl][in_wait[sl]]
        if len(w) >= LEVEL_MIN_WINDOWS:
            wait[g] = float(np.median(w))
            wait_spread[g] = 1.4826 * float(np.median(np.abs(w - wait[g])))
        inside = slice(gs[g], max(ge[g] - k + 1, gs[g]))  # spans that start and end on the GPU
        c = steady[inside]
        if c.any():
            plateau[g] = float(mean[inside][c].min())
    compute_min = np.full(ngpu, float(table.compute_min_w))
    has = np.isfinite(plateau)
    compute_min[has] = np.clip(plateau[has] * (1 - PLATEAU_BAND), floor, table.compute_min_w)
    # the low band holds the run's waits: it reaches WAIT_SPREADS robust spreads above their level
    low_max = np.full(ngpu, float(table.low_max_w))
    has = np.isfinite(wait)
    low_max[has] = np.clip(
        wait[has] + WAIT_SPREADS * wait_spread[has], table.low_max_w, (table.low_max_w + compute_min[has]) / 2
    )
    idle = np.minimum(idle, 0.8 * low_max)
    return Levels(idle, wait, plateau, np.asarray(cap_w, float), low_max, compute_min)


def span_stats(p: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per span of k windows [j, j + k), j = 0 .. len - k: the candidates' mean power, and whether its
    centre window is a candidate and nearly all of it are, at a steady power (a plateau core)."""
    m = len(p) - k + 1
    if m <= 0:
        return np.zeros(0), np.zeros(0, dtype=bool)
    cnt = np.zeros(len(p) + 1, np.int32 if len(p) < 1 << 31 else np.int64)  # counts add up faster than floats
    np.cumsum(cand, dtype=cnt.dtype, out=cnt[1:])
    cnt = cnt[k:] - cnt[:-k]
    steady = cnt >= PLATEAU_SHARE * k
    steady &= cand[k // 2 : k // 2 + m]
    pz = np.where(cand, p, 0.0)
    s1 = cumsum0(pz)
    np.multiply(pz, pz, out=pz)
    s2 = cumsum0(pz)
    # each buffer is reused once what it held has been read: a fresh full-size array costs page faults
    mean, var, tmp = pz[:m], s1[:m], s2[:m]
    with np.errstate(invalid="ignore", divide="ignore"):
        np.subtract(s1[k:], s1[:-k], out=mean)
        mean /= cnt
        np.subtract(s2[k:], s2[:-k], out=var)
        var /= cnt
        np.multiply(mean, mean, out=tmp)
        var -= tmp
        np.maximum(var, 0.0, out=var)
        np.sqrt(var, out=var)
        np.multiply(mean, PLATEAU_CV, out=tmp)
        steady &= var <= tmp
    return mean, steady


@dataclass
class Edges:
    """Band edges of the known windows (GPU-major: `gpu` sorted): their GPU's learned levels, and the table's
    utilization thresholds. A rule takes each GPU's edges as numbers over its slice of windows (`spans`), or
    per window (`lo`, `hi`: gathered on first use; `levels_at`: for a few windows)."""

    levels: Levels
    gpu: np.ndarray
    busy_util: float
    idle_util: float

    @classmethod
    def of(cls, levels: Levels, gpu: np.ndarray, table: TriageTable) -> Edges:
        return cls(levels, gpu, table.busy_util_pct, table.idle_util_pct)

    @cached_property
    def spans(self) -> list[tuple[slice, float, float, float, float]]:
        """(its windows, idle_w, low_max_w, compute_min_w, cap_w) of each GPU with windows."""
        lv = self.levels
        gs, ge = _bounds(self.gpu, len(lv.idle_w))
        return [
            (slice(a, b), lv.idle_w[g], lv.low_max_w[g], lv.compute_min_w[g], lv.cap_w[g])
            for g, (a, b) in enumerate(zip(gs, ge))
            if b > a
        ]

    def levels_at(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(idle_w, low_max_w, compute_min_w) of the windows at positions `windows`."""
        g = self.gpu[windows]
        return self.levels.idle_w[g], self.levels.low_max_w[g], self.levels.compute_min_w[g]

    @cached_property
    def lo(self) -> np.ndarray:  # low_max_w
        return self.levels.low_max_w[self.gpu]

    @cached_property
    def hi(self) -> np.ndarray:  # compute_min_w
        return self.levels.compute_min_w[self.gpu]

"""Triage rules' vectorised fast paths against plain per-window loops, on short random inputs.

The rules work on shifted views, on the few windows near a GPU's ends or an edge, or on a (GPU x time) grid;
each is checked here against the rule as written: GPUs of 0 to 4 windows, gaps between windows, ties.
"""

from collections import Counter

import numpy as np
import pytest

from wattgate.triage_tables import TriageTable
from wattgate.power.triage.arrays import cumsum0, gpu_runs, reduce_into, true_runs
from wattgate.power.triage.levels import PLATEAU_CV, PLATEAU_SHARE, Levels, Edges, span_stats
from wattgate.power.triage.rules import (
    EDGE_MARGIN,
    PEER_POWER_TOL,
    PEER_UTIL_TOL,
    power_band,
    next_true_at,
    peer_vote,
    raw_power_band,
)
from wattgate.power.triage.smoothing import CLASS_BAND, rolling_majority, rolling_median

TABLE = TriageTable("x", ("x",), 700.0, 80.0, 200.0, 400.0)
POWER = [60, 80, 150, 190, 199, 200, 201, 210, 250, 300, 385, 399, 400, 405, 420, 600, 700]


def random_windows(rng, same_hours=False):
    """(ngpu, gpu, index, p, u, edges): GPU-major windows, some GPUs with 0-4 of them, gaps in time."""
    ngpu = int(rng.integers(1, 5))
    size = rng.integers(0, 5, ngpu) if rng.random() < 0.4 else rng.integers(0, 30, ngpu)
    gpu, index = [], []
    for g, m in enumerate(np.full(ngpu, size.max()) if same_hours else size):
        step = np.ones(m, int) if same_hours else rng.choice([1, 1, 1, 2, 4], m)
        gpu += [g] * m
        index += list(1000 + np.cumsum(step) + (0 if same_hours else int(rng.integers(0, 4))))
    gpu, index = np.array(gpu, np.int64), np.array(index, np.int64)
    n = len(gpu)
    p = rng.choice(POWER, n) + rng.normal(0, 8, n) * (rng.random(n) < 0.5)
    u = rng.choice([0.0, 5.0, 20.0, 84.0, 85.0, 90.0, 100.0], n)
    u[rng.random(n) < 0.1] = np.nan
    levels = Levels(
        rng.uniform(60, 90, ngpu),
        np.full(ngpu, np.nan),
        np.full(ngpu, np.nan),
        np.full(ngpu, 700.0),
        rng.uniform(190, 230, ngpu),
        rng.uniform(380, 420, ngpu),
    )
    return ngpu, gpu, index, p, u, Edges.of(levels, gpu, TABLE)


def spans(gpu):
    """(start, end) of each GPU's windows."""
    starts, ends = gpu_runs(gpu, gpu)
    return list(zip(starts, ends))


def median_loop(x, gpu, radius):
    out = np.empty_like(x)
    for s, e in spans(gpu):
        for i in range(s, e):
            near = []
            for j in range(i - radius, i + radius + 1):
                j = 2 * s - j if j < s else j
                j = 2 * (e - 1) - j if j > e - 1 else j
                near.append(x[min(max(j, s), e - 1)])
            out[i] = sorted(near)[radius]
    return out


def majority_loop(cls, gpu, radius, own_band, keep):
    out = cls.copy()
    for s, e in spans(gpu):
        for i in range(s, e):
            counts = Counter(cls[max(i - radius, s) : min(i + radius + 1, e)].tolist())
            best = max(counts.values())
            winner = min(c for c, k in counts.items() if k == best)
            far = CLASS_BAND[winner] >= 0 and abs(int(CLASS_BAND[winner]) - int(own_band[i])) >= 2
            if counts[cls[i]] < best and not far and not keep[i]:
                out[i] = winner
    return out


def band_loop(p_med, p, gpu, e):
    """Rule 1 window by window: a window within a margin of an edge carries the band of the last definite
    window when that band touches the edge, else it takes its own (and is definite from then on)."""
    raw, own = raw_power_band(p_med, e), raw_power_band(p, e)
    idle_w, low_max_w, compute_min_w = e.levels_at(np.arange(len(p)))
    out = raw.copy()
    for s, end in spans(gpu):
        state = raw[s]
        for i in range(s + 1, end):
            lo, hi = low_max_w[i], compute_min_w[i]
            m_lo, m_hi = EDGE_MARGIN * (lo - idle_w[i]), EDGE_MARGIN * (hi - lo)
            x = p_med[i]
            definite = x < lo - m_lo or lo + m_lo <= x < hi - m_hi or x >= hi + m_hi
            lower = 0 if x < (lo + hi) / 2 else 1
            if definite or state not in (lower, lower + 1):
                state = raw[i]
            out[i] = state
    keep_own = (np.abs(out.astype(int) - own) >= 2) | (p >= compute_min_w + EDGE_MARGIN * (compute_min_w - low_max_w))
    return np.where(keep_own, own, out).astype(np.int8)


def peer_vote_loop(cls, p, u, index, e):
    out = cls.copy()
    uu = np.where(np.isnan(u), -1.0, u)
    for t in np.unique(index):
        at = np.flatnonzero(index == t)
        mid = (len(at) - 1) // 2
        med_p, med_u = np.sort(p[at])[mid], np.sort(uu[at])[mid]
        with_peers = at[
            (np.abs(p[at] - med_p) <= PEER_POWER_TOL * np.maximum(med_p, e.lo[at]))
            & (np.abs(uu[at] - med_u) <= PEER_UTIL_TOL)
        ]
        if len(at) < 2 or len(with_peers) < max(2, np.ceil(len(at) / 2)):
            continue
        (first, top), *rest = sorted(Counter(cls[with_peers].tolist()).items(), key=lambda kv: (-kv[1], kv[0]))
        if not rest or top > rest[0][1]:
            out[with_peers] = first
    return out


@pytest.mark.parametrize("seed", range(3))
def test_fast_paths_match_the_rules_window_by_window(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        ngpu, gpu, index, p, u, e = random_windows(rng, same_hours=rng.random() < 0.4)
        n = len(gpu)
        for radius in (1, 2):  # 2: the min/max path, 1: the general one
            assert np.array_equal(rolling_median(p, gpu, ngpu, radius), median_loop(p, gpu, radius))
        p_med = rolling_median(p, gpu, ngpu, 2)
        assert np.array_equal(power_band(p_med, p, gpu, e), band_loop(p_med, p, gpu, e))

        runs = np.repeat(rng.integers(0, 9, n), rng.integers(1, 6, n))[:n]  # runs of a class, some short
        cls = (runs if rng.random() < 0.5 else rng.integers(0, 9, n)).astype(np.int8)
        own_band, keep = raw_power_band(p, e), rng.random(n) < 0.1
        for radius in (2, 3):
            expected = majority_loop(cls, gpu, radius, own_band, keep)
            assert np.array_equal(rolling_majority(cls, gpu, ngpu, radius, own_band, keep), expected)
        if n:
            expected = peer_vote_loop(cls, p, u, index, e)
            assert np.array_equal(peer_vote(cls, p, u, index, e, gpu), expected)  # on the grid
            assert np.array_equal(peer_vote(cls, p, u, index, e), expected)  # by sorting

        mask = rng.random(n) < rng.choice([0.1, 0.5, 0.9])
        starts, ends = gpu_runs(mask, gpu)
        assert np.array_equal(np.stack(true_runs(mask, gpu)), np.stack([starts[mask[starts]], ends[mask[starts]]]))
        at = rng.integers(0, max(n, 1), 5) if n else np.zeros(0, np.int64)
        following = [next((j for j in range(i, n) if mask[j]), n) for i in at]
        assert np.array_equal(next_true_at(mask, at), following)


def test_plateau_spans_match_the_spans_taken_one_by_one():
    rng = np.random.default_rng(7)
    for n in (0, 1, 9, 10, 11, 30, 30, 30, 60):
        p = np.where(rng.random(n) < 0.9, 500 + rng.normal(0, 10, n), rng.choice([300.0, 700.0], n))  # a plateau
        cand = rng.random(n) < 0.93
        mean, steady = span_stats(p, cand, 10)
        assert len(mean) == len(steady) == max(n - 9, 0)
        c, s1, s2 = cumsum0(cand), cumsum0(np.where(cand, p, 0.0)), cumsum0(np.where(cand, p * p, 0.0))
        for j in range(n - 9):
            cnt = c[j + 10] - c[j]
            m = (s1[j + 10] - s1[j]) / cnt
            sd = np.sqrt(max((s2[j + 10] - s2[j]) / cnt - m * m, 0.0))
            assert mean[j] == m
            assert steady[j] == (cand[j + 5] and cnt >= PLATEAU_SHARE * 10 and sd <= PLATEAU_CV * m)


@pytest.mark.parametrize("ufunc", [np.maximum, np.minimum, np.fmax, np.fmin, np.add])
def test_reduce_into_equals_ufunc_at_for_sorted_unsorted_and_empty_indexes(ufunc):
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 7, 200):
        for ordered in (True, False):
            index = rng.integers(0, 9, n)
            index = np.sort(index) if ordered else index
            values = rng.normal(size=n)
            values[rng.random(n) < 0.2] = np.nan  # fmax/fmin skip NaN, maximum/add carry it: both as .at does
            start = np.where(rng.random(10) < 0.5, np.nan, rng.normal(size=10))
            expected, got = start.copy(), start.copy()
            ufunc.at(expected, index, values)
            reduce_into(ufunc, got, index, values)
            np.testing.assert_allclose(got, expected, equal_nan=True, rtol=1e-12)
            ints = rng.integers(-50, 50, n)
            expected_i, got_i = np.zeros(10, np.int64), np.zeros(10, np.int64)
            if ufunc in (np.maximum, np.minimum, np.add):
                ufunc.at(expected_i, index, ints)
                reduce_into(ufunc, got_i, index, ints)
                assert (got_i == expected_i).all()

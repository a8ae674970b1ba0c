"""Power triage's windows: a trace's samples cut into per-GPU windows and their features.

Input is a telemetry trace (ARCHITECTURE.md, "Telemetry trace"); output is
phases.parquet: one row per GPU per window. Windows are floor(time /
window_s) on the unix clock, so the windows of all GPUs and hosts line up.
Each GPU gets every window from its first sample to its last; a window with no
power sample is `unknown` and takes no part in the rules: runs of the other
windows are measured across it, so a gap neither splits nor relabels them.
(On a GPU sampled about once per window, a single empty window between two
full ones is the sampler's grid jittering across a window edge, not missing
data: it takes the values of the window before it.)

Per window: mean power P, mean utilization U, and the shares of samples in
the high band (>= compute_min_w) and the low band (< low_max_w). Bands come
from the triage table: low [0, low_max_w), mid [low_max_w, compute_min_w),
high [compute_min_w, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from wattgate.errors import InputError
from wattgate.power.tables import TriageTable

SPARSE_SAMPLES = 2.5     # samples per window at or below which single empty windows are grid jitter
_COUNT_SHIFT = float(1 << 26)  # packs high- and low-band sample counts into one bincount pass


@dataclass
class _Samples:
    hosts: list[str]        # sorted host names
    host: np.ndarray        # host code per row (index into hosts)
    gpu: np.ndarray
    time: np.ndarray
    power: np.ndarray       # float32, NaN = missing
    util: np.ndarray        # float32, NaN = missing


NEEDED = ("time", "host", "gpu", "power_w", "util_gpu")


def _samples(trace) -> _Samples:
    if isinstance(trace, pa.Table):
        missing = [c for c in NEEDED if c not in trace.column_names]
        if missing:
            raise InputError(f"trace lacks column(s) {', '.join(missing)}")
        if trace.num_rows == 0:
            return _Samples([], *(np.zeros(0, t) for t in (np.int64, np.int64, np.float64, np.float32, np.float32)))
        encoded = pc.dictionary_encode(pc.fill_null(trace.column("host"), "")).combine_chunks()
        names = [str(h) for h in encoded.dictionary.to_pylist()]
        codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        gpu = pc.fill_null(trace.column("gpu"), -1).to_numpy().astype(np.int64)
        time_ = trace.column("time").to_numpy().astype(np.float64, copy=False)
        power = trace.column("power_w").to_numpy().astype(np.float32, copy=False)
        util = trace.column("util_gpu").to_numpy().astype(np.float32, copy=False)
    else:
        df = trace if isinstance(trace, pd.DataFrame) else pd.DataFrame({c: trace[c] for c in NEEDED if c in trace})
        missing = [c for c in NEEDED if c not in df.columns]
        if missing:
            raise InputError(f"trace lacks column(s) {', '.join(missing)}")
        codes, uniques = pd.factorize(df["host"].fillna("").astype(str))
        names = [str(h) for h in uniques]
        codes = codes.astype(np.int64)
        gpu = pd.to_numeric(df["gpu"]).fillna(-1).to_numpy().astype(np.int64)
        time_ = pd.to_numeric(df["time"]).to_numpy(np.float64)
        power = pd.to_numeric(df["power_w"]).to_numpy(np.float32, na_value=np.nan)
        util = pd.to_numeric(df["util_gpu"]).to_numpy(np.float32, na_value=np.nan)
    # a fixed host order (by name) keeps the output the same whatever the row or chunk order
    order = np.argsort(np.array(names, dtype=object), kind="stable")
    rank = np.empty(len(names), np.int64)
    rank[order] = np.arange(len(names))
    hosts = [names[i] for i in order]
    ok = (gpu >= 0) & np.isfinite(time_)
    if not ok.all():
        codes, gpu, time_, power, util = (a[ok] for a in (codes, gpu, time_, power, util))
    return _Samples(hosts, rank[codes] if len(codes) else codes, gpu, time_, power, util)


# ---------------------------------------------------------------- window features


@dataclass
class _Windows:
    keys: list[tuple[str, int]]   # (host, gpu) per GPU id, sorted
    gpu_id: np.ndarray            # per window
    index: np.ndarray             # absolute window index floor(time / window_s)
    n: np.ndarray                 # power samples
    power: np.ndarray             # mean, NaN where n == 0
    util: np.ndarray              # mean, NaN where no utilization sample
    high: np.ndarray              # share of samples >= compute_min_w
    low: np.ndarray               # share of samples < low_max_w


def _windows(s: _Samples, table: TriageTable, window_s: float) -> _Windows:
    ngpu_idx = int(s.gpu.max()) + 1
    key = s.host * ngpu_idx + s.gpu
    if len(s.hosts) * ngpu_idx <= 1 << 20:  # the usual case: a lookup table is faster than a sort
        present = np.flatnonzero(np.bincount(key, minlength=len(s.hosts) * ngpu_idx))
        lut = np.full(len(s.hosts) * ngpu_idx, -1, np.int64)
        lut[present] = np.arange(len(present))
        gid = lut[key]
    else:  # odd GPU indexes in a foreign trace
        present, gid = np.unique(key, return_inverse=True)
    del key
    keys = [(s.hosts[k // ngpu_idx], int(k % ngpu_idx)) for k in present]
    # window index, then position in the output (GPU-major), kept in float64 until the end:
    # at 10^7 rows every extra temporary array costs more than the arithmetic
    wf = s.time / window_s
    np.floor(wf, out=wf)
    first = np.full(len(keys), np.inf)
    last = np.full(len(keys), -np.inf)
    np.minimum.at(first, gid, wf)
    np.maximum.at(last, gid, wf)
    span = (last - first + 1).astype(np.int64)
    base = np.concatenate([[0], np.cumsum(span)])
    total = int(base[-1])
    wf += (base[:-1] - first)[gid]
    pos = wf.astype(np.int64)
    del wf
    samples_per_gpu = np.bincount(gid, minlength=len(keys))
    del gid
    valid = ~np.isnan(s.power)
    if not valid.all():
        pos, power, util = pos[valid], s.power[valid], s.util[valid]
    else:
        power, util = s.power, s.util
    # bincount is ~10x faster with float64 weights than with float32 ones
    power = power.astype(np.float64)
    n = np.bincount(pos, minlength=total)
    psum = np.bincount(pos, weights=power, minlength=total)
    bands = (power >= table.compute_min_w) * _COUNT_SHIFT
    bands += power < table.low_max_w
    bands = np.bincount(pos, weights=bands, minlength=total)
    del power
    uvalid = ~np.isnan(util)
    if uvalid.all():
        nu = n
        usum = np.bincount(pos, weights=util.astype(np.float64), minlength=total)
    else:
        nu = np.bincount(pos[uvalid], minlength=total)
        usum = np.bincount(pos[uvalid], weights=util[uvalid].astype(np.float64), minlength=total)
    with np.errstate(invalid="ignore", divide="ignore"):
        nf = n.astype(np.float64)
        mean_p = psum / nf
        mean_u = np.where(nu > 0, usum / np.maximum(nu, 1), np.nan)
        high = np.floor(bands / _COUNT_SHIFT) / nf
        low = np.mod(bands, _COUNT_SHIFT) / nf
    gpu_id = np.repeat(np.arange(len(keys)), span)
    index = np.arange(total) - base[gpu_id] + first.astype(np.int64)[gpu_id]
    win = _Windows(keys, gpu_id, index, n, mean_p, mean_u, high, low)
    _fill_grid_holes(win, samples_per_gpu)
    return win


def _fill_grid_holes(win: _Windows, samples_per_gpu: np.ndarray) -> None:
    """A GPU sampled about once per window leaves single empty windows where the sampler's grid
    jitters across a window edge: not missing data, so such a hole takes the window before it."""
    known = win.n > 0
    per_window = samples_per_gpu / np.maximum(np.bincount(win.gpu_id[known], minlength=len(samples_per_gpu)), 1)
    hole = np.zeros(len(known), dtype=bool)
    hole[1:-1] = ~known[1:-1] & known[:-2] & known[2:] & (win.gpu_id[:-2] == win.gpu_id[2:])
    hole &= per_window[win.gpu_id] <= SPARSE_SAMPLES
    at = np.flatnonzero(hole)
    for a in (win.n, win.power, win.util, win.high, win.low):
        a[at] = a[at - 1]


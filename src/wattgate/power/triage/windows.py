"""Power triage's windows: a trace's samples cut into per-GPU windows and their features.

Input is a telemetry trace (ARCHITECTURE.md, "Telemetry trace"); output is
phases.parquet: one row per GPU per window. Windows are floor(time /
window_s) on the unix clock, so the windows of all GPUs and hosts line up.
Each GPU gets every window from its first sample to its last. A gap in the
samples shorter than a few sampling periods (GAP_FILL_PERIODS, and always
one of up to GAP_FILL_MIN_WINDOWS windows: the sampler's grid jittering
across a window edge) is not missing data: its empty windows take the values
of the nearest window with samples, so they take the phase around them (with
confidence at most 0.5). A longer gap is `unknown` and takes no part in the
rules: runs of the other windows are measured across it, so it neither splits
nor relabels them; triage.json and the report say how much time it was.

Per window: mean power P, mean utilization U, and the shares of samples in
the high band (>= compute_min_w) and the low band (< low_max_w), against the
GPU's own edges (levels.py): low [0, low_max_w), mid [low_max_w,
compute_min_w), high [compute_min_w, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from wattgate.errors import InputError
from wattgate.power.tables import TriageTable
from wattgate.power.triage.arrays import _ranges, _runs
from wattgate.power.triage.levels import Levels, learn_levels

GAP_FILL_PERIODS = 4.0   # an empty stretch shorter than this many sampling periods takes the phase around it
GAP_FILL_MIN_WINDOWS = 2  # ... and always one of up to this many windows (the sampler's grid jittering at an edge)
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
    high: np.ndarray              # share of samples >= the GPU's compute_min_w
    low: np.ndarray               # share of samples < the GPU's low_max_w
    filled: np.ndarray            # no sample, but inside a short gap: values of the nearest window
    levels: Levels


def _windows(s: _Samples, table: TriageTable, window_s: float, caps: dict | None = None,
             power_cap_w: float | None = None) -> _Windows:
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
    valid = ~np.isnan(s.power)
    if not valid.all():
        pos, gid, power, util = pos[valid], gid[valid], s.power[valid], s.util[valid]
    else:
        power, util = s.power, s.util
    # bincount is ~10x faster with float64 weights than with float32 ones
    power = power.astype(np.float64)
    n = np.bincount(pos, minlength=total)
    psum = np.bincount(pos, weights=power, minlength=total)
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
    gpu_id = np.repeat(np.arange(len(keys)), span)
    index = np.arange(total) - base[gpu_id] + first.astype(np.int64)[gpu_id]

    known = n > 0
    cap = np.array([_cap_of(k, caps, power_cap_w, table) for k in keys], float)
    levels = learn_levels(mean_p[known], mean_u[known], gpu_id[known], len(keys), table, window_s, cap)
    # per-sample bands against the GPU's own edges: the oscillation rule counts samples, not means
    bands = (power >= levels.compute_min_w[gid]) * _COUNT_SHIFT
    bands += power < levels.low_max_w[gid]
    del gid, power
    bands = np.bincount(pos, weights=bands, minlength=total)
    with np.errstate(invalid="ignore", divide="ignore"):
        high = np.floor(bands / _COUNT_SHIFT) / nf
        low = np.mod(bands, _COUNT_SHIFT) / nf
    win = _Windows(keys, gpu_id, index, n, mean_p, mean_u, high, low, np.zeros(total, dtype=bool), levels)
    _fill_short_gaps(win, samples_per_gpu, window_s)
    return win


def _cap_of(key, caps: dict | None, power_cap_w: float | None, table: TriageTable) -> float:
    """The GPU's power cap: --power-cap-w, else the enforced limit the sampler recorded, else the table's tdp_w."""
    if power_cap_w:
        return float(power_cap_w)
    cap = (caps or {}).get(key)
    return float(cap) if cap else float(table.tdp_w)


def _fill_short_gaps(win: _Windows, samples_per_gpu: np.ndarray, window_s: float) -> None:
    """Empty windows inside a gap of fewer than GAP_FILL_PERIODS sampling periods (or GAP_FILL_MIN_WINDOWS
    windows: the sampler's grid jittering across a window edge) take the values of the nearest known
    window; longer gaps stay unknown."""
    known = win.n > 0
    ngpu = len(samples_per_gpu)
    per_window = samples_per_gpu / np.maximum(np.bincount(win.gpu_id[known], minlength=ngpu), 1)
    period = window_s / np.maximum(per_window, 1e-9)
    limit = np.maximum(GAP_FILL_PERIODS * period, GAP_FILL_MIN_WINDOWS * window_s)  # seconds, per GPU
    starts, ends = _runs(known, win.gpu_id)
    empty = ~known[starts]
    starts, ends = starts[empty], ends[empty]
    if len(starts) == 0:
        return
    g = win.gpu_id[starts]
    interior = (starts > 0) & (ends < len(known))
    interior &= (win.gpu_id[np.maximum(starts - 1, 0)] == g) & (win.gpu_id[np.minimum(ends, len(known) - 1)] == g)
    gap_s = (ends - starts + 1) * window_s  # from the last sample's window to the next sample's
    short = interior & (gap_s <= limit[g] + 1e-9)
    s, e = starts[short], ends[short]
    if len(s) == 0:
        return
    at = _ranges(s, e)
    mid = np.repeat(s + (e - s) // 2, e - s)
    src = np.where(at < mid, np.repeat(s - 1, e - s), np.repeat(e, e - s))
    for arr in (win.n, win.power, win.util, win.high, win.low):
        arr[at] = arr[src]
    win.filled[at] = True

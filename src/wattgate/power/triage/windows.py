"""Power triage's windows: a trace's samples cut into per-GPU windows and their features.

Input is a telemetry trace (docs/architecture.md, "Telemetry trace"); output is
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

GAP_FILL_PERIODS = 4.0  # an empty stretch shorter than this many sampling periods takes the phase around it
GAP_FILL_MIN_WINDOWS = 2  # ... and always one of up to this many windows (the sampler's grid jittering at an edge)
_COUNT_SHIFT = float(1 << 26)  # packs high- and low-band sample counts into one bincount pass


@dataclass
class _Samples:
    hosts: list[str]  # sorted host names
    host: np.ndarray  # host code per row (index into hosts)
    gpu: np.ndarray
    time: np.ndarray
    power: np.ndarray  # float32, NaN = missing
    util: np.ndarray  # float32, NaN = missing
    kept: np.ndarray | None = None  # the input's rows kept (those with a GPU and a finite time); None: all
    # instead of host and gpu: host rank * width + gpu per row (a trace read with a dictionary host)
    key: np.ndarray | None = None
    width: int = 0
    # GPU ids (_gpus, once): (host, gpu) per id, the id of every sample, samples per id
    keys: list | None = None
    gid: np.ndarray | None = None
    counts: np.ndarray | None = None


NEEDED = ("time", "host", "gpu", "power_w", "util_gpu")


def _samples(trace) -> _Samples:
    if isinstance(trace, pa.Table):
        missing = [c for c in NEEDED if c not in trace.column_names]
        if missing:
            raise InputError(f"trace lacks column(s) {', '.join(missing)}")
        if trace.num_rows == 0:
            return _Samples([], *(np.zeros(0, t) for t in (np.int64, np.int64, np.float64, np.float32, np.float32)))
        # each column straight into its array, chunk by chunk: no concatenated copy to convert again
        if pa.types.is_dictionary(trace.column("host").type):  # read_trace(columns=): one key per row
            hosts, width, key = _row_keys(trace.column("host"), trace.column("gpu"))
            time_ = _column(trace.column("time"), np.float64)
            power = _column(trace.column("power_w"), np.float32)
            util = _column(trace.column("util_gpu"), np.float32)
            ok = (key >= 0) & np.isfinite(time_)
            kept = None
            if not ok.all():
                key, time_, power, util = (a[ok] for a in (key, time_, power, util))
                kept = ok
            return _Samples(hosts, None, None, time_, power, util, kept, key, width)
        names, codes = _host_codes(trace.column("host"))
        gpu = _column(trace.column("gpu"), np.int64, -1)
        time_ = _column(trace.column("time"), np.float64)
        power = _column(trace.column("power_w"), np.float32)
        util = _column(trace.column("util_gpu"), np.float32)
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
    kept = None
    if not ok.all():
        codes, gpu, time_, power, util = (a[ok] for a in (codes, gpu, time_, power, util))
        kept = ok
    return _Samples(hosts, rank[codes] if len(codes) else codes, gpu, time_, power, util, kept)


def _column(col: pa.ChunkedArray, dtype, fill=None) -> np.ndarray:
    """A numeric column as one numpy array of dtype (null -> fill, else NaN)."""
    out = np.empty(len(col), dtype)
    a = 0
    for chunk in col.chunks:
        if fill is not None and chunk.null_count:
            chunk = pc.fill_null(chunk, fill)
        b = a + len(chunk)
        np.copyto(out[a:b], chunk.to_numpy(zero_copy_only=False), casting="unsafe")
        a = b
    return out


def _row_keys(host: pa.ChunkedArray, gpu: pa.ChunkedArray) -> tuple[list[str], int, np.ndarray]:
    """(sorted host names, width, rank of the row's host * width + gpu per row; -1 where the row has no GPU)
    of a dictionary host column, chunk by chunk through the chunks' small dictionaries."""
    names = {"" if v is None else str(v) for c in host.chunks for v in c.dictionary.to_pylist()}
    if host.null_count:
        names.add("")  # a missing host is ""
    hosts = sorted(names)
    rank = {h: i for i, h in enumerate(hosts)}
    top = pc.max(gpu).as_py()
    width = max(int(top) + 1 if top is not None else 1, 1)
    out = np.empty(len(host), np.int64)
    a = 0
    for batch in pa.table({"host": host, "gpu": gpu}).to_batches():  # the two columns' chunks lined up
        hc, gc = batch.column(0), batch.column(1)
        values = ["" if v is None else str(v) for v in hc.dictionary.to_pylist()]
        lut = np.array([rank[v] for v in values] + [rank.get("", -1)], np.int64)
        idx = hc.indices
        if hc.null_count:
            idx = pc.fill_null(idx, len(values))
        b = a + len(hc)
        seg = out[a:b]
        np.take(lut, idx.to_numpy(zero_copy_only=False), out=seg)
        seg *= width
        g = (pc.fill_null(gc, -1) if gc.null_count else gc).to_numpy(zero_copy_only=False)
        seg += g
        if g.min(initial=0) < 0:
            seg[g < 0] = -1
        a = b
    return hosts, width, out


def _host_codes(host: pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """(names, code per row) of a string host column; a missing host is "" (a dictionary one: _row_keys)."""
    encoded = pc.dictionary_encode(pc.fill_null(host.cast(pa.string()), "")).combine_chunks()
    names = [str(h) for h in encoded.dictionary.to_pylist()]
    return names, encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


# ---------------------------------------------------------------- window features


@dataclass
class _Windows:
    keys: list[tuple[str, int]]  # (host, gpu) per GPU id, sorted
    gpu_id: np.ndarray  # per window
    index: np.ndarray  # absolute window index floor(time / window_s)
    n: np.ndarray  # power samples
    power: np.ndarray  # mean, NaN where n == 0
    util: np.ndarray  # mean, NaN where no utilization sample
    high: np.ndarray  # share of samples >= the GPU's compute_min_w
    low: np.ndarray  # share of samples < the GPU's low_max_w
    filled: np.ndarray  # no sample, but inside a short gap: values of the nearest window
    levels: Levels


def _gpus(s: _Samples) -> tuple[list[tuple[str, int]], np.ndarray, np.ndarray]:
    """(keys: (host, gpu) per GPU id, sorted; the GPU id of every sample;
    samples per GPU id), computed once per _Samples."""
    if s.gid is not None:
        return s.keys, s.gid, s.counts
    if s.key is not None:
        ngpu_idx, key = s.width, s.key
        s.key = None
    else:
        ngpu_idx = int(s.gpu.max()) + 1
        key = s.host * ngpu_idx + s.gpu
    if len(s.hosts) * ngpu_idx <= 1 << 20:  # the usual case: a lookup table is faster than a sort
        counts = np.bincount(key, minlength=len(s.hosts) * ngpu_idx)
        present = np.flatnonzero(counts)
        counts = counts[present]
        lut = np.full(len(s.hosts) * ngpu_idx, -1, np.intp)  # intp: numpy gathers by it without a copy
        lut[present] = np.arange(len(present))
        gid = lut[key]
    else:  # odd GPU indexes in a foreign trace
        present, gid, counts = np.unique(key, return_inverse=True, return_counts=True)
    del key
    s.keys = [(s.hosts[k // ngpu_idx], int(k % ngpu_idx)) for k in present]
    s.gid, s.counts = gid, counts
    return s.keys, gid, counts


def _windows(
    s: _Samples, table: TriageTable, window_s: float, caps: dict | None = None, power_cap_w: float | None = None
) -> _Windows:
    keys, gid, samples_per_gpu = _gpus(s)
    # window index, then position in the output (GPU-major), kept in float64 until the end; at 10^7 rows
    # every fresh temporary costs more than the arithmetic (page faults), so two float64 buffers are reused
    buf = s.time / window_s
    np.floor(buf, out=buf)
    first = np.full(len(keys), np.inf)
    last = np.full(len(keys), -np.inf)
    np.minimum.at(first, gid, buf)
    np.maximum.at(last, gid, buf)
    span = (last - first + 1).astype(np.int64)
    base = np.concatenate([[0], np.cumsum(span)])
    total = int(base[-1])
    buf2 = np.take(base[:-1] - first, gid)
    buf += buf2
    pos = buf.astype(np.int64)
    valid = ~np.isnan(s.power)
    if not valid.all():
        del buf, buf2
        pos, gid, power, util = pos[valid], gid[valid], s.power[valid], s.util[valid]
        # bincount is ~10x faster with float64 weights than with float32 ones
        power = power.astype(np.float64)
        util = util.astype(np.float64)
    else:
        power, util = buf, buf2
        power[:] = s.power
        util[:] = s.util
    n = np.bincount(pos, minlength=total)
    psum = np.bincount(pos, weights=power, minlength=total)
    uvalid = ~np.isnan(util)
    if uvalid.all():
        nu = n
        usum = np.bincount(pos, weights=util, minlength=total)
    else:
        nu = np.bincount(pos[uvalid], minlength=total)
        usum = np.bincount(pos[uvalid], weights=util[uvalid], minlength=total)
    del uvalid
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
    # (into util's buffer: high samples count _COUNT_SHIFT, low ones 1)
    bands, high_mask, low_mask = util, np.empty(len(power), bool), np.empty(len(power), bool)
    np.take(levels.compute_min_w, gid, out=bands)
    np.greater_equal(power, bands, out=high_mask)
    np.take(levels.low_max_w, gid, out=bands)
    np.less(power, bands, out=low_mask)
    np.multiply(high_mask, _COUNT_SHIFT, out=bands)
    bands += low_mask
    del gid, power, high_mask, low_mask
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

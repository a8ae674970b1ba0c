"""A straightforward pandas version of triage + summary: the baseline that issue 14's ratio is measured against.

What a competent engineer would write first with pandas, no numpy tricks and no
deliberate slowness, for the same windowing, labelling and summary as
`wattgate triage` + the report's numbers:

1. read: `pd.read_parquet` of each trace (only the columns used: time, host,
   gpu, power_w, util_gpu), concatenated; each GPU's recorded power cap from
   the files' metadata.
2. windowing: window = floor(time / window_s); groupby (host, gpu, window):
   sample count, mean power, mean utilization; each GPU reindexed to every
   window from its first to its last (a window with no sample is `unknown`).
3. levels per GPU (levels.py), on its known windows: idle level (0.2
   quantile of quiet windows), wait level and robust spread (median and MAD
   of busy low-band windows in runs of >= 10 s), the lowest 90 s compute
   plateau (a centred `groupby().rolling(90).sum()` of count, sum and sum of
   squares); from them the GPU's band edges (low_max_w, compute_min_w) and
   idle_w, and its cap (recorded, else the table's tdp_w). Then the share of
   each window's samples in the GPU's high and low band: the samples joined
   with their GPU's edges, groupby (host, gpu, window) mean.
4. gap filling (windows.py): empty windows in a gap of up to 4 sampling
   periods (at least 2 windows) take the values of the nearest window with
   samples (groupby ffill / bfill by position in the gap).
5. labelling, on the known windows of each GPU (unknown windows take no part,
   as in the package), the package's triage rules:
   - rule 1 (band) WITHOUT hysteresis: band of the rolling median of power over
     5 known windows (`groupby().rolling(5, center=True).median()`) against
     the GPU's edges, never two bands from the window's own power nor out of
     the high band past its margin;
   - rule 2 (class) in full: the power-cap rule (>= 90% of the cap is
     compute), compute / communication / data_starvation / wait / idle /
     low-util by band and utilization, the light-work idle case, the
     no-utilization cases, and the oscillation rule; then the peer vote per
     window (groupby window: lower median power and utilization, the GPUs
     near both, a strict plurality of their classes);
   - rule 3 (majority filter over 5 windows, a tie keeps the window's own
     class, so do a window two bands from the winner and a compute burst): a
     centred rolling sum of one-hot class columns per GPU, argmax;
   - rule 4, first half: runs of waits (groupby runs): communication if
     shorter than deadlock_after_s, checkpoint if activity resumes within
     deadlock_after_s after it, else deadlock.
   LEFT OUT (the package does this work, the baseline does not, so the ratio
   is conservative): hysteresis in rule 1, rule 4's second half (short
   checkpoints: the idle-rank episode and periodicity tests), rule 5 (peer
   rules: writer and stuck rank), rule 6 (run info: heartbeats and metrics),
   the confidence column, per-GPU energy from the NVML counter (the baseline
   integrates power only), the pauses, and writing anything.
   Low-util becomes data_starvation at the end, as in the package.
6. summary: per (host, gpu, phase) windows, seconds, share of the GPU's time
   and energy (mean power x window length); per-GPU energy by the trapezoid
   over the samples (sort by host, gpu, time; groupby diff).
7. stragglers (issue 34, power/triage/stragglers.py): each GPU's busy share
   (1 - its low-band share) per window, pivoted to windows x GPUs for the job
   and for each host; per window the busiest GPU (`idxmax`), the runner-up
   (`rank(axis=1)`), the GPUs busy MARGIN less than the busiest; wait windows,
   the last GPU of each, counts per GPU (`value_counts`), lag shares, the
   peers' waiting (busy share below the last's times the window, and times
   each peer's wait level for the energy); the stragglers by share, count and
   against the median GPU; their cause from the SM clock, temperature and
   clocks-event reasons of their lagging windows against their peers'
   (samples of those windows grouped per GPU), and their power at their limit.
   LEFT OUT: the data and rank-0 causes (they need the run's files).

    pandas_triage_and_summary(trace_paths, table, window_s=1.0)
        -> (phases_df, shares_by_phase, energy_by_gpu_j, stragglers)

Standalone:

    python bench/pandas_triage.py TRACE.parquet... --gpu-model b300 [--window-s 1] [--compare [--run-dir DIR]]
    python bench/pandas_triage.py --smoke

prints the time and the phase shares, and the package's own triage() of the same traces (power only) timed
beside it; --compare also prints the agreement of the phase shares (and with --run-dir the package's triage with
the run's heartbeats and metrics). `--smoke` builds a quarter-hour trace of 2 hosts x 2 GPUs with a run folder
(wattgate.testing.synthetic_trace) and compares on it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from benchlib import Parser, figure, positive_float, positive_int
from wattgate.triage_tables import POWER_PHASES, resolve_table, shipped_table

LABELS = POWER_PHASES + ("unknown",)
DEADLOCK_AFTER_S = 60.0
RADIUS = 2  # windows on each side: rolling median and majority filter over 5
OSCILLATION_SHARE = 0.15
NO_UTIL_IDLE_SHARE = 0.30
LIGHT_UTIL_PCT = 10.0
EDGE_MARGIN = 0.10
AT_CAP_SHARE = 0.9
PEER_POWER_TOL = 0.12
PEER_UTIL_TOL = 15.0
# levels (power/triage/levels.py)
LEVEL_MIN_WINDOWS = 5
IDLE_QUANTILE = 0.2
WAIT_MIN_S = 10.0
WAIT_SPREADS = 3.0
PLATEAU_MIN_S = 90.0
PLATEAU_MIN_WINDOWS = 10
PLATEAU_SHARE = 0.9
PLATEAU_CV = 0.08
PLATEAU_BAND = 0.12
# gap filling (power/triage/windows.py)
GAP_FILL_PERIODS = 4.0
GAP_FILL_MIN_WINDOWS = 2
ACTIVE = ("compute", "communication", "data_starvation")
CLASS_BAND = {"compute": 2, "communication": 1, "wait": 0, "idle": 0}  # band a class implies
COLUMNS = ["time", "host", "gpu", "power_w", "util_gpu"]
CAUSE_COLUMNS = ["sm_clock_mhz", "temp_c", "clocks_event_reasons"]  # read where the traces have them
GPU = ["host", "gpu"]
# stragglers (power/triage/stragglers.py)
MARGIN, MIN_LAG_WINDOWS, DOMINANCE, MEMBER_SHARE, BUSY, STRAGGLER_SHARE = 0.15, 3, 3.0, 0.1, 0.5, 0.3
REASON_GROUPS = {"thermal": 0x60, "power_cap": 0x4, "hw_slowdown": 0x88}


def read_traces(trace_paths) -> tuple[pd.DataFrame, dict]:
    """The traces' rows, and each GPU's recorded power cap ((host, gpu) -> W) from the files' metadata."""
    frames = []
    for p in trace_paths:
        have = set(pq.read_schema(p).names)
        frames.append(pd.read_parquet(p, columns=COLUMNS + [c for c in CAUSE_COLUMNS if c in have]))
    df = pd.concat(frames, ignore_index=True)
    df["host"] = df["host"].astype(str)
    caps = {}
    for p in trace_paths:
        meta = json.loads((pq.read_schema(p).metadata or {}).get(b"wattgate.trace", b"{}"))
        for g in meta.get("gpus", []):
            if g.get("power_limit_w") and meta.get("host") is not None and g.get("index") is not None:
                caps[(str(meta["host"]), int(g["index"]))] = float(g["power_limit_w"])
    return df, caps


def windows(df: pd.DataFrame, window_s: float) -> tuple[pd.DataFrame, pd.DataFrame, pd.Series]:
    """(windows, samples, samples per GPU): per (host, gpu, window) n, power, util, every window of a GPU from
    its first to its last; the samples with their window, for the band shares once the levels are known."""
    samples_per_gpu = df.groupby(GPU).size()
    df = df[df["power_w"].notna()]
    work = pd.DataFrame(
        {
            "host": df["host"],
            "gpu": df["gpu"],
            "window": np.floor(df["time"] / window_s).astype("int64"),
            "power": df["power_w"].astype("float64"),
            "util": df["util_gpu"].astype("float64"),
        }
    )
    win = work.groupby(["host", "gpu", "window"], sort=True).agg(
        n=("power", "size"), power=("power", "mean"), util=("util", "mean")
    )
    # every window from each GPU's first to its last
    span = win.reset_index().groupby(GPU)["window"].agg(["min", "max"])
    full = [
        pd.MultiIndex.from_product([[h], [g], range(int(r["min"]), int(r["max"]) + 1)]) for (h, g), r in span.iterrows()
    ]
    win = win.reindex(full[0].append(full[1:]).set_names(["host", "gpu", "window"]))
    win["n"] = win["n"].fillna(0).astype("int64")
    return win.reset_index(), work, samples_per_gpu


def learn_levels(k: pd.DataFrame, table, window_s: float, caps: dict, power_cap_w=None) -> pd.DataFrame:
    """Per GPU (index host, gpu): idle_w, low_max_w, compute_min_w, cap_w, learned from its known windows
    as levels.py does: idle quantile, sustained wait level, 90 s compute plateaus."""
    keys = [k["host"], k["gpu"]]
    p, u = k["power"], k["util"]
    busy = u >= table.busy_util_pct
    quiet = (u <= table.idle_util_pct) & (p < table.low_max_w)
    waiting = busy & (p < table.low_max_w)
    floor = table.low_max_w + 0.5 * (table.compute_min_w - table.low_max_w)
    cand = busy & (p >= floor)
    gpus = k.groupby(GPU).size().index
    out = pd.DataFrame(index=gpus)
    # idle with a context held: a low quantile of the quiet windows
    q = p[quiet].groupby([k["host"][quiet], k["gpu"][quiet]])
    idle = q.quantile(IDLE_QUANTILE).where(q.size() >= LEVEL_MIN_WINDOWS)
    out["idle_w"] = idle.reindex(gpus).fillna(float(table.idle_w))
    # the wait level: busy low-band windows in stretches of WAIT_MIN_S
    gpu_change = (k["host"] != k["host"].shift()) | (k["gpu"] != k["gpu"].shift())
    run = ((waiting != waiting.shift()) | gpu_change).cumsum()
    in_wait = waiting & (waiting.groupby(run).transform("size") * window_s >= WAIT_MIN_S)
    w = p[in_wait].groupby([k["host"][in_wait], k["gpu"][in_wait]])
    wait = w.median().where(w.size() >= LEVEL_MIN_WINDOWS)
    dev = (
        p[in_wait] - wait.reindex(pd.MultiIndex.from_arrays([k["host"][in_wait], k["gpu"][in_wait]])).to_numpy()
    ).abs()
    spread = 1.4826 * dev.groupby([k["host"][in_wait], k["gpu"][in_wait]]).median()
    out["wait_w"], out["spread"] = wait.reindex(gpus), spread.reindex(gpus).fillna(0.0)
    # compute plateaus: centred spans of PLATEAU_MIN_S, nearly all busy at a steady power above the floor
    span = max(PLATEAU_MIN_WINDOWS, int(math.ceil(PLATEAU_MIN_S / window_s)))
    pz = p.where(cand, 0.0)
    roll = (
        pd.DataFrame({"cnt": cand.astype("float64"), "s1": pz, "s2": pz * pz})
        .groupby(keys)
        .rolling(span, center=True, min_periods=span)
        .sum()
        .reset_index(level=[0, 1], drop=True)
        .reindex(k.index)
    )
    mean = roll["s1"] / roll["cnt"]
    sd = np.sqrt((roll["s2"] / roll["cnt"] - mean * mean).clip(lower=0.0))
    core = cand & (roll["cnt"] >= PLATEAU_SHARE * span) & (sd <= PLATEAU_CV * mean)
    plateau = mean[core].groupby([k["host"][core], k["gpu"][core]]).min()
    out["plateau_w"] = plateau.reindex(gpus)
    out["compute_min_w"] = (
        (out["plateau_w"] * (1 - PLATEAU_BAND)).clip(floor, table.compute_min_w).fillna(float(table.compute_min_w))
    )
    low_max = (out["wait_w"] + WAIT_SPREADS * out["spread"]).clip(
        lower=float(table.low_max_w), upper=(table.low_max_w + out["compute_min_w"]) / 2
    )
    out["low_max_w"] = low_max.fillna(float(table.low_max_w))
    out["idle_w"] = np.minimum(out["idle_w"], 0.8 * out["low_max_w"])
    out["cap_w"] = [
        float(power_cap_w) if power_cap_w else caps.get((h, int(g)), float(table.tdp_w)) for h, g in out.index
    ]
    return out


def band_shares(win: pd.DataFrame, work: pd.DataFrame, levels: pd.DataFrame) -> pd.DataFrame:
    """Share of each window's samples in its GPU's high band (>= compute_min_w) and low band (< low_max_w)."""
    edges = work[GPU].join(levels[["compute_min_w", "low_max_w"]], on=GPU)
    bands = pd.DataFrame(
        {
            "host": work["host"],
            "gpu": work["gpu"],
            "window": work["window"],
            "high": (work["power"] >= edges["compute_min_w"]).astype("float64"),
            "low": (work["power"] < edges["low_max_w"]).astype("float64"),
        }
    )
    shares = bands.groupby(["host", "gpu", "window"])[["high", "low"]].mean()
    return win.join(shares, on=["host", "gpu", "window"])


def fill_short_gaps(win: pd.DataFrame, samples_per_gpu: pd.Series, window_s: float) -> pd.DataFrame:
    """Empty windows in a gap of up to GAP_FILL_PERIODS sampling periods (at least GAP_FILL_MIN_WINDOWS
    windows) take the values of the nearest window with samples (first half the one before, the rest the one
    after); longer gaps stay unknown. A GPU's windows start and end with samples, so every gap is inside."""
    known = win["n"] > 0
    keys = [win["host"], win["gpu"]]
    per_window = samples_per_gpu / known.groupby(keys).sum().clip(lower=1)
    limit = np.maximum(GAP_FILL_PERIODS * window_s / per_window.clip(lower=1e-9), GAP_FILL_MIN_WINDOWS * window_s)
    gpu_change = (win["host"] != win["host"].shift()) | (win["gpu"] != win["gpu"].shift())
    run = ((known != known.shift()) | gpu_change).cumsum()
    length = known.groupby(run).transform("size")
    pos = known.groupby(run).cumcount()
    lim = limit.reindex(pd.MultiIndex.from_frame(win[GPU])).to_numpy()
    short = ~known & ((length + 1) * window_s <= lim + 1e-9)
    if short.any():
        for col in ("n", "power", "util", "high", "low"):
            before = win[col].where(known).groupby(keys).ffill()
            after = win[col].where(known).groupby(keys).bfill()
            win.loc[short, col] = np.where(pos < length // 2, before, after)[short.to_numpy()]
    win["filled"] = short
    return win


def band(k: pd.DataFrame) -> pd.Series:
    """Rule 1 without hysteresis: band of the rolling median of power over 5 known windows against the GPU's
    edges, never two bands from the window's own power nor out of the high band past its margin."""
    median = (
        k.groupby(GPU)["power"]
        .rolling(2 * RADIUS + 1, center=True, min_periods=1)
        .median()
        .reset_index(level=[0, 1], drop=True)
    )
    med_band = (median >= k["lo"]).astype(int) + (median >= k["hi"]).astype(int)
    own = (k["power"] >= k["lo"]).astype(int) + (k["power"] >= k["hi"]).astype(int)
    keep_own = ((med_band - own).abs() >= 2) | (k["power"] >= k["hi"] + EDGE_MARGIN * (k["hi"] - k["lo"]))
    return own.where(keep_own, med_band)


def classify(k: pd.DataFrame, table) -> pd.Series:
    """Rule 2 on the known windows (needs band, power, util, high, low and the GPU's edges)."""
    band, p, u = k["band"], k["power"], k["util"]
    busy, idle, no_util = u >= table.busy_util_pct, u <= table.idle_util_pct, u.isna()
    quiet = k["idle"] + NO_UTIL_IDLE_SHARE * (k["lo"] - k["idle"])
    cls = pd.Series("low_util", index=k.index, dtype=object)
    cls[(band == 2) & (busy | no_util)] = "compute"
    cls[(band == 2) & ~busy & ~no_util] = "data_starvation"
    cls[(band == 1) & (busy | no_util)] = "communication"
    cls[(band == 1) & ~busy & ~no_util] = "data_starvation"
    low_band = band == 0
    cls[low_band & busy] = "wait"
    cls[low_band & idle] = "idle"
    cls[low_band & ~busy & ~idle & (u < LIGHT_UTIL_PCT) & (p <= quiet) & (k["high"] == 0)] = "idle"
    cls[low_band & no_util & (p <= quiet)] = "idle"
    cls[low_band & no_util & (p > quiet)] = "wait"
    cls[(k["high"] >= OSCILLATION_SHARE) & (k["low"] >= OSCILLATION_SHARE) & ~busy] = "data_starvation"
    cls[p >= AT_CAP_SHARE * k["cap"]] = "compute"
    return cls


def peer_vote(k: pd.DataFrame, cls: pd.Series) -> pd.Series:
    """Per window (matched by time over every GPU): the GPUs within 12% of the peers' median power and 15
    points of their median utilization, if at least half of them and two, take their most common class
    (a strict plurality; a tie changes nothing)."""
    by = k.groupby("window")
    uu = k["util"].fillna(-1.0)
    # the lower median (an odd count's middle, an even count's lower middle), as the package takes it
    med_p = k["window"].map(by["power"].quantile(0.5, interpolation="lower"))
    med_u = k["window"].map(uu.groupby(k["window"]).quantile(0.5, interpolation="lower"))
    with_peers = ((k["power"] - med_p).abs() <= PEER_POWER_TOL * np.maximum(med_p, k["lo"])) & (
        (uu - med_u).abs() <= PEER_UTIL_TOL
    )
    count = by["power"].transform("size")
    n_with = with_peers.groupby(k["window"]).transform("sum")
    sel = with_peers & (count >= 2) & (n_with >= np.maximum(2, np.ceil(count / 2)))
    votes = pd.DataFrame({"window": k["window"][sel], "cls": cls[sel]}).groupby(["window", "cls"]).size()
    top = votes.groupby(level=0).transform("max")
    winners = votes[votes == top].reset_index()
    strict = winners[~winners["window"].duplicated(keep=False)]  # one class alone at the top
    best = k["window"].map(strict.set_index("window")["cls"])
    take = sel & best.notna()
    return cls.where(~take, best)


def majority(k: pd.DataFrame, cls: pd.Series) -> pd.Series:
    """Rule 3: most common class among a window and 2 known windows on each side of its GPU; a tie keeps its
    own, and so do a window whose own power is two bands from the winner's class and a compute burst."""
    onehot = pd.get_dummies(cls, dtype="float64")
    keys = [k["host"], k["gpu"]]
    counts = (
        onehot.groupby(keys)
        .rolling(2 * RADIUS + 1, center=True, min_periods=1)
        .sum()
        .reset_index(level=[0, 1], drop=True)
        .reindex(onehot.index)
    )
    best = counts.idxmax(axis=1)
    own = pd.Series(counts.to_numpy()[np.arange(len(counts)), counts.columns.get_indexer(cls)], index=cls.index)
    own_band = (k["power"] >= k["lo"]).astype(int) + (k["power"] >= k["hi"]).astype(int)
    far = (best.map(CLASS_BAND) - own_band).abs() >= 2
    burst = (cls == "compute") & (k["power"] >= k["hi"] + EDGE_MARGIN * (k["hi"] - k["lo"]))
    return cls.where((own == counts.max(axis=1)) | far | burst, best)


def resolve_waits(k: pd.DataFrame, cls: pd.Series, window_s: float, deadlock_after_s: float) -> pd.Series:
    """Rule 4, first half: each run of waits by its length and whether activity resumes soon after it."""
    gpu_change = (k["host"] != k["host"].shift()) | (k["gpu"] != k["gpu"].shift())
    run = ((cls != cls.shift()) | gpu_change).cumsum()
    runs = (
        pd.DataFrame({"host": k["host"], "gpu": k["gpu"], "cls": cls, "window": k["window"], "run": run})
        .groupby("run")
        .agg(
            host=("host", "first"),
            gpu=("gpu", "first"),
            cls=("cls", "first"),
            first=("window", "min"),
            last=("window", "max"),
        )
    )
    active_start = runs["first"].where(runs["cls"].isin(ACTIVE))
    next_active = active_start.groupby([runs["host"], runs["gpu"]]).shift(-1)
    next_active = next_active.groupby([runs["host"], runs["gpu"]]).bfill()
    length = (runs["last"] + 1 - runs["first"]) * window_s
    gap = (next_active - runs["last"] - 1) * window_s
    label = np.where(
        length < deadlock_after_s,
        "communication",
        np.where(next_active.notna() & (gap < deadlock_after_s), "checkpoint", "deadlock"),
    )
    runs["resolved"] = np.where(runs["cls"] == "wait", label, runs["cls"])
    return run.map(runs["resolved"])


def label(
    win: pd.DataFrame, levels: pd.DataFrame, table, window_s: float, deadlock_after_s: float = DEADLOCK_AFTER_S
) -> pd.Series:
    known = win[win["n"] > 0].copy()
    edges = known[GPU].join(levels, on=GPU)
    known["lo"], known["hi"] = edges["low_max_w"], edges["compute_min_w"]
    known["idle"], known["cap"] = edges["idle_w"], edges["cap_w"]
    known["band"] = band(known)
    raw = peer_vote(known, classify(known, table))
    smooth = majority(known, raw)
    cls = resolve_waits(known, smooth, window_s, deadlock_after_s).replace("low_util", "data_starvation")
    return cls.reindex(win.index).fillna("unknown")


def stragglers(win: pd.DataFrame, levels: pd.DataFrame, df: pd.DataFrame, window_s: float) -> list[dict]:
    """The GPUs their peers waited for (step 7 of the docstring), each with lag share, waiting and cause."""
    known = (win["n"] > 0) & ~win["filled"]
    busy = (1.0 - win["low"]).where(known)
    key = win["host"].astype(str) + ":" + win["gpu"].astype(str)
    matrix = pd.DataFrame({"window": win["window"], "key": key, "busy": busy}).pivot(
        index="window", columns="key", values="busy"
    )
    wait_w = levels["wait_w"].fillna(levels["idle_w"] + 0.5 * (levels["low_max_w"] - levels["idle_w"]))
    wait_w.index = [f"{h}:{g}" for h, g in wait_w.index]
    hosts = sorted(win["host"].astype(str).unique())
    scopes = [("job", list(matrix.columns))]
    if len(hosts) > 1:
        scopes += [("host", [c for c in matrix.columns if c.rsplit(":", 1)[0] == h]) for h in hosts]
    found = {}
    for name, cols in scopes:
        m = matrix[cols]
        working = (m >= BUSY).sum()
        m = m[working[working >= MEMBER_SHARE * max(working.max(), 1)].index]
        if m.shape[1] < 2:
            continue
        active = (m >= BUSY).sum(axis=1)
        used = active[(2 * active >= m.count(axis=1)) & (active > 0)].index
        if not len(used):
            continue
        m = m.loc[used.min() : used.max()]
        cnt, b1, top = m.count(axis=1), m.max(axis=1), m.idxmax(axis=1)
        b2 = m.where(m.rank(axis=1, method="first", ascending=False) == 2).max(axis=1).fillna(-1.0)
        below = m.le(b1 - MARGIN, axis=0).sum(axis=1)
        wait = (cnt >= 2) & (b1 >= MARGIN) & (2 * below >= cnt - 1) & (below >= 1)
        last = wait & (b2 <= b1 - MARGIN)
        gap = m.rsub(b1, axis=0).clip(lower=0).fillna(0.0)
        counts = top[last].value_counts().reindex(m.columns, fill_value=0)
        wait_s = (gap[last].sum(axis=1) * window_s).groupby(top[last]).sum()
        wait_j = (gap[last].mul(wait_w.reindex(m.columns), axis=1).sum(axis=1) * window_s).groupby(top[last]).sum()
        for g, n in counts.items():
            lag = n / max(int(wait.sum()), 1)
            typical = counts.drop(g).median()
            if g not in found and lag > STRAGGLER_SHARE and n >= MIN_LAG_WINDOWS and n >= DOMINANCE * typical:
                found[g] = {
                    "gpu": g,
                    "scope": name,
                    "lag_share": lag,
                    "wait_gpu_hours": wait_s.get(g, 0.0) / 3600,
                    "wait_kwh": wait_j.get(g, 0.0) / 3.6e6,
                    "windows": m.index[last & (top == g)],
                    "peers": [c for c in m.columns if c != g],
                }
    for e in found.values():
        e["cause"] = straggler_cause(e, df, win, levels, window_s)
        del e["windows"], e["peers"]
    return list(found.values())


def straggler_cause(e: dict, df: pd.DataFrame, win: pd.DataFrame, levels: pd.DataFrame, window_s: float) -> str:
    """thermal, power_cap or hw_slowdown from the reasons, clock, temperature and power of its lagging windows
    against its peers' (as stragglers.py orders them), else unknown."""
    if not set(CAUSE_COLUMNS) & set(df.columns):
        return "unknown"
    rows = df[np.floor(df["time"] / window_s).isin(e["windows"])].copy()
    rows["key"] = rows["host"].astype(str) + ":" + rows["gpu"].astype(str)
    mine, theirs = rows[rows["key"] == e["gpu"]], rows[rows["key"].isin(e["peers"])]
    if "clocks_event_reasons" in rows and mine["clocks_event_reasons"].notna().any():
        shares = {}
        for cause, bits in REASON_GROUPS.items():
            have = mine["clocks_event_reasons"].dropna().astype("int64")
            peer = theirs["clocks_event_reasons"].dropna().astype("int64")
            share = ((have & bits) != 0).mean()
            shares[cause] = (share, share - (((peer & bits) != 0).mean() if len(peer) else 0.0))
        best = max(shares, key=lambda c: shares[c][1] if shares[c][0] >= 0.5 else -1.0)
        if shares[best][0] >= 0.5 and shares[best][1] >= 0.3:
            return best
    clock, peer_clock = mine["sm_clock_mhz"].mean(), theirs["sm_clock_mhz"].mean()
    slowed = clock < 0.97 * peer_clock
    if slowed and mine["temp_c"].mean() >= theirs["temp_c"].mean() + 10:
        return "thermal"
    host, gpu = e["gpu"].rsplit(":", 1)
    cap = levels.loc[(host, int(gpu)), "cap_w"]
    peer_caps = levels["cap_w"].drop((host, int(gpu))).median()
    stretch = win[(win["host"] == host) & (win["gpu"] == int(gpu))]
    stretch = stretch[stretch["window"].between(e["windows"].min(), e["windows"].max()) & (stretch["high"] >= 0.95)]
    if stretch["power"].mean() >= 0.95 * cap and cap <= 0.95 * peer_caps:
        return "power_cap"
    if slowed and clock <= 0.6 * peer_clock:
        return "hw_slowdown"
    return "unknown"


def energy_by_gpu(df: pd.DataFrame) -> dict:
    """Trapezoid over each GPU's samples."""
    d = df[["host", "gpu", "time", "power_w"]].sort_values(["host", "gpu", "time"], kind="stable", ignore_index=True)
    d["power_w"] = d["power_w"].astype("float64")
    g = d.groupby(["host", "gpu"])
    piece = g["time"].diff() * (d["power_w"] + g["power_w"].shift()) / 2
    return {(str(h), int(gp)): float(v) for (h, gp), v in piece.groupby([d["host"], d["gpu"]]).sum().items()}


def pandas_triage_and_summary(
    trace_paths,
    table,
    window_s: float = 1.0,
    deadlock_after_s: float = DEADLOCK_AFTER_S,
    power_cap_w: float | None = None,
) -> tuple[pd.DataFrame, dict, dict]:
    """(phases_df, shares_by_phase, energy_by_gpu_j, stragglers): phases_df has per (host, gpu, phase) windows,
    seconds, share of the GPU's time and energy_j; shares_by_phase is each phase's share of all GPU time."""
    df, caps = read_traces(trace_paths)
    win, work, samples_per_gpu = windows(df, window_s)
    levels = learn_levels(win[win["n"] > 0], table, window_s, caps, power_cap_w)
    win = fill_short_gaps(band_shares(win, work, levels), samples_per_gpu, window_s)
    del work
    win["phase"] = label(win, levels, table, window_s, deadlock_after_s)
    win["seconds"] = window_s
    win["energy_j"] = (win["power"] * window_s).fillna(0.0)
    phases = (
        win.groupby(["host", "gpu", "phase"])
        .agg(windows=("seconds", "size"), seconds=("seconds", "sum"), energy_j=("energy_j", "sum"))
        .reset_index()
    )
    phases["share"] = phases["seconds"] / phases.groupby(["host", "gpu"])["seconds"].transform("sum")
    per = phases.groupby("phase")["seconds"].sum()
    shares = (per / per.sum()).to_dict()
    return phases, shares, energy_by_gpu(df), stragglers(win, levels, df, window_s)


# ---------------------------------------------------------------- standalone


def package_shares(trace_paths, gpu_model: str, window_s: float, run_dir=None) -> tuple[dict, float]:
    """Phase time shares from the package's own triage (power only, or with the run's info), and its time."""
    try:
        from wattgate.power.triage import load_run_info, triage
    except ImportError:
        from wattgate.telemetry.triage import load_run_info, triage
    import pyarrow as pa

    from wattgate.trace import read_trace, trace_meta

    start = time.perf_counter()
    tables = [read_trace(Path(p)) for p in trace_paths]
    metas = [trace_meta(t) for t in tables]
    trace = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    info = load_run_info(run_dir, metas) if run_dir else None
    ph = triage(trace, shipped_table(gpu_model), window_s, DEADLOCK_AFTER_S, info).to_pandas()
    elapsed = time.perf_counter() - start
    sec = (ph["end"] - ph["start"]).groupby(ph["phase"]).sum()
    return (sec / sec.sum()).to_dict(), elapsed


def shares_line(shares: dict) -> str:
    return ", ".join(f"{p} {100 * shares.get(p, 0.0):.1f}%" for p in LABELS if shares.get(p, 0.0) > 0)


def smoke_traces(folder: Path) -> tuple[list[Path], Path]:
    """A quarter hour of 2 hosts x 2 B300 GPUs (compute, a checkpoint, a hang) and its run folder."""
    from wattgate.testing.synthetic_trace import TraceSpec, build_trace, gpus_of, job, write_run_info

    segments = [("idle", 30), ("compute", 300), ("checkpoint", 90), ("compute", 300), ("deadlock", 180)]
    synth = build_trace(job(gpus_of(2, 2), segments), shipped_table("b300"), spec=TraceSpec(with_truth=False))
    write_run_info(folder / "run", synth)
    return synth.write(folder / "telemetry"), folder / "run"


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0], smoke="a quarter hour of 2 hosts x 2 GPUs, --compare")
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--gpu-model", default=None)
    parser.add_argument("--table", default=None, help="a triage table YAML instead of a shipped one")
    parser.add_argument("--window-s", type=positive_float, default=1.0)
    parser.add_argument("--repeat", type=positive_int, default=1)
    parser.add_argument("--compare", action="store_true", help="also print the package's phase shares beside ours")
    parser.add_argument("--run-dir", type=Path, default=None, help="with --compare: also triage with run info")
    args = parser.parse_args()
    if args.smoke == bool(args.traces):
        parser.error("give trace files, or --smoke (which makes its own)")
    if args.smoke:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="wattgate-bench-pandas-triage-")
        args.traces, args.run_dir = smoke_traces(Path(tmp.name))
        args.gpu_model, args.compare = "b300", True
    missing = [str(p) for p in args.traces if not p.is_file()]
    if missing:
        parser.error(f"no such trace file: {', '.join(missing)}")
    table = resolve_table(args.table, args.gpu_model, [])
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        phases, shares, energy, _ = pandas_triage_and_summary(args.traces, table, args.window_s)
        times.append(time.perf_counter() - start)
    print(
        f"pandas triage + summary: best {min(times):.2f} s over {len(times)} run(s); "
        f"{int(phases['windows'].sum()):,} windows, {len(energy)} GPUs, "
        f"{sum(energy.values()) / 3.6e6:.3f} kWh (trapezoid)"
    )
    print(f"  pandas shares:  {shares_line(shares)}")
    modes = [("package, power only", None)] + ([("package, run info", args.run_dir)] if args.run_dir else [])
    package_s = None
    for name, run_dir in modes if args.compare else modes[:1]:
        theirs, t = package_shares(args.traces, args.gpu_model or table.gpu_model.lower(), args.window_s, run_dir)
        package_s = t if package_s is None else package_s
        if args.compare:
            diff = max(abs(shares.get(p, 0.0) - theirs.get(p, 0.0)) for p in LABELS)
            print(
                f"  {name + ':':22s}{shares_line(theirs)}  (triage() {t:.2f} s; "
                f"largest share difference {100 * diff:.1f} points)"
            )
    figure(
        "pandas_triage",
        f"the pandas triage + summary of {len(args.traces)} trace file(s), {int(phases['windows'].sum()):,} windows",
        f"best {min(times):.2f} s",
        f"the package's triage() of the same traces, power only, read included {package_s:.2f} s",
    )


if __name__ == "__main__":
    sys.exit(main())

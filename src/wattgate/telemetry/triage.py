"""Power triage: label every GPU's time, window by window, with the training phase its power shows.

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

Rules, in order (each sees the labels the earlier ones left):
1. Band of the median P of the window and the 2 known windows on each side
   (a median keeps steps sharp and drops single-window spikes), with
   hysteresis: a window within a margin of a band edge keeps the band of the
   window before it when that band touches the edge (margins: 10% of
   compute_min_w - low_max_w at compute_min_w, 10% of low_max_w - idle_w at
   low_max_w), so noise around an edge does not flap.
2. Class of a window:
   - >= 15% of its samples high and >= 15% low: data_starvation (kernel
     bursts between host gaps; a 1 s window at 10 Hz sees both);
   - high band: U >= busy_util_pct -> compute, else data_starvation (gaps
     with no kernel between bursts, as a 1 s average reads them);
   - mid band: U >= busy_util_pct -> communication, else data_starvation;
   - low band: U >= busy_util_pct -> a wait (a kernel resident at low
     power: rule 4), U <= idle_util_pct -> idle; in between: idle when P is
     at most idle_w + 30% of (low_max_w - idle_w), U < 25% and no sample is in
     the high band (work too light to draw power: host copies of a
     checkpoint, teardown; compute bursts filling that share of the time
     would lift P above it),
     else low-util (data_starvation unless rule 5 claims it);
   - no utilization in the window: mid -> communication; low -> idle below
     idle_w + 30% of (low_max_w - idle_w), else a wait.
3. Majority filter: a window takes the most common class among itself and
   the 2 known windows on each side on its GPU; a tie keeps its own class.
4. Waits (the power-only wait rule). A contiguous wait *ends* when compute,
   communication or data starvation resumes on that GPU within
   deadlock_after_s after it; one that does not end is deadlock if it lasted
   deadlock_after_s (it never ended, or the job died after it), else
   communication (a trace that stops seconds into a wait proves nothing). A
   wait that ends is checkpoint if it lasted deadlock_after_s (a peer was
   checkpointing). A shorter one is communication (a sync wait: a straggler,
   a slow collective) unless it lasted at least 10 s (CHECKPOINT_MIN_S) and
   its episode (the ended waits of all GPUs of the input that overlap in time,
   3 windows of slack) shows a checkpoint, by either of:
   - the idle rank: a GPU that is not waiting in the episode is idle or
     low-util for at least half of it, in one stretch that follows activity
     (or a wait), is followed by activity (or a wait), and ends within 3
     windows of the episode's end: the writer, whom the others wait for in a
     collective (~100% utilization at near-idle power) until it comes back;
   - periodicity: its own length is within x1.5 (LENGTH_RATIO) of at least 3
     other episodes' (>= 10 s, long ones included), and of the intervals
     between the starts of these consecutive similar episodes at least 3, and
     at least half, are within 20% (PERIOD_TOLERANCE) of their median, one of
     them next to it (a checkpoint every N steps). Three pauses are not a
     series: two random intervals agree that well too often.
   So a wait that never ends stays deadlock however many ranks sit idle in it
   or however regular the pauses before it were; a wait of a few seconds, or
   one with no idle rank that does not recur, stays communication.
5. Peers (every GPU of the input, windows matched by time): a run of idle or
   low-util windows on a GPU that was active before it
   - with activity after it, overlapping peers' checkpoint waits for at least
     half its length -> checkpoint (the rank writing the checkpoint);
   - reaching the GPU's last sample, overlapping peers' deadlock waits for at
     least half its length or deadlock_after_s -> deadlock where it overlaps
     them, a few windows of slack either side (the stuck rank).
6. Run info (heartbeats, metrics; optional), in this order:
   - a power-only deadlock (or, when heartbeat events exist, checkpoint) label
     on one of the run's GPUs, from the run's first progress stamp to
     deadlock_after_s after its last, that is neither in a stall nor in a
     checkpoint interval (both below) goes back to what the window showed: a
     wait -> communication, a quiet window -> idle or data_starvation;
   - with confidence 1: a window >= 50% inside a step's data wait, or inside
     a step that waited for data for >= 50% of its time, with P <
     compute_min_w -> data_starvation;
   - with confidence 1: any other window >= 50% inside steps (metrics step
     end - step_time_s to step end) that power labelled data_starvation,
     low-util or idle, outside a stall -> compute: the loader kept up, so a
     GPU below full power was held back by the step's own host work
     (launches, small kernels), which is what the step costs;
   - with confidence 1: a data_starvation or low-util window >= 50% after the
     GPU's ranks all sent "done" (every rank's, when no rank maps to a GPU),
     P < low_max_w and U < busy_util_pct -> idle (teardown);
   - with confidence 1: a window >= 50% inside a checkpoint interval (a rank's
     "checkpoint" or "export" event to its next event: writing the final
     model is the same I/O pause) with P < compute_min_w -> checkpoint; an
     open interval (no later event) proves nothing and is left to the rest;
   - with confidence 1, in a stall: P < compute_min_w with U >= busy_util_pct
     -> deadlock, and idle or low-util while another of the run's GPUs is so
     waiting in the same window -> deadlock (the stuck rank). A stall is a gap
     of >= deadlock_after_s between progress stamps (metrics step ends,
     heartbeat events and states) after the run started, before any rank
     exported or finished, outside checkpoint intervals; the gap after the
     last stamp counts when the GPU's trace goes on for deadlock_after_s past it.
   Ranks map to GPUs by the heartbeat's GPU UUID (trace meta gpus[].uuid),
   else host + local_rank; the checkpoint intervals of a rank that maps to no
   GPU apply to every GPU; data waits and steps apply only to mapped GPUs.

Without metrics, a step held back by the host (a small model: launch-bound
kernels at mid power and ~50% utilization) and a step starved by its data
loader look alike: both read data_starvation. Only the run's data_wait_s
tells them apart (rule 6). Likewise a checkpoint written by the only GPU of a
job looks idle without heartbeats: no peer waits at low power for it. And rule
4 calls any ended pause of >= 10 s with one rank idle, or any regular series of
them, a checkpoint: a rank held that long by other host work (a stalled data
loader, evaluation on the CPU, a periodic upload) reads the same; a checkpoint
shorter than 10 s, or a single one whose writer's GPU is not in the input,
reads communication. Heartbeat events settle both (rule 6).

Confidence: 0 for unknown, 1 for run-info labels; otherwise the distance of
P from the nearest band edge in units of 2.5 margins (capped at 1), for
labels that also rest on U the lesser of that and U's distance from the
nearest utilization threshold in 5-point units; oscillating windows use the
lesser high/low share / 0.3; a class the majority filter changed is capped
at 0.5.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path, write_bytes_atomic, write_json_atomic
from wattgate.errors import InputError
from wattgate.telemetry.tables import PHASES, TriageTable, resolve_table
from wattgate.telemetry.trace import read_trace, strict_json, trace_meta

FORMAT_VERSION = 1
LABELS = PHASES + ("unknown",)
COMPUTE, COMMUNICATION, DATA_STARVATION, CHECKPOINT, DEADLOCK, IDLE, UNKNOWN = range(7)
WAIT, LOW_UTIL = 7, 8  # internal classes, resolved before output
ACTIVE = (COMPUTE, COMMUNICATION, DATA_STARVATION)

PHASES_SCHEMA = pa.schema([
    ("host", pa.string()),
    ("gpu", pa.int32()),
    ("start", pa.float64()),
    ("end", pa.float64()),
    ("phase", pa.string()),
    ("power_w", pa.float32()),
    ("util_gpu", pa.float32()),
    ("confidence", pa.float32()),
])

EDGE_MARGIN = 0.10       # hysteresis margin, share of the band next to the edge
OSCILLATION_SHARE = 0.15  # share of samples high and low that marks kernel bursts between gaps
NO_UTIL_IDLE_SHARE = 0.30  # without utilization: low-band power this far above idle is a wait
LIGHT_UTIL_PCT = 25.0    # below this, utilization at idle power is light work, not a starved step
SMOOTH_RADIUS = 2        # majority filter and power median: windows on each side
SPARSE_SAMPLES = 2.5     # samples per window at or below which single empty windows are grid jitter
PEER_SLACK = 3           # windows of slack around peers' waits when matching the stuck rank
COVER_SHARE = 0.5        # share of a window inside a heartbeat interval that makes it count
CHECKPOINT_MIN_S = 10.0  # a shorter pause is a sync wait, whatever its peers do
PERIODIC_MIN = 4         # pauses in a series before it counts as periodic (3 match by chance too often)
PERIOD_TOLERANCE = 0.2   # start-to-start interval within this share of the series' median
LENGTH_RATIO = 1.5       # pauses of "similar length" are within this factor of each other
_COUNT_SHIFT = float(1 << 26)  # packs high- and low-band sample counts into one bincount pass


# ---------------------------------------------------------------- run info


@dataclass
class RunInfo:
    """What the training run recorded: heartbeat events and states, metrics, and where ranks ran."""

    events: pd.DataFrame                      # time, rank, step, epoch, phase (sorted by rank, time)
    states: dict[int, dict]                   # rank -> latest heartbeat
    metrics: pd.DataFrame | None = None       # rows per (step, rank)
    gpu_uuids: dict[str, tuple[str, int]] = field(default_factory=dict)  # NVML UUID -> (host, index)
    source: str = ""

    @property
    def has_heartbeats(self) -> bool:
        return bool(len(self.events) or self.states)

    @property
    def has_metrics(self) -> bool:
        return self.metrics is not None and len(self.metrics) > 0


EVENT_COLUMNS = ["time", "rank", "step", "epoch", "phase"]


def load_run_info(run_dir: str | os.PathLike, trace_metas: list[dict] | None = None) -> RunInfo:
    """Heartbeat events/states and metrics.parquet of a run folder; every file is optional."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run folder")
    events, states = [], {}
    beat_dir = run_dir / "heartbeat"
    for path in sorted(beat_dir.glob("rank-*.events.jsonl")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                events.append((float(e["time"]), int(e["rank"]), int(e.get("step", 0)), int(e.get("epoch", 0)),
                               str(e["phase"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise InputError(f"{path}:{lineno}: not a heartbeat event ({exc})") from None
    for path in sorted(beat_dir.glob("rank-*.json")):
        try:
            s = json.loads(path.read_text())
            states[int(s["rank"])] = s
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{path}: not a heartbeat ({exc})") from None
    metrics = None
    mpath = run_dir / "metrics.parquet"
    if mpath.exists():
        try:
            metrics = pq.read_table(mpath, columns=["step", "rank", "time", "step_time_s", "data_wait_s"]).to_pandas()
        except (OSError, pa.ArrowInvalid, KeyError) as exc:
            raise InputError(f"{mpath}: not a readable metrics table ({exc})") from None
    ev = pd.DataFrame(events, columns=EVENT_COLUMNS).sort_values(["rank", "time"], kind="stable", ignore_index=True)
    uuids = {}
    for meta in trace_metas or []:
        for g in meta.get("gpus", []):
            if g.get("uuid") and meta.get("host") is not None:
                uuids[str(g["uuid"])] = (str(meta["host"]), int(g["index"]))
    return RunInfo(ev, states, metrics, uuids, str(run_dir))


def _short(host: str) -> str:
    return host.split(".")[0]


def map_ranks(info: RunInfo, gpu_keys: list[tuple[str, int]]) -> dict[int, int]:
    """rank -> index into gpu_keys: the heartbeat's GPU UUID if the traces list it, else host + local_rank."""
    index = {k: i for i, k in enumerate(gpu_keys)}
    by_short = {(_short(h), g): i for (h, g), i in index.items()}
    out = {}
    for rank, s in sorted(info.states.items()):
        gpu = s.get("gpu")
        if isinstance(gpu, str) and gpu in info.gpu_uuids and info.gpu_uuids[gpu] in index:
            out[rank] = index[info.gpu_uuids[gpu]]
            continue
        host, local = s.get("host"), s.get("local_rank")
        if host is None or local is None:
            continue
        key = (str(host), int(local))
        if key in index:
            out[rank] = index[key]
        elif (_short(str(host)), int(local)) in by_short:
            out[rank] = by_short[(_short(str(host)), int(local))]
    return out


def _merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    return s[new], np.maximum.reduceat(e, np.flatnonzero(new))


def _covered_share(starts: np.ndarray, ends: np.ndarray, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """Share of each window [w0, w1) that the (unmerged) intervals cover."""
    s, e = _merge_intervals(np.asarray(starts, float), np.asarray(ends, float))
    if len(s) == 0:
        return np.zeros(len(w0))
    lens = e - s
    cum = np.concatenate([[0.0], np.cumsum(lens)])

    def covered_before(t):  # total interval length before time t
        k = np.searchsorted(s, t, side="right")
        last = np.maximum(k - 1, 0)
        part = np.clip(t - s[last], 0.0, lens[last])
        return np.where(k > 0, cum[last] + part, 0.0)

    return (covered_before(w1) - covered_before(w0)) / (w1 - w0)


def _checkpoint_intervals(events: pd.DataFrame) -> pd.DataFrame:
    """Closed checkpoint intervals per rank: a "checkpoint" or "export" event to the rank's next event."""
    if events.empty:
        return pd.DataFrame({"rank": [], "start": [], "end": []})
    ev = events.sort_values(["rank", "time"], kind="stable")
    nxt_time = ev.groupby("rank")["time"].shift(-1)
    ck = ev["phase"].isin(["checkpoint", "export"]) & nxt_time.notna()
    return pd.DataFrame({"rank": ev["rank"][ck].to_numpy(), "start": ev["time"][ck].to_numpy(),
                         "end": nxt_time[ck].to_numpy()})


def _done_times(info: RunInfo) -> dict[int, float]:
    """rank -> when it said done (inf if it never did), from events, else its heartbeat state."""
    out = {int(r): math.inf for r in set(info.events["rank"]) | set(info.states)}
    ev = info.events[info.events["phase"] == "done"]
    for r, t in ev.groupby("rank")["time"].min().items():
        out[int(r)] = float(t)
    for r, st in info.states.items():
        if st.get("phase") == "done" and "time" in st and not math.isfinite(out[r]):
            out[r] = float(st["time"])
    return out


def _progress(info: RunInfo) -> tuple[np.ndarray, float]:
    """(sorted progress stamps, when the run was over): the gaps between stamps are candidate stalls."""
    stamps = [info.events["time"].to_numpy(float),
              np.array([float(s["time"]) for s in info.states.values() if "time" in s])]
    if info.has_metrics:
        stamps.append(info.metrics["time"].to_numpy(float))
    stamps = np.unique(np.concatenate(stamps))
    over = [info.events["time"][info.events["phase"].isin(["export", "done"])].to_numpy(float)]
    over.append(np.array([float(s["time"]) for s in info.states.values() if s.get("phase") in ("export", "done")]))
    over = np.concatenate(over)
    return stamps, float(over.min()) if len(over) else math.inf


# ---------------------------------------------------------------- trace columns


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


# ---------------------------------------------------------------- rules on known windows


def _bounds(gpu: np.ndarray, ngpu: int) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) positions of each GPU's windows in a GPU-sorted array."""
    ids = np.arange(ngpu)
    return np.searchsorted(gpu, ids, "left"), np.searchsorted(gpu, ids, "right")


def _rolling_median(x: np.ndarray, gpu: np.ndarray, ngpu: int, radius: int) -> np.ndarray:
    """Median of each window and `radius` known windows on each side on the same GPU."""
    if len(x) == 0 or radius <= 0:
        return x
    gs, ge = _bounds(gpu, ngpu)
    pos = np.arange(len(x))
    lo, hi = gs[gpu], ge[gpu] - 1
    # near a GPU's ends, mirror inside its range so the window stays centred and odd-sized
    cols = []
    for off in range(-radius, radius + 1):
        j = pos + off
        j = np.where(j < lo, 2 * lo - j, j)
        j = np.where(j > hi, 2 * hi - j, j)
        cols.append(x[np.clip(j, lo, hi)])
    return np.partition(np.stack(cols, axis=1), radius, axis=1)[:, radius]


def _band(p: np.ndarray, gpu: np.ndarray, table: TriageTable) -> np.ndarray:
    """0 low, 1 mid, 2 high, with hysteresis at both edges (rule 1), of the window power median."""
    lo, hi = table.low_max_w, table.compute_min_w
    m_lo, m_hi = EDGE_MARGIN * (lo - table.idle_w), EDGE_MARGIN * (hi - lo)
    raw = (p >= lo).astype(np.int8) + (p >= hi)
    definite = (p < lo - m_lo) | ((p >= lo + m_lo) & (p < hi - m_hi)) | (p >= hi + m_hi)
    definite[np.flatnonzero(np.diff(gpu)) + 1] = True  # hysteresis never crosses GPUs
    if len(definite):
        definite[0] = True
    lower = np.where(p < (lo + hi) / 2, 0, 1).astype(np.int8)  # the bands touching the nearer edge
    positions = np.arange(len(p))
    for _ in range(64):
        last = np.maximum.accumulate(np.where(definite, positions, 0))
        prev = raw[last]
        fits = (prev == lower) | (prev == lower + 1)
        jump = ~definite & ~fits  # arrived from a band away from this edge: it takes its raw band
        if not jump.any():
            return np.where(definite, raw, prev)
        # only the first such window after each definite one is certain; the ones after it carry its band
        at = np.flatnonzero(jump)
        _, first = np.unique(last[at], return_index=True)
        definite[at[first]] = True
    return raw  # pathological alternation between edges: no hysteresis


def _classify(p, u, high, low, band, table: TriageTable) -> tuple[np.ndarray, np.ndarray]:
    """(class, oscillating) per window (rule 2)."""
    busy, idle = u >= table.busy_util_pct, u <= table.idle_util_pct
    no_util = np.isnan(u)
    cls = np.full(len(p), LOW_UTIL, np.int8)
    cls[(band == 2) & (busy | no_util)] = COMPUTE
    cls[(band == 2) & ~busy & ~no_util] = DATA_STARVATION
    cls[(band == 1) & (busy | no_util)] = COMMUNICATION
    cls[(band == 1) & ~busy & ~no_util] = DATA_STARVATION
    low_band = band == 0
    cls[low_band & busy] = WAIT
    cls[low_band & idle] = IDLE
    quiet = table.idle_w + NO_UTIL_IDLE_SHARE * (table.low_max_w - table.idle_w)
    # a little utilization at idle power with no sample in the high band is work too light to draw
    # power (host copies, teardown): compute bursts filling that share of the time would lift P above `quiet`
    light = low_band & ~busy & ~idle & (u < LIGHT_UTIL_PCT) & (p <= quiet) & (high == 0)
    cls[light] = IDLE
    cls[low_band & no_util] = np.where(p[low_band & no_util] <= quiet, IDLE, WAIT)
    osc = (high >= OSCILLATION_SHARE) & (low >= OSCILLATION_SHARE)
    cls[osc] = DATA_STARVATION
    return cls, osc


def _majority(cls: np.ndarray, gpu: np.ndarray, ngpu: int, radius: int) -> np.ndarray:
    """Most common class within `radius` windows on each side on the same GPU; ties keep the window's own."""
    if len(cls) == 0 or radius <= 0:
        return cls
    values = np.unique(cls)
    compact = np.searchsorted(values, cls)
    onehot = np.zeros((len(cls) + 1, len(values)), np.int32)
    onehot[np.arange(1, len(cls) + 1), compact] = 1
    cum = np.cumsum(onehot, axis=0)
    gs, ge = _bounds(gpu, ngpu)
    pos = np.arange(len(cls))
    a = np.maximum(pos - radius, gs[gpu])
    b = np.minimum(pos + radius + 1, ge[gpu])
    counts = cum[b] - cum[a]
    best = counts.max(axis=1)
    own = counts[pos, compact]
    return np.where(own == best, cls, values[np.argmax(counts, axis=1)]).astype(cls.dtype)


def _runs(mask_or_cls: np.ndarray, gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of the runs of equal values on each GPU."""
    n = len(gpu)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.ones(n, dtype=bool)
    change[1:] = (mask_or_cls[1:] != mask_or_cls[:-1]) | (gpu[1:] != gpu[:-1])
    starts = np.flatnonzero(change)
    return starts, np.append(starts[1:], n)


def _next_true(mask: np.ndarray) -> np.ndarray:
    """Position of the first True at or after each position (len(mask) if none)."""
    n = len(mask)
    idx = np.where(mask, np.arange(n), n)
    return np.minimum.accumulate(idx[::-1])[::-1]


def _wait_runs(cls, index, gpu, window_s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end (exclusive) and length in seconds of every contiguous run of WAIT windows."""
    starts, ends = _runs(cls, gpu)
    waits = cls[starts] == WAIT
    s, e = starts[waits], ends[waits]
    return s, e, (index[e - 1] + 1 - index[s]) * window_s if len(s) else np.zeros(0)


def _resolve_waits(cls, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 4: a wait becomes communication, checkpoint or deadlock by its length and what follows."""
    out = cls.copy()
    s, e, length = _wait_runs(cls, index, gpu, window_s)
    if len(s) == 0:
        return out
    _, ge = _bounds(gpu, ngpu)
    nxt = _next_true(np.isin(cls, ACTIVE))
    resume = np.minimum(nxt[np.minimum(e, len(cls) - 1)], len(cls) - 1)
    resumes = (e < len(cls)) & (nxt[np.minimum(e, len(cls) - 1)] < ge[gpu[s]])
    gap = (index[resume] - index[e - 1] - 1) * window_s
    label = np.where(length < deadlock_after_s, COMMUNICATION,
                     np.where(resumes & (gap < deadlock_after_s), CHECKPOINT, DEADLOCK)).astype(cls.dtype)
    out[_ranges(s, e)] = np.repeat(label, e - s)
    return out


def _short_checkpoints(cls, smooth, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 4, second half: a pause shorter than deadlock_after_s that shows a checkpoint (an idle
    writer, or a periodic series) becomes checkpoint instead of communication."""
    out = cls.copy()
    s, e, length = _wait_runs(smooth, index, gpu, window_s)
    if len(s) == 0:
        return out
    n = len(smooth)
    gs, ge = _bounds(gpu, ngpu)
    # "ended" exactly as rule 4 measures it, so long pauses (already checkpoint) join the series
    nxt = _next_true(np.isin(smooth, ACTIVE))
    after = nxt[np.minimum(e, n - 1)]
    resumes = (e < n) & (after < ge[gpu[s]])
    gap = (index[np.minimum(after, n - 1)] - index[e - 1] - 1) * window_s
    member = (length >= CHECKPOINT_MIN_S) & resumes & (gap < deadlock_after_s)
    if not member.any():
        return out
    s, e = s[member], e[member]
    a, b, g = index[s], index[e - 1] + 1, gpu[s]

    # episodes: the pauses of every GPU that overlap in time (peers enter and leave a collective a
    # window or two apart)
    order = np.argsort(a, kind="stable")
    a, b, g, s, e = a[order], b[order], g[order], s[order], e[order]
    reach = np.maximum.accumulate(b)
    new = np.ones(len(a), dtype=bool)
    new[1:] = a[1:] > reach[:-1] + PEER_SLACK
    ep = np.cumsum(new) - 1
    ep_a = np.minimum.reduceat(a, np.flatnonzero(new))
    ep_b = np.maximum.reduceat(b, np.flatnonzero(new))
    nep = len(ep_a)

    # the idle rank: a quiet stretch (idle or low-util) between activity on a GPU that is not pausing,
    # ending with the episode (the others block until the writer comes back)
    quiet = np.isin(smooth, (IDLE, LOW_UTIL))
    qs, qe = _runs(quiet, gpu)
    keep = quiet[qs]
    qs, qe = qs[keep], qe[keep]
    busy_or_wait = np.isin(smooth, ACTIVE + (WAIT,))
    before = (qs > gs[gpu[qs]]) & busy_or_wait[np.maximum(qs - 1, 0)]
    after_ok = (qe < ge[gpu[qs]]) & busy_or_wait[np.minimum(qe, n - 1)]
    keep = before & after_ok & ((index[qe - 1] + 1 - index[qs]) * window_s >= 0.5 * CHECKPOINT_MIN_S)
    qa, qb, qg = index[qs[keep]], index[qe[keep] - 1] + 1, gpu[qs[keep]]
    writer = np.zeros(nep, dtype=bool)
    for k in range(nep if len(qa) else 0):
        overlap = np.minimum(qb, ep_b[k]) - np.maximum(qa, ep_a[k])
        pausing = np.isin(qg, g[ep == k])
        writer[k] = bool((~pausing & (overlap >= 0.5 * (ep_b[k] - ep_a[k]))
                          & (np.abs(qb - ep_b[k]) <= PEER_SLACK)).any())

    # periodicity: pauses of similar length at a regular interval (a checkpoint every N steps)
    periodic = np.zeros(nep, dtype=bool)
    ep_len = (ep_b - ep_a).astype(np.float64)
    for k in range(nep):
        similar = np.flatnonzero((ep_len <= LENGTH_RATIO * ep_len[k]) & (ep_len * LENGTH_RATIO >= ep_len[k]))
        if len(similar) < PERIODIC_MIN:
            continue
        intervals = np.diff(ep_a[similar]).astype(np.float64)
        regular = np.abs(intervals - np.median(intervals)) <= PERIOD_TOLERANCE * np.median(intervals)
        at = int(np.searchsorted(similar, k))
        own = (at > 0 and regular[at - 1]) or (at < len(intervals) and regular[at])
        # most intervals regular: random stragglers' waits put ~15% of theirs within 20% of the median
        periodic[k] = bool(own) and regular.sum() >= max(PERIODIC_MIN - 1, 0.5 * len(intervals))

    hit = (writer | periodic)[ep]
    if hit.any():
        pos = _ranges(s[hit], e[hit])
        out[pos[out[pos] == COMMUNICATION]] = CHECKPOINT
    return out


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], ends[i])."""
    lens = ends - starts
    if lens.sum() == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(lens.sum()) + offsets


def _near(index: np.ndarray, mask: np.ndarray, slack: int = 0) -> np.ndarray:
    """Per window: does any window of `mask` (any GPU) lie within `slack` windows of its time?"""
    marked = np.unique(index[mask])
    if len(marked) == 0:
        return np.zeros(len(index), dtype=bool)
    j = np.searchsorted(marked, index - slack)
    return (j < len(marked)) & (marked[np.minimum(j, len(marked) - 1)] <= index + slack)


def _peer_rules(cls, from_wait, index, gpu, ngpu, window_s, deadlock_after_s) -> np.ndarray:
    """Rule 5: the checkpoint writer and the stuck rank, from what their peers do at the same time."""
    out = cls.copy()
    if len(cls) == 0:
        return out
    ck = _near(index, (cls == CHECKPOINT) & from_wait)
    dl_tight = _near(index, (cls == DEADLOCK) & from_wait)
    dl = _near(index, (cls == DEADLOCK) & from_wait, PEER_SLACK)
    if not (ck.any() or dl.any()):
        return out
    quiet = np.isin(cls, (IDLE, LOW_UTIL))
    starts, ends = _runs(quiet, gpu)
    keep = quiet[starts]
    s, e = starts[keep], ends[keep]
    gs, ge = _bounds(gpu, ngpu)
    active_pos = np.flatnonzero(np.isin(cls, ACTIVE))
    k = np.searchsorted(active_pos, gs[gpu[s]])
    first_active = np.where(k < len(active_pos), active_pos[np.minimum(k, len(active_pos) - 1)], len(cls))
    was_active = first_active < s
    length = e - s
    ck_c, dl_c = (np.concatenate([[0], np.cumsum(m)]) for m in (ck, dl_tight))
    ck_overlap, dl_overlap = ck_c[e] - ck_c[s], dl_c[e] - dl_c[s]
    last = e == ge[gpu[s]]
    writer = was_active & ~last & (ck_overlap >= 0.5 * length)
    stuck = was_active & last & ((dl_overlap >= 0.5 * length) | (dl_overlap * window_s >= deadlock_after_s))
    if writer.any():
        out[_ranges(s[writer], e[writer])] = CHECKPOINT
    if stuck.any():
        pos = _ranges(s[stuck], e[stuck])
        out[pos[dl[pos]]] = DEADLOCK
    return out


def _run_info_rules(cls, conf, smooth, p, u, index, gpu, keys, info: RunInfo, table, window_s, deadlock_after_s):
    """Rule 6: heartbeat- and metrics-backed labels, in place."""
    rank_gpu = map_ranks(info, keys)
    ngpu = len(keys)
    gs, ge = _bounds(gpu, ngpu)
    w0, w1 = index * window_s, (index + 1) * window_s
    below = p < table.compute_min_w
    busy = u >= table.busy_util_pct
    run_gpus = np.zeros(ngpu, dtype=bool)
    run_gpus[list(set(rank_gpu.values()))] = True
    if not run_gpus.any():  # no rank maps to a GPU: run-wide facts apply to all of them
        run_gpus[:] = True
    in_run = run_gpus[gpu]

    intervals = _checkpoint_intervals(info.events)
    done = _done_times(info)
    in_ckpt = np.zeros(len(cls), dtype=bool)
    starving = np.zeros(len(cls), dtype=bool)
    stepping = np.zeros(len(cls), dtype=bool)
    finished = np.zeros(len(cls), dtype=bool)
    for g in range(ngpu):
        sl = slice(gs[g], ge[g])
        ranks = [r for r, gg in rank_gpu.items() if gg == g]
        if info.has_metrics and ranks:
            m = info.metrics[info.metrics["rank"].isin(ranks)]
            step_s, wait_s = m["step_time_s"].to_numpy(float), m["data_wait_s"].to_numpy(float)
            begin = m["time"].to_numpy(float) - step_s
            # a data wait, or all of a step that waited for data most of its time
            starved = wait_s >= COVER_SHARE * step_s
            share = _covered_share(np.concatenate([begin, begin[starved]]),
                                   np.concatenate([begin + wait_s, begin[starved] + step_s[starved]]), w0[sl], w1[sl])
            starving[sl] = share >= COVER_SHARE
            fed = ~starved
            stepping[sl] = _covered_share(begin[fed], begin[fed] + step_s[fed], w0[sl], w1[sl]) >= COVER_SHARE
        mine = intervals[intervals["rank"].isin(ranks) | ~intervals["rank"].isin(list(rank_gpu))]
        share = _covered_share(mine["start"].to_numpy(float), mine["end"].to_numpy(float), w0[sl], w1[sl])
        in_ckpt[sl] = share >= COVER_SHARE
        # a GPU is done when all its ranks are; with no rank placed anywhere, when every rank is
        owners = ranks or ([] if rank_gpu else list(done))
        if owners:
            end = max(done[r] for r in owners)
            finished[sl] = w0[sl] + COVER_SHARE * window_s >= end
    stepping &= ~starving

    stamps, run_over = _progress(info)
    stalled = np.zeros(len(cls), dtype=bool)
    during = np.zeros(len(cls), dtype=bool)
    if len(stamps):
        k = np.searchsorted(stamps, w0, side="right")  # stamps[k-1] <= window start; k == 0: before the run
        after_start = k > 0
        during = in_run & after_start & (w0 < stamps[-1] + deadlock_after_s)
        prev = stamps[np.maximum(k - 1, 0)]
        k_next = np.searchsorted(stamps, w1, side="left")
        nxt = np.where(k_next < len(stamps), stamps[np.minimum(k_next, len(stamps) - 1)], np.inf)
        trailing_ok = np.isfinite(nxt) | (w1[ge[gpu] - 1] - stamps[-1] >= deadlock_after_s)
        stalled = (after_start & (w0 < run_over) & (nxt - prev >= deadlock_after_s) & trailing_ok & ~in_ckpt
                   & in_run)

    # power-only hang and checkpoint labels that the run's own record contradicts go back to what
    # the window showed: a wait that was no hang is a (long) sync wait, a quiet window is idle or low-util
    wrong = during & (cls == DEADLOCK) & ~stalled
    if len(info.events):
        wrong |= during & (cls == CHECKPOINT) & ~in_ckpt & ~stalled
    cls[wrong] = np.where(smooth[wrong] == WAIT, COMMUNICATION, smooth[wrong])

    hit = starving & below
    cls[hit], conf[hit] = DATA_STARVATION, 1.0
    # the step's own work: a step that did not wait for data but left the GPU low or quiet was held
    # back by the host (launches, small kernels), not by the loader. A stall keeps the power labels
    # so the hang rules below still see an idle stuck rank.
    hit = stepping & ~stalled & np.isin(cls, (DATA_STARVATION, LOW_UTIL, IDLE))
    cls[hit], conf[hit] = COMPUTE, 1.0
    # after the run said done the GPU is being released: quiet windows are idle, not starved
    hit = finished & (p < table.low_max_w) & ~busy & np.isin(cls, (DATA_STARVATION, LOW_UTIL))
    cls[hit], conf[hit] = IDLE, 1.0
    hit = in_ckpt & below
    cls[hit], conf[hit] = CHECKPOINT, 1.0
    waiting = stalled & below & busy
    stuck = stalled & np.isin(cls, (IDLE, LOW_UTIL, DATA_STARVATION)) & below & ~busy & _near(index, waiting)
    hit = waiting | stuck
    cls[hit], conf[hit] = DEADLOCK, 1.0


def _confidence(p, u, high, low, osc, raw, smooth, final, table: TriageTable) -> np.ndarray:
    lo, hi = table.low_max_w, table.compute_min_w
    m_lo, m_hi = EDGE_MARGIN * (lo - table.idle_w), EDGE_MARGIN * (hi - lo)
    conf_p = np.minimum(np.abs(p - lo) / (2.5 * m_lo), np.abs(p - hi) / (2.5 * m_hi))
    du = np.minimum(np.abs(u - table.busy_util_pct), np.abs(u - table.idle_util_pct)) / 5.0
    conf_u = np.where(np.isnan(u), 1.0, du)
    conf = np.where(final == COMPUTE, conf_p, np.minimum(conf_p, conf_u))
    conf = np.where(osc, np.minimum(high, low) / 0.3, conf)  # bursts are judged by shares, not by the means
    conf = np.where(raw != smooth, np.minimum(conf, 0.5), conf)
    return np.clip(conf, 0.0, 1.0).astype(np.float32)


# ---------------------------------------------------------------- triage


def triage(trace, table: TriageTable, window_s: float = 1.0, deadlock_after_s: float = 60.0,
           run_info: RunInfo | None = None) -> pa.Table:
    """Label every window of every GPU in `trace` (a pa.Table, DataFrame or dict of columns)."""
    if not window_s > 0:
        raise InputError(f"window_s must be > 0 (got {window_s})")
    if not deadlock_after_s > 0:
        raise InputError(f"deadlock_after_s must be > 0 (got {deadlock_after_s})")
    s = _samples(trace)
    if len(s.time) == 0:
        return PHASES_SCHEMA.empty_table()
    win = _windows(s, table, window_s)
    del s
    ngpu = len(win.keys)
    known = win.n > 0
    kpos = np.flatnonzero(known)
    gpu, index = win.gpu_id[kpos], win.index[kpos]
    p, u, high, low = win.power[kpos], win.util[kpos], win.high[kpos], win.low[kpos]

    band = _band(_rolling_median(p, gpu, ngpu, SMOOTH_RADIUS), gpu, table)
    raw, osc = _classify(p, u, high, low, band, table)
    smooth = _majority(raw, gpu, ngpu, SMOOTH_RADIUS)
    from_wait = smooth == WAIT
    cls = _resolve_waits(smooth, index, gpu, ngpu, window_s, deadlock_after_s)
    cls = _short_checkpoints(cls, smooth, index, gpu, ngpu, window_s, deadlock_after_s)
    cls = _peer_rules(cls, from_wait, index, gpu, ngpu, window_s, deadlock_after_s)

    conf = _confidence(p, u, high, low, osc, raw, smooth, cls, table)
    if run_info is not None:
        _run_info_rules(cls, conf, smooth, p, u, index, gpu, win.keys, run_info, table, window_s, deadlock_after_s)
    cls[cls == LOW_UTIL] = DATA_STARVATION

    labels = np.full(len(win.n), UNKNOWN, np.int8)
    labels[kpos] = cls
    confidence = np.zeros(len(win.n), np.float32)
    confidence[kpos] = conf
    return _phases_table(win, labels, confidence, window_s)


def _phases_table(win: _Windows, labels: np.ndarray, confidence: np.ndarray, window_s: float) -> pa.Table:
    hosts = sorted({h for h, _ in win.keys})
    host_of_gpu = np.array([hosts.index(h) for h, _ in win.keys], np.int32)
    gpu_of_gpu = np.array([g for _, g in win.keys], np.int32)
    start = win.index * window_s
    known = win.n > 0
    return pa.Table.from_arrays([
        pa.DictionaryArray.from_arrays(pa.array(host_of_gpu[win.gpu_id]), pa.array(hosts, pa.string()))
        .cast(pa.string()),
        pa.array(gpu_of_gpu[win.gpu_id], pa.int32()),
        pa.array(start, pa.float64()),
        pa.array((win.index + 1) * window_s, pa.float64()),
        pa.DictionaryArray.from_arrays(pa.array(labels.astype(np.int32)), pa.array(list(LABELS))).cast(pa.string()),
        pa.array(win.power.astype(np.float32), pa.float32(), mask=~known),
        pa.array(win.util.astype(np.float32), pa.float32(), mask=~known | np.isnan(win.util)),
        pa.array(confidence, pa.float32()),
    ], schema=PHASES_SCHEMA)


# ---------------------------------------------------------------- summary and the stage


def phase_summary(phases: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """Per (host, gpu, phase): windows, seconds, share of that GPU's time, energy_j (mean power x duration)."""
    df = phases.to_pandas() if isinstance(phases, pa.Table) else phases
    columns = ["host", "gpu", "phase", "windows", "seconds", "share", "energy_j"]
    if len(df) == 0:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(
            columns, ["object", "int32", "object", "int64", "float64", "float64", "float64"])})
    seconds = df["end"] - df["start"]
    work = pd.DataFrame({"host": df["host"], "gpu": df["gpu"], "phase": df["phase"], "seconds": seconds,
                         "energy_j": (df["power_w"].astype("float64") * seconds).fillna(0.0)})
    out = work.groupby(["host", "gpu", "phase"], sort=True).agg(
        windows=("seconds", "size"), seconds=("seconds", "sum"), energy_j=("energy_j", "sum")).reset_index()
    per_gpu = out.groupby(["host", "gpu"])["seconds"].transform("sum")
    out["share"] = out["seconds"] / per_gpu
    return out[columns]


def _totals(summary: pd.DataFrame) -> dict:
    if summary.empty:
        return {}
    t = summary.groupby("phase").agg(windows=("windows", "sum"), seconds=("seconds", "sum"),
                                     energy_j=("energy_j", "sum"))
    total = float(t["seconds"].sum())
    return {ph: {"windows": int(r.windows), "seconds": round(float(r.seconds), 6),
                 "share": round(float(r.seconds) / total, 6) if total else 0.0,
                 "energy_j": round(float(r.energy_j), 3)} for ph, r in t.iterrows()}


def _markdown(result: dict, summary: pd.DataFrame) -> str:
    lines = ["# Power triage", ""]
    if result["status"] != "ok":
        return "\n".join(lines + [f"{result['status']}.", ""])
    t = result["table"]
    kind = t.get("provenance", {}).get("kind", "no provenance")
    lines += [f"Table: {t['gpu_model']} ({result['table_source']}; {kind}), "
              f"windows of {result['window_s']:g} s, deadlock after {result['deadlock_after_s']:g} s. "
              f"Signals: {', '.join(k for k, v in result['signals'].items() if v) or 'none'}.", "",
              "| phase | seconds | share | energy (kJ) |", "|---|---:|---:|---:|"]
    for ph in LABELS:
        r = result["phases"].get(ph)
        if r:
            lines.append(f"| {ph} | {r['seconds']:.0f} | {100 * r['share']:.1f}% | {r['energy_j'] / 1e3:.1f} |")
    lines += ["", "Share of each GPU's time:", "",
              "| host | gpu | " + " | ".join(LABELS) + " |", "|---|---:|" + "---:|" * len(LABELS)]
    pivot = summary.pivot_table(index=["host", "gpu"], columns="phase", values="share", fill_value=0.0)
    for (host, gpu), row in pivot.iterrows():
        lines.append(f"| {host} | {gpu} | " + " | ".join(f"{100 * row.get(ph, 0.0):.1f}%" for ph in LABELS) + " |")
    po = result.get("power_only")
    if po:
        lines += ["", f"## Power-only verdict ({po['mode']})", ""] + [f"- {v}" for v in po["verdict"]]
        lines += ["", "Missing: " + "; ".join(po["missing"]) + "." if po["missing"] else "Missing: nothing.", "",
                  "Could therefore not tell apart:", ""] + [f"- {c}" for c in po["cannot_tell"]]
        lines += ["", po["wait_rule"]]
    return "\n".join(lines) + "\n"


def _read_traces(paths: list) -> tuple[pa.Table, list[dict]]:
    tables, metas = [], []
    for path in paths:
        t = read_trace(path)
        metas.append(trace_meta(t))
        tables.append(t.replace_schema_metadata(None))
    if not tables:
        raise InputError("no trace files given")
    return pa.concat_tables(tables), metas


def run_triage(trace_paths, out_dir, table_path: str | None = None, gpu_model: str | None = None,
               run_dir: str | None = None, window_s: float = 1.0, deadlock_after_s: float = 60.0) -> dict:
    """`wattgate triage`: traces (one per host) -> phases.parquet, phase_summary.csv, triage.json, triage.md."""
    paths = [Path(p) for p in ([trace_paths] if isinstance(trace_paths, (str, os.PathLike)) else trace_paths)]
    out_dir = Path(out_dir)
    trace, metas = _read_traces(paths)
    names = sorted({str(g.get("name", "")) for m in metas for g in m.get("gpus", []) if g.get("name")})
    empty = trace.num_rows == 0
    if empty and not (table_path or gpu_model):
        table, source = None, None
    else:
        table = resolve_table(table_path, gpu_model, names)
        source = (f"--table {table_path}" if table_path else f"--gpu-model {gpu_model}" if gpu_model
                  else f"detected from device names: {', '.join(names)}")
    info = load_run_info(run_dir, metas) if run_dir else None
    phases = PHASES_SCHEMA.empty_table() if empty else triage(trace, table, window_s, deadlock_after_s, info)
    summary = phase_summary(phases)
    def present(column: str) -> bool:
        return trace.column(column).null_count < trace.num_rows

    result = {
        "format_version": FORMAT_VERSION,
        "status": "no GPU telemetry" if empty else "ok",
        "traces": sorted(str(p) for p in paths),
        "hosts": sorted(pc.unique(phases.column("host")).to_pylist()),
        "gpus": 0 if empty else len(summary[["host", "gpu"]].drop_duplicates()),
        "table": _table_dict(table),
        "table_source": source,
        "window_s": window_s,
        "deadlock_after_s": deadlock_after_s,
        "run_dir": str(run_dir) if run_dir else None,
        "signals": {"power": present("power_w"), "util": present("util_gpu"),
                    "heartbeats": bool(info and info.has_heartbeats), "metrics": bool(info and info.has_metrics)},
        "phases": _totals(summary),
    }
    # without heartbeats the pauses rest on power alone (rule 4): say what was missing and how they were read
    from wattgate.telemetry import power_only

    found = power_only.pauses(phases)
    t0 = float(pc.min(phases.column("start")).as_py()) if phases.num_rows else None
    result["pauses"] = [p.record(t0) for p in found]
    result["power_only"] = None
    if not result["signals"]["heartbeats"] and not empty:
        inferred = any(m.get("gpu_index_inferred") for m in metas)
        result["power_only"] = power_only.limits(result["signals"], deadlock_after_s, inferred) | {
            "verdict": power_only.verdict(found, t0, window_s)}
    if info is not None and not empty:
        keys = [(h, int(g)) for h, g in summary[["host", "gpu"]].drop_duplicates().itertuples(index=False)]
        mapped = map_ranks(info, keys)
        result["ranks"] = {"mapped": {str(r): {"host": keys[g][0], "gpu": keys[g][1]} for r, g in mapped.items()},
                           "unmapped": sorted(set(info.states) - set(mapped))}
    meta = {b"wattgate.phases": strict_json({"format_version": FORMAT_VERSION, "window_s": window_s,
                                             "gpu_model": table.gpu_model if table else None},
                                            sort_keys=True).encode()}
    with atomic_path(out_dir / "phases.parquet") as tmp:
        pq.write_table(phases.replace_schema_metadata(meta), tmp, compression="zstd")
    write_bytes_atomic(out_dir / "phase_summary.csv", summary.to_csv(index=False, float_format="%.10g").encode())
    # strict JSON: read_trace already nulls non-finite power, so a NaN/Inf left here is a figure that could not
    # be computed (e.g. a share of zero seconds) and is written as null, deliberately
    write_json_atomic(out_dir / "triage.json", result, nonfinite="null")
    write_bytes_atomic(out_dir / "triage.md", _markdown(result, summary).encode())
    return result


def _table_dict(table: TriageTable | None) -> dict | None:
    if table is None:
        return None
    d = asdict(table)
    d["match"] = list(table.match)
    return d

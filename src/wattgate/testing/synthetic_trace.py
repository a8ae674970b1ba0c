"""Labelled synthetic telemetry traces (and the run files beside them) for the triage and watcher tests and benches.

A schedule gives each GPU a list of segments `(variant, seconds)` or
`(variant, seconds, overrides)`; `build_trace` turns it into trace rows in the
telemetry contract, sampled as a `TraceSpec` says (`hz` samples per second),
with seeded noise, and keeps the ground-truth phase of every window. `job`
builds a schedule for GPUs that run one job in lockstep, giving the checkpoint
writer and the stuck rank their own variants.

Levels, from the triage table (T = tdp_w, I = idle_w, L = low_max_w,
C = compute_min_w); a level is drawn once per segment, then every sample adds
Gaussian noise (`noise` scales every sd):

  variant            truth            power (W)                       noise sd        util (%)
  compute            compute          U(0.75, 0.95) x T               0.02 T          U(95, 100)
                                      every U(1.5, 4) s a U(0.2, 0.4) s dip to L + U(0.5, 0.9) x (C - L)
                                      (the step's gradient reduce)
  communication      communication    L + U(0.25, 0.75) x (C - L)     0.03 (C - L)    U(97, 100)
  sync_wait          communication    wait level (below); give it     0.03 (L - I)    U(98, 100)
                                      fewer seconds than deadlock_after_s
  checkpoint         checkpoint       wait level: a rank blocked on   0.03 (L - I)    U(98, 100)
                                      the writer
  checkpoint_writer  checkpoint       U(1.00, 1.15) x I (I/O)         0.02 I          U(0, 10)
  deadlock           deadlock         wait level: a spinning kernel   0.03 (L - I)    U(98, 100)
  deadlock_stuck     deadlock         U(0.97, 1.05) x I, no kernel    0.02 I          0
  data_starvation    data_starvation  bursts of U(0.2, 0.6) s at the compute level and util, gaps
                                      of U(0.3, 0.7) s at U(1.0, 1.1) x I and 0% util
  idle               idle             U(0.95, 1.05) x I               0.02 I          0

  wait level = I + U(0.42, 0.59) x (L - I). The one published hang, an H100
  (I 64-73 W, table L 210 W) at 129-152 W, is I + 0.42-0.59 of the low band;
  "1.9-2.2 x I" is the same reading there. The builder keeps the band-relative
  form because the ratio does not carry over: on the calibrated H200 table I is
  the draw with a CUDA context held (119 W, not the 78 W of a bare GPU), so
  2.2 x I is above L, while the real H200 hang (a spinning kernel) drew 119-121 W.

Per shipped table (W):      idle    compute       communication   wait (hang)   L / C
  A100 (T 400, I 60)        57-63   300-380       172-218         98-113        150 / 240
  H100 (T 700, I 70)        66-74   525-665       252-338         129-153       210 / 380
  H200 (T 700, I 118.9)     113-125 525-665       307-408         177-200       256.3 / 458 (calibrated)
  B200 (T 1000, I 165)      157-173 750-950       450-550         264-304       400 / 600
  B300 (T 1100, I 160)      152-168 825-1045      462-588         261-302       400 / 650

`overrides` may set `power_w` (mean), `power_sd`, `util` (a value or a (low,
high) uniform range) and `phase` (the truth label). Samples can be dropped
(TraceSpec.drop) to leave windows without data: their truth is `unknown`.
`write_run_info` writes the heartbeat events, heartbeat states and
metrics.parquet that the training loop would have written for a `job`.
testing/nvidia_smi_log.py writes a trace as an nvidia-smi CSV log.

Synchronized steps and stragglers: TraceSpec's `sync_steps`, `straggler`
(testing/sync_steps.py says how they are drawn). testing/trace_scoring.py
scores triage against a labelled real trace and a real run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.triage_tables import TriageTable
from wattgate.power.triage.phases import END, PHASE, START
from wattgate.trace import GPU, HOST, POWER_W, TIME, TRACE_SCHEMA, UTIL_GPU, schema_with_meta
from wattgate.testing.sync_steps import (  # noqa: F401 (callers import these here)
    Straggler,
    SyncJob,
    gpu_uuid,
    wait_level,
    write_sync_run_info,
)

T0 = 1_700_000_000.0
PHASE_OF = {
    "compute": "compute",
    "communication": "communication",
    "sync_wait": "communication",
    "checkpoint": "checkpoint",
    "checkpoint_writer": "checkpoint",
    "deadlock": "deadlock",
    "deadlock_stuck": "deadlock",
    "data_starvation": "data_starvation",
    "idle": "idle",
}
TRUTH_LABELS = ("compute", "communication", "data_starvation", "checkpoint", "deadlock", "idle", "unknown")
TRAIN_PHASES = ("compute", "communication", "data_starvation")


def _levels(variant: str, t: TriageTable, rng) -> tuple[float, float, tuple[float, float]]:
    """(mean power, noise sd, util range) of one segment."""
    band_lo, band_mid = t.low_max_w - t.idle_w, t.compute_min_w - t.low_max_w
    if variant == "compute":
        return rng.uniform(0.75, 0.95) * t.tdp_w, 0.02 * t.tdp_w, (95, 100)
    if variant == "communication":
        return t.low_max_w + rng.uniform(0.25, 0.75) * band_mid, 0.03 * band_mid, (97, 100)
    if variant in ("sync_wait", "checkpoint", "deadlock"):
        return wait_level(t, rng), 0.03 * band_lo, (98, 100)
    if variant == "checkpoint_writer":
        return rng.uniform(1.0, 1.15) * t.idle_w, 0.02 * t.idle_w, (0, 10)
    if variant == "deadlock_stuck":
        return rng.uniform(0.97, 1.05) * t.idle_w, 0.02 * t.idle_w, (0, 0)
    if variant == "idle":
        return rng.uniform(0.95, 1.05) * t.idle_w, 0.02 * t.idle_w, (0, 0)
    raise ValueError(f"unknown segment variant {variant!r}")


def _segment(
    variant: str, times: np.ndarray, t: TriageTable, rng, overrides: dict, noise: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Power and util samples of one segment at `times` (seconds from the segment start)."""
    n = len(times)
    if variant == "data_starvation":
        hi, lo = rng.uniform(0.75, 0.95) * t.tdp_w, rng.uniform(1.0, 1.1) * t.idle_w
        burst = _alternating(times, (0.2, 0.6), (0.3, 0.7), rng)
        power = np.where(
            burst, hi + rng.normal(0, noise * 0.02 * t.tdp_w, n), lo + rng.normal(0, noise * 0.02 * t.idle_w, n)
        )
        return power, np.where(burst, rng.uniform(95, 100, n), 0.0)
    mean, sd, (ulo, uhi) = _levels(variant, t, rng)
    mean, sd = overrides.get("power_w", mean), overrides.get("power_sd", noise * sd)
    util = overrides.get("util", (ulo, uhi))
    if not isinstance(util, (tuple, list)):
        util = (util, util)
    power = mean + rng.normal(0, sd, n)
    if variant == "compute" and "power_w" not in overrides:
        # each step ends in a gradient reduce: a short dip to the communication level
        dip = ~_alternating(times, (1.5, 4.0), (0.2, 0.4), rng)
        comm = t.low_max_w + rng.uniform(0.5, 0.9) * (t.compute_min_w - t.low_max_w)
        power = np.where(dip, comm + rng.normal(0, noise * 0.03 * (t.compute_min_w - t.low_max_w), n), power)
    return power, rng.uniform(util[0], util[1], n) if util[1] > util[0] else np.full(n, float(util[0]))


def _alternating(times: np.ndarray, first: tuple, second: tuple, rng) -> np.ndarray:
    """True in the `first` pieces of an alternation of uniform(first) and uniform(second) seconds."""
    if len(times) == 0:
        return np.zeros(0, dtype=bool)
    k = 2 * int(times[-1] / (first[0] + second[0])) + 4
    durations = np.where(np.arange(k) % 2 == 0, rng.uniform(*first, k), rng.uniform(*second, k))
    edges = np.cumsum(durations) - rng.uniform(0, durations[0])  # a random phase at the segment start
    return np.searchsorted(edges, times, side="right") % 2 == 0


@dataclass
class SyntheticTrace:
    table: pa.Table  # all hosts' rows in the trace schema
    truth: pd.DataFrame | None  # host, gpu, start, phase: every window of every GPU's span (None: with_truth=False)
    segments: pd.DataFrame  # host, gpu, variant, phase, start, end (unix s)
    gpus: list[tuple[str, int]]
    triage_table: TriageTable
    hz: float
    window_s: float
    device_name: str
    caps: dict = field(default_factory=dict)  # (host, gpu) -> {"power_limit_w": the limit the sampler records}
    steps: pd.DataFrame | None = None  # sync_steps: start, compute_s, slowdown, comm_s (unix s, seconds)
    straggler: Straggler | None = None

    def meta(self, host: str) -> dict:
        def gpu(h, g):  # with the power limit the sampler would record, where the trace has one (sync_steps)
            return {"index": g, "name": self.device_name, "uuid": gpu_uuid(h, g)} | self.caps.get((h, g), {})

        return {
            "host": host,
            "interval_s": 1.0 / self.hz,
            "power_source": "instant",
            "gpus": [gpu(h, g) for h, g in self.gpus if h == host],
        }

    def host_table(self, host: str) -> pa.Table:
        mask = pc.equal(self.table.column(HOST), host)
        return self.table.filter(mask).cast(schema_with_meta(self.meta(host)))

    def write(self, folder: Path) -> list[Path]:
        """One trace file per host, `<host>.parquet`, as the samplers would leave them."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for host in sorted({h for h, _ in self.gpus}):
            paths.append(folder / f"{host}.parquet")
            pq.write_table(self.host_table(host), paths[-1])
        return paths

    def truth_for(self, phases: pa.Table) -> np.ndarray:
        """The true phase of each row of a phases table (None where the window is not in the truth)."""
        if self.truth is None:
            raise ValueError("this trace was built with with_truth=False: it has no truth")
        df = phases.select([HOST, GPU, START]).to_pandas()
        key = self.truth.set_index([HOST, GPU, START])[PHASE]
        return key.reindex(pd.MultiIndex.from_frame(df)).to_numpy()


def job(gpus: list[tuple[str, int]], phases: list[tuple], writer: int = 0, stuck: int | None = None) -> dict:
    """A lockstep schedule of `phases` on every GPU; the checkpoint writer (gpus[writer]) and the
    stuck rank (gpus[stuck]) get checkpoint_writer and deadlock_stuck instead."""
    schedule = {}
    for i, key in enumerate(gpus):
        segs = []
        for seg in phases:
            variant = seg[0]
            if variant == "checkpoint" and i == writer:
                variant = "checkpoint_writer"
            elif variant == "deadlock" and i == stuck:
                variant = "deadlock_stuck"
            segs.append((variant,) + tuple(seg[1:]))
        schedule[key] = segs
    return schedule


def gpus_of(hosts: int, per_host: int, prefix: str = "node") -> list[tuple[str, int]]:
    return [(f"{prefix}{h}", g) for h in range(hosts) for g in range(per_host)]


@dataclass(frozen=True, kw_only=True)
class TraceSpec:
    """How build_trace samples a schedule: the sampler's rate, clock and losses, the noise, the truth kept, and
    the synchronized steps. The defaults are the sampler's 10 Hz from T0, every sample kept."""

    hz: float = 10.0
    t0: float = T0
    window_s: float = 1.0  # the truth's windows
    # (key or None for every GPU, start_s, end_s) relative to t0: samples removed
    drop: Sequence[tuple] = ()
    drop_share: float = 0.0  # this share of the samples dropped at random
    noise: float = 1.0  # scales every noise sd
    # > 1: each sample is the mean of that many sub-samples since the previous one (NVML's 1 s power average and
    # utilization period, read at 1 Hz)
    average_over: int = 1
    device_name: str | None = None  # None: "NVIDIA <the table's GPU model>"
    with_truth: bool = True  # False skips the truth (for timing-only traces of millions of rows)
    # synchronized steps, one slowed GPU (a straggler implies the steps), the reasons recorded (sync_steps.py)
    sync_steps: bool = False
    straggler: Straggler | None = None
    reasons: bool | None = None


DEFAULT_SPEC = TraceSpec()


def build_trace(schedule: dict, table: TriageTable, seed: int = 0, spec: TraceSpec = DEFAULT_SPEC) -> SyntheticTrace:
    """Trace rows and per-window truth for `schedule` ({(host, gpu): [segments]}), sampled as `spec` says, its
    noise drawn from `seed`. The truth comes from the signal itself (sub-samples), not from what the samples
    show."""
    hz, t0, window_s, noise = spec.hz, spec.t0, spec.window_s, spec.noise
    sync = SyncJob(table, seed, spec.straggler, spec.reasons) if spec.sync_steps or spec.straggler is not None else None
    rng = np.random.default_rng(seed)
    gpus = sorted(schedule)
    hosts = sorted({h for h, _ in gpus})
    k = max(1, spec.average_over)
    cols = {c: [] for c in (TIME, HOST, GPU, POWER_W, UTIL_GPU)}
    fine = {c: [] for c in (TIME, HOST, GPU, "label")}
    seg_rows = []
    for key in gpus:
        segs = [s if len(s) == 3 else (s[0], s[1], {}) for s in schedule[key]]
        seconds = np.array([s[1] for s in segs], float)
        ends = np.cumsum(seconds)
        n = int(round(ends[-1] * hz)) * k
        rel = np.arange(n) / (hz * k) + rng.uniform(-0.1, 0.1, n) / (hz * k)  # the sampler's grid, a little jitter
        rel = np.clip(rel, 0, ends[-1] - 1e-6)
        power, util = np.empty(n), np.empty(n)
        label = np.empty(n, np.int8)
        bounds = np.searchsorted(rel, np.concatenate([[0.0], ends]))
        if sync is not None:
            sync.start_gpu(key, n)
        for i, ((variant, length, over), a, b, start) in enumerate(zip(segs, bounds[:-1], bounds[1:], ends - seconds)):
            if sync is not None and variant == "compute" and "power_w" not in over:
                power[a:b], util[a:b] = sync.compute(i, length, start, rel[a:b] - start, a, rng, noise)
            else:
                power[a:b], util[a:b] = _segment(variant, rel[a:b] - start, table, rng, over, noise)
            phase = over.get("phase", PHASE_OF[variant])
            label[a:b] = TRUTH_LABELS.index(phase)
            seg_rows.append((key[0], key[1], variant, phase, t0 + start, t0 + start + length))
        gone = np.zeros(n, dtype=bool)
        for which, d0, d1 in spec.drop:
            if which is None or tuple(which) == key:
                gone |= (rel >= d0) & (rel < d1)
        # a reported sample: the mean of its k sub-samples, stamped at the last; gone if any sub-sample is
        at = np.arange(k - 1, n, k)
        keep = cast(np.ndarray, ~gone.reshape(-1, k).any(axis=1))  # any over axis 1 of a 2-D array: an array
        if spec.drop_share:
            keep &= rng.random(len(keep)) >= spec.drop_share
        cols[TIME].append(t0 + rel[at][keep])
        cols[HOST].append(np.full(keep.sum(), hosts.index(key[0]), np.int32))
        cols[GPU].append(np.full(keep.sum(), key[1], np.int32))
        cols[POWER_W].append(np.maximum(power.reshape(-1, k).mean(axis=1)[keep], 0.0).astype(np.float32))
        cols[UTIL_GPU].append(np.clip(util.reshape(-1, k).mean(axis=1)[keep], 0, 100).astype(np.float32))
        if sync is not None:
            sync.keep(rel, at, keep)
        fine[TIME].append(t0 + rel[~gone])
        fine[HOST].append(np.full((~gone).sum(), hosts.index(key[0]), np.int32))
        fine[GPU].append(np.full((~gone).sum(), key[1], np.int32))
        fine["label"].append(label[~gone])
    data = {c: np.concatenate(v) for c, v in cols.items()}
    extra = sync.columns() if sync is not None else None
    trace = trace_table(data[TIME], hosts, data[HOST], data[GPU], data[POWER_W], data[UTIL_GPU], extra)
    truth = _truth({c: np.concatenate(v) for c, v in fine.items()}, hosts, window_s) if spec.with_truth else None
    segments = pd.DataFrame(seg_rows, columns=[HOST, GPU, "variant", PHASE, START, END])
    name = spec.device_name or f"NVIDIA {table.gpu_model}"
    if sync is None:
        return SyntheticTrace(trace, truth, segments, gpus, table, hz, window_s, name)
    caps, steps, slowed = sync.results(t0)
    return SyntheticTrace(trace, truth, segments, gpus, table, hz, window_s, name, caps, steps, slowed)


def trace_table(time, hosts: list[str], host_code, gpu, power_w, util_gpu, extra: dict | None = None) -> pa.Table:
    """Rows in the trace schema (host as codes into `hosts`); columns triage does not read get constants or nulls
    unless `extra` (column -> arrow array) gives them."""
    n = len(time)
    arrays = {
        TIME: pa.array(time, pa.float64()),
        HOST: pa.DictionaryArray.from_arrays(pa.array(host_code, pa.int32()), pa.array(hosts)).cast(pa.string()),
        GPU: pa.array(gpu, pa.int32()),
        POWER_W: pa.array(power_w, pa.float32()),
        "energy_j": pa.nulls(n, pa.float64()),
        UTIL_GPU: pa.array(util_gpu, pa.float32()),
        "util_mem": pa.array(np.zeros(n, np.float32)),
        "sm_clock_mhz": pa.array(np.full(n, 1980.0, np.float32)),
        "mem_used_mib": pa.array(np.zeros(n, np.float32)),
        "temp_c": pa.array(np.full(n, 40.0, np.float32)),
    }
    arrays.update(extra or {})
    return pa.Table.from_arrays([arrays.get(f.name, pa.nulls(n, f.type)) for f in TRACE_SCHEMA], schema=TRACE_SCHEMA)


def _truth(data: dict, hosts: list[str], window_s: float) -> pd.DataFrame:
    """Majority truth label of each window's samples; windows without samples inside a GPU's span: unknown."""
    df = pd.DataFrame(
        {
            HOST: np.array(hosts, dtype=object)[data[HOST]],
            GPU: data[GPU],
            "w": np.floor(data[TIME] / window_s).astype(np.int64),
            "label": data["label"],
        }
    )
    counts = df.groupby([HOST, GPU, "w", "label"]).size().reset_index(name="n")
    counts = counts.sort_values([HOST, GPU, "w", "n", "label"], ascending=[True, True, True, False, True])
    best = counts.drop_duplicates([HOST, GPU, "w"])
    frames = []
    for (host, gpu), g in best.groupby([HOST, GPU], sort=True):
        w = np.arange(g["w"].min(), g["w"].max() + 1)
        lab = np.full(len(w), TRUTH_LABELS.index("unknown"))
        lab[g["w"].to_numpy() - w[0]] = g["label"].to_numpy()
        frames.append(
            pd.DataFrame(
                {
                    HOST: host,
                    GPU: np.int32(gpu),
                    START: w * window_s,
                    PHASE: np.array(TRUTH_LABELS, dtype=object)[lab],
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def accuracy(phases: pa.Table, synth: SyntheticTrace) -> pd.DataFrame:
    """Per true phase: windows, recall (share labelled right) and precision."""
    truth = synth.truth_for(phases)
    got = phases.column(PHASE).to_numpy(zero_copy_only=False)
    rows = []
    for ph in TRUTH_LABELS:
        t, g = truth == ph, got == ph
        if t.sum() == 0:
            continue
        rows.append(
            {
                "phase": ph,
                "windows": int(t.sum()),
                "recall": float((t & g).sum() / t.sum()),
                "precision": float((t & g).sum() / max(g.sum(), 1)),
            }
        )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- run files


def write_run_info(
    run_dir: Path,
    synth: SyntheticTrace,
    step_s: float = 2.0,
    use_uuid: bool = True,
    heartbeat_host: str | None = None,
    ranks: list[tuple[str, int]] | None = None,
) -> Path:
    """Heartbeat events and states and metrics.parquet for a lockstep `job`: rank r runs on ranks[r] (synth.gpus).

    The job starts at the first non-idle segment (init, train), emits checkpoint/train around
    each checkpoint segment, steps every `step_s` through train segments (60% data wait in
    data_starvation, 1% otherwise), and ends with export/done unless it ends in a deadlock
    (then the heartbeats stop at the last step). `heartbeat_host` overrides the host the
    heartbeats name (to test runs whose ranks cannot be matched to GPUs).
    """
    from wattgate.run_tables import METRICS_SCHEMA

    ranks = ranks or synth.gpus
    beat_dir = run_dir / "heartbeat"
    beat_dir.mkdir(parents=True, exist_ok=True)
    metrics = []
    for rank, key in enumerate(ranks):
        segs = synth.segments[(synth.segments[HOST] == key[0]) & (synth.segments[GPU] == key[1])]
        busy = segs[segs[PHASE] != "idle"]
        start, end = float(busy[START].min()), float(busy[END].max())
        events = [(start, 0, "init"), (start, 0, "train")]
        step, last_progress = 0, start
        for seg in busy.itertuples():
            if seg.phase in TRAIN_PHASES:
                wait = 0.6 if seg.phase == "data_starvation" else 0.01
                # pandas types a row's fields as any scalar: here they are seconds
                ends = np.arange(cast(float, seg.start) + step_s, cast(float, seg.end) + 1e-9, step_s)
                if len(ends):
                    metrics.append(
                        pd.DataFrame(
                            {
                                "step": step + 1 + np.arange(len(ends)),
                                "rank": rank,
                                "data_wait_s": wait * step_s,
                                "time": ends,
                            }
                        )
                    )
                    step += len(ends)
                    last_progress = float(ends[-1])
            elif seg.phase == "checkpoint":
                events += [(seg.start, step, "checkpoint"), (seg.end, step, "train")]
                last_progress = seg.end
        if busy.iloc[-1]["phase"] != "deadlock":
            events += [(end, step, "export"), (end, step, "done")]
            last_progress = end
        phase = events[-1][2]
        with open(beat_dir / f"rank-{rank}.events.jsonl", "w") as f:
            for t, s, ph in events:
                f.write(json.dumps({"time": t, "rank": rank, "step": s, "epoch": 0, "phase": ph}) + "\n")
        state = {
            "rank": rank,
            "local_rank": key[1],
            "gpu": gpu_uuid(*key) if use_uuid else None,
            "host": heartbeat_host or key[0],
            "pid": 1000 + rank,
            "step": step,
            "epoch": 0,
            "phase": phase,
            "time": last_progress,
            "total_steps": step,
            "epoch_ends": [step],
        }
        (beat_dir / f"rank-{rank}.json").write_text(json.dumps(state) + "\n")
    m = (
        pd.concat(metrics, ignore_index=True)
        if metrics
        else pd.DataFrame({"step": [], "rank": [], "data_wait_s": [], "time": []})
    )
    m = m.assign(epoch=0, loss=1.0, tokens=4096, loss_tokens=2048, step_time_s=step_s, lr=1e-5, grad_norm=1.0)
    pq.write_table(
        pa.Table.from_pandas(m[METRICS_SCHEMA.names], schema=METRICS_SCHEMA, preserve_index=False),
        run_dir / "metrics.parquet",
    )
    return run_dir

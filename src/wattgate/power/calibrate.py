"""`wattgate calibrate`: measure each known phase's power on this node's GPUs and derive a triage table.

Phases, one at a time, each for `seconds` (the first `settle_s` discarded while
clocks and power settle):
- idle: a CUDA context and allocated memory, no kernels;
- compute: a bf16 GEMM loop (8192^3, tensor cores busy);
- data_starvation: short GEMM bursts separated by host sleeps (a loader that
  cannot keep up);
- checkpoint: GPU idle while its memory is copied to the host and written to
  disk with fsync (what a rank does while saving);
- communication: an NCCL all-reduce loop among the node's GPUs (skipped, and
  said so, with one GPU);
- deadlock: a kernel spinning on the clock (`torch.cuda._sleep`), resident but
  doing no work, like an NCCL kernel waiting for a peer that never comes. Run
  last so that a trace of the whole calibration ends in an unending wait.
Bands: the low band's top sits between the low phases' p99 and the next
band's p5; with a communication measurement the compute band starts midway
between it and compute, else midway between the low band and compute.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import platform
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path, check_file_output, first_line_has, write_bytes_atomic
from wattgate.errors import InputError
from wattgate.telemetry.nvml import NvmlSource, NvmlUnavailable
from wattgate.triage_tables import TriageTable, parse_table, shipped_table
from wattgate.power.triage.phases import PHASE
from wattgate.records.trace_meta import TraceMeta
from wattgate.trace import GPU, POWER_W, TIME, UTIL_GPU, TraceWriter, check_trace_output

ORDER = ("idle", "compute", "data_starvation", "checkpoint", "communication", "deadlock")
LOW_PHASES = ("idle", "checkpoint", "deadlock")


class BackgroundSampler:
    """NVML rows tagged with the phase running when they were read."""

    def __init__(self, source: NvmlSource, interval_s: float):
        self.source, self.interval_s = source, interval_s
        self.phase = "setup"
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0, tick = time.monotonic(), 0
        while not self._stop.is_set():
            phase = self.phase
            for row in self.source.read():
                self.rows.append(row | {PHASE: phase})
            tick = max(tick + 1, int((time.monotonic() - t0) / self.interval_s))
            self._stop.wait(max(0.0, t0 + tick * self.interval_s - time.monotonic()))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _until(deadline: float) -> bool:
    return time.monotonic() < deadline


def run_idle(torch, device, seconds: float) -> None:
    keep = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # context + memory, no kernels
    time.sleep(seconds)
    del keep


def run_compute(torch, device, seconds: float, n: int = 8192) -> float:
    """Back-to-back bf16 matmuls for `seconds`; returns the rate they ran at in TFLOP/s (2 n^3 each), the
    calibrated peak the gate's forecast uses when no earlier run of the shape is in the ledger."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    start, done = time.monotonic(), 0
    c = None  # the last product, kept alive to the end (none when `seconds` leaves no time for a round)
    while _until(deadline):
        for _ in range(10):
            c = a @ b
        torch.cuda.synchronize(device)
        done += 10
    del c
    return 2.0 * n**3 * done / max(time.monotonic() - start, 1e-9) / 1e12


def run_data_starvation(torch, device, seconds: float, burst_s: float = 0.03, gap_s: float = 0.12) -> None:
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    while _until(deadline):
        end = time.monotonic() + burst_s
        while time.monotonic() < end:
            a @ a
            torch.cuda.synchronize(device)
        time.sleep(gap_s)  # the host "loads the next batch"


def run_checkpoint(torch, device, seconds: float, folder: Path, gib: float = 2.0) -> None:
    state = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=device)
    deadline = time.monotonic() + seconds
    path = folder / "calibrate-checkpoint.bin"
    while _until(deadline):
        host = state.to("cpu").numpy()
        with open(path, "wb") as f:
            for i in range(0, host.nbytes, 1 << 26):
                if not _until(deadline):
                    break
                f.write(memoryview(host[i : i + (1 << 26)]))
            f.flush()
            os.fsync(f.fileno())
    path.unlink(missing_ok=True)
    del state


def spin_cycles_per_s(torch, device) -> float:
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize(device)
    return 10_000_000 / (time.perf_counter() - t)


def run_deadlock(torch, device, seconds: float) -> None:
    cycles = int(spin_cycles_per_s(torch, device) * 0.2)  # ~0.2 s per resident spin kernel
    deadline = time.monotonic() + seconds
    while _until(deadline):
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize(device)


def _allreduce_worker(rank: int, world: int, init_file: str, seconds: float) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x = torch.ones(64 << 20, device="cuda")  # 256 MiB of fp32 per all-reduce
    deadline = time.monotonic() + seconds
    while _until(deadline):
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
    dist.destroy_process_group()


def run_communication(torch, seconds: float) -> None:
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_allreduce_worker, args=(world, os.path.join(tmp, "init"), seconds), nprocs=world, join=True)


PERCENTILES = (1, 5, 25, 50, 75, 95, 99)


@dataclass(frozen=True)
class Figures:
    """One measured quantity of a phase: its count, mean and percentiles (None without samples)."""

    n: int
    mean: float | None = None
    p1: float | None = None
    p5: float | None = None
    p25: float | None = None
    p50: float | None = None
    p75: float | None = None
    p95: float | None = None
    p99: float | None = None

    def table_figures(self) -> dict:
        """As the triage table holds them (triage_tables.py `phases`): {n: 0} without samples."""
        return {"n": 0} if not self.n else {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class PhaseMeasure:
    """What calibrate measured of one phase: power and utilization, and for compute the bf16 matmul rate."""

    power_w: Figures
    util_gpu: Figures
    matmul_tflops: float | None = None

    def table_phase(self) -> dict:
        out = {"power_w": self.power_w.table_figures(), "util_gpu": self.util_gpu.table_figures()}
        return out if self.matmul_tflops is None else out | {"matmul_tflops": self.matmul_tflops}


def power_stats(values: np.ndarray) -> Figures:
    v = values[~np.isnan(values)]
    if len(v) == 0:
        return Figures(n=0)
    q = np.percentile(v, PERCENTILES)
    return Figures(
        len(v),
        round(float(v.mean()), 2),
        *(round(float(x), 2) for x in q),  # in PERCENTILES' order
    )


def phase_stats(rows: list[dict], phase: str, lo: float, hi: float, gpus: list[int]) -> PhaseMeasure:
    """One phase's figures from the sampler's rows of its GPUs between lo and hi (unix s)."""
    sel = [r for r in rows if r[PHASE] == phase and lo <= r[TIME] <= hi and r[GPU] in gpus]
    return PhaseMeasure(
        power_w=power_stats(np.array([r[POWER_W] for r in sel], dtype=float)),
        util_gpu=power_stats(np.array([r[UTIL_GPU] if r[UTIL_GPU] is not None else np.nan for r in sel], dtype=float)),
    )


def _measured(value: float | None) -> float:
    """A figure of a phase with samples: power_stats sets every figure whenever n > 0."""
    assert value is not None
    return value


def derive_table(
    gpu_model: str, match: list[str], tdp_w: float, stats: dict[str, PhaseMeasure], provenance: dict
) -> TriageTable:
    """Band edges from measured phase distributions (see the module docstring)."""
    p = {ph: s.power_w for ph, s in stats.items() if s.power_w.n}
    u = {ph: s.util_gpu for ph, s in stats.items() if s.util_gpu.n}
    if "compute" not in p or not any(ph in p for ph in LOW_PHASES):
        raise InputError("calibrate: need at least the compute phase and one low phase to derive bands")
    low_top = max(_measured(p[ph].p99) for ph in LOW_PHASES if ph in p)
    compute_p5 = _measured(p["compute"].p5)
    if "communication" in p:
        low_max = (low_top + _measured(p["communication"].p5)) / 2
        compute_min = (_measured(p["communication"].p95) + compute_p5) / 2
    else:  # no peer: leave the communication band between the measured low band and compute
        low_max = low_top + 0.25 * (compute_p5 - low_top)
        compute_min = (low_max + compute_p5) / 2
    idle_w = _measured(p["idle"].p50) if "idle" in p else min(_measured(s.p50) for s in p.values())
    busy = min([_measured(u[ph].p5) for ph in ("deadlock", "compute") if ph in u] or [90.0]) - 5
    idle_util = (_measured(u["idle"].p99) + 2) if "idle" in u else 5.0
    table = {
        "gpu_model": gpu_model,
        "match": match,
        "tdp_w": round(tdp_w, 1),
        "idle_w": round(idle_w, 1),
        "low_max_w": round(low_max, 1),
        "compute_min_w": round(compute_min, 1),
        "busy_util_pct": float(np.clip(round(busy, 1), 50, 85)),
        "idle_util_pct": float(np.clip(idle_util, 1, 20)),
        "provenance": provenance,
        "phases": {ph: s.table_phase() for ph, s in stats.items()},
    }
    return parse_table(table, "calibration")


def calibrate(
    gpu_model: str,
    out: Path,
    seconds: float = 20.0,
    settle_s: float = 3.0,
    interval_s: float = 0.1,
    device_index: int = 0,
    workdir: Path | None = None,
    samples_out: Path | None = None,
) -> dict:
    # before minutes of GPU work: neither --out nor --samples replaces a file calibrate did not write
    check_file_output(out, "calibrate", lambda p: first_line_has(p, CALIBRATED_BY))
    if samples_out is not None:
        check_trace_output(samples_out, "calibrate")
        check_file_output(labels_path(samples_out), "calibrate", is_labels_file)
    try:
        import torch
    except ImportError as exc:
        raise InputError(f"calibrate needs torch: {exc}") from None
    if not torch.cuda.is_available():
        raise InputError("calibrate needs a CUDA GPU: run it as a one-node GPU job (snakemake calibrate)")
    try:
        source = NvmlSource()
    except NvmlUnavailable as exc:
        raise InputError(f"calibrate needs NVML: {exc}") from None
    meta = source.meta(interval_s)
    device = torch.device("cuda", device_index)
    workdir = Path(workdir or tempfile.gettempdir())  # the checkpoint phase writes GiBs: keep them out of the results
    workdir.mkdir(parents=True, exist_ok=True)
    n_gpus = torch.cuda.device_count()
    skipped, spans, tflops = {}, {}, []
    runners = {
        "idle": lambda: run_idle(torch, device, seconds),
        "compute": lambda: tflops.append(run_compute(torch, device, seconds)),
        "data_starvation": lambda: run_data_starvation(torch, device, seconds),
        "checkpoint": lambda: run_checkpoint(torch, device, seconds, workdir),
        "communication": lambda: run_communication(torch, seconds),
        "deadlock": lambda: run_deadlock(torch, device, seconds),
    }
    torch.ones(1, device=device)  # create the context before sampling idle
    with BackgroundSampler(source, interval_s) as sampler:
        for phase in ORDER:
            if phase == "communication" and n_gpus < 2:
                skipped[phase] = f"{n_gpus} GPU on this node: no NCCL peer to all-reduce with"
                print(f"calibrate: skip communication ({skipped[phase]})", flush=True)
                continue
            print(f"calibrate: {phase} for {seconds:.0f} s", flush=True)
            sampler.phase = phase
            t0 = time.time()
            runners[phase]()
            spans[phase] = (t0 + settle_s, time.time())
            torch.cuda.synchronize(device)
        sampler.phase = "end"
    source.close()
    rows = sampler.rows
    gpus = {phase: (list(range(n_gpus)) if phase == "communication" else [device_index]) for phase in ORDER}
    stats = {}
    for phase, (lo, hi) in spans.items():
        stats[phase] = m = phase_stats(rows, phase, lo, hi, gpus[phase])
        print(
            f"calibrate: {phase}: power p5/p50/p95 {m.power_w.p5}/{m.power_w.p50}/{m.power_w.p95} W, util p50 "
            f"{m.util_gpu.p50}% ({m.power_w.n} samples)",
            flush=True,
        )
    if "compute" in stats and tflops and tflops[0]:
        # the bf16 matmul rate this GPU reached: the gate's "calibrated" forecast throughput (gate/cost.py)
        stats["compute"] = dataclasses.replace(stats["compute"], matmul_tflops=round(tflops[0], 1))
        print(f"calibrate: compute: bf16 matmul {stats['compute'].matmul_tflops} TFLOP/s", flush=True)
    info = TraceMeta.from_json(meta, "NVML")  # what the trace of these samples records of the node
    gpu = info.gpu_list[device_index]
    provenance = {
        "kind": "calibrated",
        "host": info.host,
        "gpu": gpu.name,
        "gpu_uuid": gpu.uuid,
        "driver": info.driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        "power_source": info.power_source,
        "interval_s": interval_s,
        "seconds_per_phase": seconds,
        "settle_s": settle_s,
        "samples": {ph: s.power_w.n for ph, s in stats.items()},
        "skipped": skipped,
    }
    try:
        published = shipped_table(gpu_model)
        match, tdp = list(published.match), gpu.power_limit_w or published.tdp_w
    except InputError:
        published, match, tdp = None, [gpu_model], gpu.power_limit_w or 0.0
    table = derive_table(published.gpu_model if published else gpu_model, match, tdp, stats, provenance)
    write_bytes_atomic(
        out,
        (
            f"# Calibrated on {info.host} ({gpu.name}, driver {info.driver}) {CALIBRATED_BY}.\n" + table.to_yaml()
        ).encode(),
    )
    if samples_out is not None:
        write_calibration_trace(rows, meta, samples_out)
    result = {"table": table, "published": published, "stats": stats}
    if published is not None:
        print(
            f"calibrate: bands vs published ({published.provenance.get('kind')}): "
            f"idle {published.idle_w} -> {table.idle_w} W, low band top {published.low_max_w} -> "
            f"{table.low_max_w} W, compute from {published.compute_min_w} -> {table.compute_min_w} W",
            flush=True,
        )
    print(f"calibrate: table -> {out}", flush=True)
    return result


CALIBRATED_BY = "by `wattgate calibrate`"
LABEL_COLUMNS = [TIME, GPU, PHASE]


def labels_path(samples: Path) -> Path:
    return Path(samples).with_suffix(".labels.parquet")


def is_labels_file(path: Path) -> bool:
    """A calibration's `<samples>.labels.parquet` (its columns; it carries no metadata of its own)."""
    try:
        return pq.read_schema(path).names == LABEL_COLUMNS
    except (OSError, pa.ArrowException):
        return False


def write_calibration_trace(rows: list[dict], meta: dict, out: Path) -> None:
    """The calibration's own samples as a trace, plus `<out>.labels.parquet` (time, gpu, phase) for checks."""
    writer = TraceWriter(out, dict(meta, calibration=True), flush_every_s=1e9)
    for r in rows:
        writer.add({k: v for k, v in r.items() if k != PHASE})
    writer.close()
    labels = pa.table(
        {
            TIME: [r[TIME] for r in rows],
            GPU: pa.array([r[GPU] for r in rows], pa.int32()),
            PHASE: [r[PHASE] for r in rows],
        }
    )
    with atomic_path(labels_path(out)) as tmp:
        pq.write_table(labels, tmp)

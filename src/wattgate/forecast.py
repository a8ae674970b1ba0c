"""What a plan will cost before it is submitted, and what a failure would have cost.

The train job's wall time is forecast term by term:
- start-up: process launch, imports and process-group init (measured on an
  earlier run of the same shape, else ASSUMED_STARTUP_S);
- load: the input weights read at the storage bandwidth (measured, else
  model bytes / bandwidth);
- steps: each optimizer step takes as long as its costliest rank, in the
  planner's own cost model (tokens + attn_weight x sum of squared document
  lengths, pack/assign.py), divided by a throughput in cost units per second
  per rank;
- checkpoints: the DCP checkpoint size divided by the storage bandwidth, at
  every step the trainer checkpoints (checkpoint_steps, the trainer's rule);
- export: final/ divided by the storage bandwidth.
GPU-hours are wall time x ranks; energy is the triage table's levels (compute
for steps, the wait level for checkpoints, idle for the rest) x the time in
each, GPUs only.

The throughput comes from the best source available, named in gate.json:
- measured: the newest run of the same model shape, world size and GPU model
  in results/throughput.jsonl (the ledger train appends to);
- calibrated: 6 x params FLOPs per token over the bf16 matmul rate `wattgate
  calibrate` measured on this GPU model x forecast.assumed_mfu;
- analytic: the same over the datasheet peak (train/metrics.py) x
  forecast.assumed_mfu;
- host-matmul (CPU runs only): the same over an fp32 matmul timed on the
  gate's host for ~0.3 s, shared by the ranks per node.

A failure's cost: where the ranks' collective sequences first diverge
(first_divergence) is where the run would hang; reaching it costs the
forecast time to that step, then the ranks wait until the collective timeout
kills the job, or, if the watchdog does not fire (the field report's silent
multi-hour hang), until the Slurm job's time limit.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from wattgate.artifacts import write_bytes_atomic
from wattgate.errors import InputError
from wattgate.cadence import checkpoint_steps  # the trainer's own rule (one home, the loop's)
from wattgate.ledger import record_problem

LEDGER_NAME = "throughput.jsonl"
LEDGER_VERSION = 1
ASSUMED_STARTUP_S = {"cpu": 10.0, "gpu": 120.0}  # launch, imports, NCCL init: used until a run measures it
ASSUMED_STORAGE_GBPS = 1.0  # GB/s of checkpoint writes when neither the config nor a run gives one
NCCL_DEFAULT_TIMEOUT_S = 600.0
WARMUP_STEPS = 5  # first steps of a run kept out of its measured rate (one-off costs)
GIB = 1024**3


# ---------------------------------------------------------------- the trainer's checkpoint rule


# ---------------------------------------------------------------- the ledger


def shape_key(shape: dict) -> str:
    """A short stable name for a model shape (the decoder's dimensions)."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def ledger_path(results: Path) -> Path:
    return Path(results) / LEDGER_NAME


def read_ledger(path: Path) -> list[dict]:
    """Every record of a throughput ledger (none if it does not exist); a damaged line is an input error."""
    if not path.is_file():
        return []
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the throughput ledger ({exc.strerror or exc})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            problem = record_problem(rec)
            if problem:
                raise ValueError(problem)
        except ValueError as exc:
            raise InputError(
                f"{path}:{lineno}: not a throughput record ({exc}); fix or delete that line "
                "(train appends one per finished run)"
            ) from None
        records.append(rec)
    return records


def append_ledger(path: Path, record: dict) -> None:
    """Add one record; the ledger is rewritten to a temp name and renamed, so a killed job leaves no half line."""
    existing = path.read_bytes() if path.is_file() else b""
    if existing and not existing.endswith(b"\n"):
        existing += b"\n"
    write_bytes_atomic(path, existing + (json.dumps(record, sort_keys=True) + "\n").encode())


def warmup_steps(n: int) -> int:
    """Steps at the start of a run that carry one-off costs (allocator, thread pools, kernel selection)."""
    return min(WARMUP_STEPS, n // 4)


def run_record(
    *,
    run_name: str,
    shape: dict,
    gpu_model: str,
    world_size: int,
    seq_len: int,
    micro_batch_size: int,
    attn_weight: float,
    step_costs: np.ndarray,
    step_times: list[float],
    tokens: int,
    startup_s: float,
    load_s: float,
    checkpoints: int,
    checkpoint_s: float,
    checkpoint_bytes: int,
    export_s: float,
    export_bytes: int,
    job_s: float,
) -> dict:
    """A finished run's throughput: what a forecast for the same shape, world size and GPU model reuses.

    The rate is measured after the first warm-up steps; their time beyond that rate is warmup_s, a one-off
    term of every run (so a short first run does not make a long second one look slow)."""
    times = np.asarray(step_times, float)
    costs = np.asarray(step_costs, float)[: len(times)]
    w = warmup_steps(len(times))
    steady_s, steady_cost = float(times[w:].sum()), float(costs[w:].sum())
    rate = steady_cost / steady_s if steady_s > 0 else 0.0
    warmup_s = max(float(times[:w].sum()) - float(costs[:w].sum()) / rate, 0.0) if rate > 0 else 0.0
    written = checkpoints * checkpoint_bytes + export_bytes
    io_s = checkpoint_s + export_s
    return {
        "version": LEDGER_VERSION,
        "time": round(time.time(), 3),
        "run_name": run_name,
        "shape": shape,
        "shape_key": shape_key(shape),
        "gpu_model": gpu_model.lower(),
        "world_size": world_size,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "attn_weight": attn_weight,
        "steps": int(len(times)),
        "cost_per_s": rate,
        "tokens_per_s": tokens / float(times.sum()) if times.sum() > 0 else 0.0,
        "step_s": round(float(times.sum()), 6),
        "warmup_s": round(warmup_s, 3),
        "startup_s": round(startup_s, 3),
        "load_s": round(load_s, 3),
        "checkpoints": checkpoints,
        "checkpoint_s": round(checkpoint_s, 3),
        "export_s": round(export_s, 3),
        "storage_gbps": written / io_s / 1e9 if io_s > 0 and written > 0 else None,
        "job_s": round(job_s, 3),
    }


# ---------------------------------------------------------------- throughput


@dataclass(frozen=True)
class Throughput:
    source: str  # measured | calibrated | analytic | host-matmul
    cost_per_s: float  # pack-cost units per second per rank
    detail: str
    startup_s: float | None = None  # measured with it (a measured source only)
    warmup_s: float | None = None
    load_s: float | None = None
    storage_gbps: float | None = None


def measured_throughput(
    records: list[dict], shape: dict, world_size: int, gpu_model: str, seq_len: int, micro_batch_size: int
) -> Throughput | None:
    """The newest ledger record of this shape, world size and GPU model (same seq_len and micro-batch first)."""
    key, model = shape_key(shape), gpu_model.lower()
    same = [
        r
        for r in records
        if r.get("shape_key") == key
        and r.get("world_size") == world_size
        and str(r.get("gpu_model", "")).lower() == model
        and r.get("cost_per_s", 0) > 0
    ]
    if not same:
        return None
    closest = [r for r in same if r.get("seq_len") == seq_len and r.get("micro_batch_size") == micro_batch_size]
    r = max(closest or same, key=lambda x: x.get("time", 0))
    return Throughput(
        "measured",
        float(r["cost_per_s"]),
        f"run {r.get('run_name')!r} ({r.get('steps')} steps, {r.get('tokens_per_s', 0):.0f} tokens/s "
        f"on {world_size} ranks)",
        r.get("startup_s"),
        r.get("warmup_s"),
        r.get("load_s"),
        r.get("storage_gbps"),
    )


def host_matmul_flops(budget_s: float = 0.3, n: int = 512) -> float:
    """FLOP/s of an fp32 n x n matmul on this host with every BLAS thread, the best of repeats within `budget_s`
    (a short measurement: the CPU throughput source when no run of this shape is in the ledger)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # BLAS threads start and pages are touched outside the timing
    best, deadline = math.inf, time.perf_counter() + budget_s
    while time.perf_counter() < deadline or best == math.inf:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / max(best, 1e-9)


def host_matmul_throughput(num_params: int, ranks_per_host: int, mfu: float, flops_per_s: float) -> Throughput:
    """The `host-matmul` source: the host's measured matmul rate shared by the ranks on it, x `mfu`."""
    return flops_throughput(
        num_params,
        flops_per_s / max(ranks_per_host, 1),
        mfu,
        "host-matmul",
        f"fp32 matmul measured on this host (the gate's, {os.cpu_count()} CPUs): {flops_per_s / 1e9:.3g} GFLOP/s, "
        f"shared by {ranks_per_host} rank(s) per node x forecast.assumed_mfu {mfu:g}",
    )


def flops_throughput(num_params: int, flops_per_s: float, mfu: float, source: str, detail: str) -> Throughput:
    """6 x params FLOPs per token: cost units (token-equivalents) per second per rank at `mfu` of `flops_per_s`."""
    return Throughput(source, flops_per_s * mfu / (6.0 * num_params), detail)


# ---------------------------------------------------------------- the forecast


@dataclass(frozen=True)
class Levels:
    """Per-GPU power for the energy forecast (W), from the triage table."""

    compute_w: float
    wait_w: float
    idle_w: float
    source: str


def table_levels(table) -> Levels:
    """Compute, wait and idle draw from a triage table: its calibrated medians where it has them."""
    calibrated = table.phases or {}

    def median(phase: str, fallback: float) -> float:
        p = (calibrated.get(phase) or {}).get("power_w") or {}
        return float(p.get("p50", fallback)) if isinstance(p, dict) else fallback

    compute = median("compute", (table.compute_min_w + table.tdp_w) / 2)
    wait = median("deadlock", table.idle_w + 0.5 * (table.low_max_w - table.idle_w))
    idle = median("idle", table.idle_w)
    kind = (table.provenance or {}).get("kind", "")
    return Levels(compute, wait, idle, f"{table.gpu_model} triage table ({kind})" if kind else table.gpu_model)


@dataclass(frozen=True)
class PlanCosts:
    """The plan as the forecast needs it: per optimizer step in run order, the costliest rank's cost."""

    step_max_cost: np.ndarray  # float64, one per step the trainer will run (max_steps applied)
    step_epoch: np.ndarray  # the epoch of each
    step_in_epoch: np.ndarray
    steps_per_epoch: int
    epoch_ends: list[int]  # 1-based global steps that end an epoch
    eval_steps: tuple[int, ...] = ()  # 1-based steps followed by a validation pass (wattgate.cadence)
    eval_pass_cost: float = 0.0  # one pass: its micro-batches' costliest ranks, x FORWARD_SHARE (no backward)


# a validation micro-batch runs the forward only: ~2N of the ~6N FLOPs per token of a training step
FORWARD_SHARE = 1 / 3


def plan_costs(
    per_rank: np.ndarray, keys: np.ndarray, n_steps: int, steps_per_epoch: int, max_steps: int | None
) -> PlanCosts:
    """From step_rank_costs' (epoch, step) x rank matrix, in run order, cut at max_steps."""
    order = np.argsort(keys, kind="stable")
    cost = per_rank[order].max(axis=1)
    epoch, step = keys[order] // n_steps, keys[order] % n_steps
    if max_steps:
        cost, epoch, step = cost[:max_steps], epoch[:max_steps], step[:max_steps]
    ends = [g + 1 for g in range(len(epoch)) if g + 1 == len(epoch) or epoch[g + 1] != epoch[g]]
    return PlanCosts(cost, epoch, step, steps_per_epoch, ends)


@dataclass(frozen=True)
class Settings:
    world_size: int
    on_gpu: bool
    checkpoint_every: int
    checkpoint_at_epoch_end: bool
    checkpoint_bytes: int
    export_bytes: int
    load_bytes: int  # the input weights read at start (0: random init)
    storage_gbps: float | None  # cluster.storage_gbps
    collective_timeout_s: float
    job_limit_s: float | None  # the Slurm job's time limit (None: not a Slurm job)


def _storage(tp: Throughput, s: Settings) -> tuple[float, str]:
    if s.storage_gbps:
        return float(s.storage_gbps), "cluster.storage_gbps"
    if tp.storage_gbps:
        return float(tp.storage_gbps), "measured with the throughput"
    return ASSUMED_STORAGE_GBPS, "assumed (set cluster.storage_gbps)"


def forecast(costs: PlanCosts, tp: Throughput, s: Settings, levels: Levels | None) -> dict:
    """The train job's wall time, GPU-hours and kWh, term by term."""
    gbps, gbps_source = _storage(tp, s)
    rate = gbps * 1e9
    startup = tp.startup_s if tp.startup_s is not None else ASSUMED_STARTUP_S["gpu" if s.on_gpu else "cpu"]
    load = tp.load_s if tp.load_s is not None else s.load_bytes / rate
    steps_s = float(costs.step_max_cost.sum()) / tp.cost_per_s
    n_ckpt = len(
        checkpoint_steps(len(costs.step_max_cost), s.checkpoint_every, costs.epoch_ends, s.checkpoint_at_epoch_end)
    )
    ckpt_s = n_ckpt * s.checkpoint_bytes / rate
    export_s = s.export_bytes / rate
    warmup = tp.warmup_s or 0.0
    validation_s = len(costs.eval_steps) * costs.eval_pass_cost / tp.cost_per_s
    terms = {
        "startup_s": startup,
        "load_s": load,
        "warmup_s": warmup,
        "steps_s": steps_s,
        "validation_s": validation_s,
        "checkpoints_s": ckpt_s,
        "export_s": export_s,
    }
    wall = sum(terms.values())
    out = {
        "wall_s": round(wall, 3),
        "gpu_hours": round(wall * s.world_size / 3600, 4),
        "kwh": None,
        "terms_s": {k: round(v, 3) for k, v in terms.items()},
        "steps": int(len(costs.step_max_cost)),
        "validations": len(costs.eval_steps),
        "checkpoints": n_ckpt,
        "throughput": asdict(tp) | {"cost_per_s": round(tp.cost_per_s, 6)},
        "storage_gbps": round(gbps, 4),
        "storage_source": gbps_source,
        "startup_source": "measured" if tp.startup_s is not None else "assumed",
        "load_source": "measured" if tp.load_s is not None else "input weights / storage bandwidth",
        "checkpoint_gib": round(s.checkpoint_bytes / GIB, 3),
        "export_gib": round(s.export_bytes / GIB, 3),
        "world_size": s.world_size,
        "energy": None,
    }
    if levels is not None:
        joules = s.world_size * (
            (steps_s + validation_s) * levels.compute_w
            + ckpt_s * levels.wait_w
            + (startup + load + export_s) * levels.idle_w
            + warmup * levels.compute_w
        )
        out["kwh"] = round(joules / 3.6e6, 4)
        out["energy"] = {
            "compute_w": levels.compute_w,
            "wait_w": levels.wait_w,
            "idle_w": levels.idle_w,
            "source": levels.source,
            "gpus_only": True,
        }
    return out


def check_budget(fc: dict | None, max_gpu_hours: float | None, max_kwh: float | None) -> tuple[bool, str]:
    """(within budget, detail) for gate.max_gpu_hours and gate.max_kwh."""
    if fc is None:
        if max_gpu_hours or max_kwh:
            return False, (
                "no forecast (see the forecast section), so gate.max_gpu_hours / gate.max_kwh cannot be checked"
            )
        return True, "no forecast; no budget set"
    shown = f"forecast {fmt_hours(fc['wall_s'])} wall, {fc['gpu_hours']:.4g} GPU-hours" + (
        f", {fc['kwh']:.4g} kWh" if fc["kwh"] is not None else ""
    )
    over = []
    if max_gpu_hours and fc["gpu_hours"] > max_gpu_hours:
        over.append(f"{fc['gpu_hours']:.4g} GPU-hours > gate.max_gpu_hours {max_gpu_hours:g}")
    if max_kwh:
        if fc["kwh"] is None:
            over.append(f"no energy forecast (no triage table) to check gate.max_kwh {max_kwh:g}")
        elif fc["kwh"] > max_kwh:
            over.append(f"{fc['kwh']:.4g} kWh > gate.max_kwh {max_kwh:g}")
    limits = [f"gate.max_gpu_hours {max_gpu_hours:g}"] if max_gpu_hours else []
    limits += [f"gate.max_kwh {max_kwh:g}"] if max_kwh else []
    if over:
        return False, f"{shown}: " + "; ".join(over)
    return True, f"{shown}" + (f" (within {', '.join(limits)})" if limits else " (no budget set)")


# ---------------------------------------------------------------- a failure's cost


def first_divergence(
    epoch: np.ndarray, step: np.ndarray, micro: np.ndarray, rank: np.ndarray, world_size: int
) -> dict | None:
    """The first (epoch, step, micro) in run order that not every rank runs: where the ranks' collective
    sequences part and the run would hang. None if every rank runs the same sequence."""
    if len(epoch) == 0:
        return None
    n_micro, n_step = int(micro.max()) + 1, int(step.max()) + 1
    key = (epoch.astype(np.int64) * n_step + step) * n_micro + micro
    pair = np.unique(key * world_size + rank)  # one entry per (key, rank) present
    keys, ranks_per_key = np.unique(pair // world_size, return_counts=True)
    short = np.flatnonzero(ranks_per_key < world_size)
    if len(short) == 0:
        return None
    k = int(keys[short[0]])
    present = sorted(int(r) for r in pair[pair // world_size == k] % world_size)
    e, st, m = k // (n_step * n_micro), (k // n_micro) % n_step, k % n_micro
    steps_in_epoch = int(step[epoch == e].max()) + 1
    return {
        "epoch": e,
        "step": st,
        "micro": m,
        "steps_in_epoch": steps_in_epoch,
        "ranks_with": present,
        "ranks_without": sorted(set(range(world_size)) - set(present)),
    }


def failure_cost(div: dict, costs: PlanCosts, fc: dict, s: Settings) -> dict:
    """What reaching the divergence costs, then the wait: the collective timeout, or the job's time limit."""
    tp_cost = fc["throughput"]["cost_per_s"]
    before = (costs.step_epoch < div["epoch"]) | (
        (costs.step_epoch == div["epoch"]) & (costs.step_in_epoch < div["step"])
    )
    reached_steps = int(before.sum())
    terms = fc["terms_s"]
    rate = fc["storage_gbps"] * 1e9
    n_ckpt = len(
        [
            g
            for g in checkpoint_steps(
                len(costs.step_max_cost), s.checkpoint_every, costs.epoch_ends, s.checkpoint_at_epoch_end
            )
            if g <= reached_steps
        ]
    )
    reach_s = (
        terms["startup_s"]
        + terms["load_s"]
        + terms["warmup_s"]
        + float(costs.step_max_cost[before].sum()) / tp_cost
        + sum(1 for e in costs.eval_steps if e <= reached_steps) * costs.eval_pass_cost / tp_cost
        + n_ckpt * s.checkpoint_bytes / rate
    )
    gpus = s.world_size
    timeout = s.collective_timeout_s or NCCL_DEFAULT_TIMEOUT_S
    out = {
        "reach_s": round(reach_s, 3),
        "reach_gpu_hours": round(reach_s * gpus / 3600, 4),
        "gpus": gpus,
        "timeout_s": timeout,
        "timeout_gpu_hours": round((reach_s + timeout) * gpus / 3600, 4),
        "job_limit_s": s.job_limit_s,
        "limit_gpu_hours": None,
    }
    if s.job_limit_s:
        out["limit_gpu_hours"] = round(max(s.job_limit_s, reach_s) * gpus / 3600, 4)
    out["line"] = failure_line(div, out)
    return out


def fmt_hours(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def failure_line(div: dict, c: dict, where: str | None = None) -> str:
    """The cost line of gate.md: where it would hang (`where`, else the training step of `div`), what reaching
    it costs, and the wait after."""
    where = where or (
        f"would hang at epoch {div['epoch']} step {div['step'] + 1} of {div['steps_in_epoch']} "
        f"(micro-batch {div['micro'] + 1}: ranks {_ranks(div['ranks_with'])} run it, "
        f"{_ranks(div['ranks_without'])} do not)"
    )
    reach = f"after ~{fmt_hours(c['reach_s'])} on {c['gpus']} GPUs = {c['reach_gpu_hours']:.3g} GPU-hours"
    wait = f"then wait {fmt_hours(c['timeout_s'])} (train.collective_timeout_s, if the watchdog fires)"
    total = f"{c['timeout_gpu_hours']:.3g}"
    if c["limit_gpu_hours"] is not None:
        wait += f" or up to {fmt_hours(max(c['job_limit_s'] - c['reach_s'], 0))} (the Slurm job's time limit, if not)"
        total += f"-{c['limit_gpu_hours']:.3g}"
    return f"{where}, {reach}, {wait}: up to {total} GPU-hours; the gate saved them."


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 6:
        return f"{', '.join(map(str, ranks[:6]))} and {len(ranks) - 6} more"
    return ", ".join(map(str, ranks)) or "none"


def hang_cost(
    last_progress: float,
    killed_at: float,
    gpus: int,
    power_w: float | None,
    timeout_s: float | None,
    job_limit_s: float | None,
    job_started: float,
) -> dict:
    """What the hang the watcher stopped cost (last progress to the kill), against what it would have cost
    without the watcher: until the collective timeout, or, if that does not fire, the job's time limit.

    power_w: the job's GPUs' total draw in the stall (None without telemetry)."""
    spent_s = max(killed_at - last_progress, 0.0)
    timeout = timeout_s or NCCL_DEFAULT_TIMEOUT_S
    out = {
        "spent_s": round(spent_s, 3),
        "gpus": gpus,
        "spent_gpu_hours": round(spent_s * gpus / 3600, 6),
        "spent_kwh": round(power_w * spent_s / 3.6e6, 9) if power_w is not None else None,
        "power_w": round(power_w, 1) if power_w is not None else None,
        "without_watcher": {
            "timeout_s": timeout,
            "gpu_hours": round(timeout * gpus / 3600, 6),
            "kwh": round(power_w * timeout / 3.6e6, 9) if power_w is not None else None,
        },
    }
    if job_limit_s:
        rest = max(job_limit_s - (last_progress - job_started), timeout)
        out["without_watcher"] |= {
            "job_limit_s": job_limit_s,
            "until_limit_s": round(rest, 3),
            "limit_gpu_hours": round(rest * gpus / 3600, 6),
            "limit_kwh": round(power_w * rest / 3.6e6, 9) if power_w is not None else None,
        }
    w = out["without_watcher"]
    saved = f"{max(w['gpu_hours'] - out['spent_gpu_hours'], 0):.3g}"
    if job_limit_s:
        saved += f"-{max(w['limit_gpu_hours'] - out['spent_gpu_hours'], 0):.3g}"
    energy = f", {out['spent_kwh']:.3g} kWh" if out["spent_kwh"] is not None else ""
    out["line"] = (
        f"the hang cost {fmt_hours(spent_s)} on {gpus} GPUs = "
        f"{out['spent_gpu_hours']:.3g} GPU-hours{energy} "
        f"from the last progress to the kill; without the watcher it would have waited "
        f"{fmt_hours(timeout)} (the collective timeout)"
        + (f" or up to {fmt_hours(w['until_limit_s'])} (the Slurm job's time limit)" if job_limit_s else "")
        + f": {saved} GPU-hours saved"
    )
    return out


# ---------------------------------------------------------------- the job's own clock


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 where unknown): the start-up before a stage's code."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None

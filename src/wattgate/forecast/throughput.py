"""The forecast's throughput, from the best source available: measured, calibrated, analytic, host-matmul."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from wattgate.ledger import shape_key
from wattgate.records.ledger import LedgerLine


@dataclass(frozen=True)
class Throughput:
    source: str  # measured | calibrated | analytic | host-matmul
    cost_per_s: float  # pack-cost units per second per rank
    detail: str
    startup_s: float | None = None  # measured with it (a measured source only)
    warmup_s: float | None = None
    load_s: float | None = None
    storage_gbps: float | None = None


def measured_record(
    records: list[LedgerLine],
    shape: dict,
    world_size: int,
    gpu_model: str,
    seq_len: int,
    micro_batch_size: int,
    context: int,
) -> LedgerLine | None:
    """The newest ledger record of this shape, world size (the launch's ranks), context degree and GPU model (same
    seq_len and micro-batch first): the last run the forecast measures from; None when there is none. A record
    without `context` is a C = 1 run's (the ledger writes it only when > 1)."""
    key, model = shape_key(shape), gpu_model.lower()
    same = [
        r
        for r in records
        if r.shape_key == key
        and r.world_size == world_size
        and (r.context or 1) == context
        and (r.gpu_model or "").lower() == model
        and r.cost_per_s > 0
    ]
    if not same:
        return None
    closest = [r for r in same if r.seq_len == seq_len and r.micro_batch_size == micro_batch_size]
    return max(closest or same, key=lambda x: x.time or 0)


def measured_throughput(
    records: list[LedgerLine],
    shape: dict,
    world_size: int,
    gpu_model: str,
    seq_len: int,
    micro_batch_size: int,
    context: int,
) -> Throughput | None:
    """The throughput of measured_record."""
    r = measured_record(records, shape, world_size, gpu_model, seq_len, micro_batch_size, context)
    if r is None:
        return None
    per_row = f", {context} per row" if context > 1 else ""
    return Throughput(
        "measured",
        float(r.cost_per_s),
        f"run {r.run_name!r} ({r.steps} steps, {r.tokens_per_s or 0:.0f} tokens/s on {world_size} ranks{per_row})",
        r.startup_s,
        r.warmup_s,
        r.load_s,
        r.storage_gbps,
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
    """6 x params FLOPs per token: cost units (token-equivalents) per second per rank at `mfu` of `flops_per_s`.
    Per rank: under parallel.context the plan's costs are already a context rank's share (walltime.py
    `per_context_rank`), so the rate needs no C."""
    return Throughput(source, flops_per_s * mfu / (6.0 * num_params), detail)

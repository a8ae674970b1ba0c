"""A failure's cost: where the ranks' collective sequences first diverge, and what reaching it and waiting costs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wattgate.cadence import checkpoint_steps
from wattgate.durations import fmt_hours
from wattgate.forecast.walltime import PlanCosts, Settings
from wattgate.records.gate import Divergence, FailureCost, Forecast

NCCL_DEFAULT_TIMEOUT_S = 600.0


def first_divergence(
    epoch: np.ndarray, step: np.ndarray, micro: np.ndarray, rank: np.ndarray, world_size: int
) -> Divergence | None:
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
    return Divergence(
        epoch=e,
        step=st,
        micro=m,
        steps_in_epoch=steps_in_epoch,
        ranks_with=tuple(present),
        ranks_without=tuple(sorted(set(range(world_size)) - set(present))),
    )


def failure_cost(div: Divergence, costs: PlanCosts, fc: Forecast, s: Settings, where: str | None = None) -> FailureCost:
    """What reaching the divergence costs, then the wait: the collective timeout, or the job's time limit (its
    line says `where` it would hang, else the training step of `div`)."""
    tp_cost = fc.throughput.cost_per_s
    before = (costs.step_epoch < div.epoch) | ((costs.step_epoch == div.epoch) & (costs.step_in_epoch < div.step))
    reached_steps = int(before.sum())
    terms = fc.terms_s
    rate = fc.storage_gbps * 1e9
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
        terms.startup_s
        + terms.load_s
        + terms.warmup_s
        + float(costs.step_max_cost[before].sum()) / tp_cost
        + sum(1 for e in costs.eval_steps if e <= reached_steps) * costs.eval_pass_cost / tp_cost
        + n_ckpt * s.checkpoint_bytes / rate
    )
    gpus = s.world_size
    timeout = s.collective_timeout_s or NCCL_DEFAULT_TIMEOUT_S
    cost = FailureCost(
        reach_s=round(reach_s, 3),
        reach_gpu_hours=round(reach_s * gpus / 3600, 4),
        gpus=gpus,
        timeout_s=timeout,
        timeout_gpu_hours=round((reach_s + timeout) * gpus / 3600, 4),
        job_limit_s=s.job_limit_s,
        limit_gpu_hours=round(max(s.job_limit_s, reach_s) * gpus / 3600, 4) if s.job_limit_s else None,
        line="",
    )
    return cost.replace(line=failure_line(div, cost, where))


def failure_line(div: Divergence, c: FailureCost, where: str | None = None) -> str:
    """The cost line of gate.md: where it would hang (`where`, else the training step of `div`), what reaching
    it costs, and the wait after."""
    where = where or (
        f"would hang at epoch {div.epoch} step {div.step + 1} of {div.steps_in_epoch} "
        f"(micro-batch {div.micro + 1}: ranks {_ranks(div.ranks_with)} run it, "
        f"{_ranks(div.ranks_without)} do not)"
    )
    reach = f"after ~{fmt_hours(c.reach_s)} on {c.gpus} GPUs = {c.reach_gpu_hours:.3g} GPU-hours"
    wait = f"then wait {fmt_hours(c.timeout_s)} (train.collective_timeout_s, if the watchdog fires)"
    total = f"{c.timeout_gpu_hours:.3g}"
    if c.limit_gpu_hours is not None:
        assert c.job_limit_s is not None  # failure_cost sets limit_gpu_hours only with a job limit
        wait += f" or up to {fmt_hours(max(c.job_limit_s - c.reach_s, 0))} (the Slurm job's time limit, if not)"
        total += f"-{c.limit_gpu_hours:.3g}"
    return f"{where}, {reach}, {wait}: up to {total} GPU-hours; the gate saved them."


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 6:
        return f"{', '.join(map(str, ranks[:6]))} and {len(ranks) - 6} more"
    return ", ".join(map(str, ranks)) or "none"

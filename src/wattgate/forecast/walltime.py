"""The train job's wall time, GPU-hours and kWh, term by term, and the budget check (wattgate.forecast)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from wattgate.cadence import checkpoint_steps  # the trainer's own rule (one home, the loop's)
from wattgate.durations import fmt_hours
from wattgate.forecast.throughput import Throughput
from wattgate.records.gate import Forecast, ForecastEnergy, ForecastTerms, ForecastThroughput, JobPlan

if TYPE_CHECKING:
    from wattgate.records.plan import Plan
    from wattgate.run_files import PackRows

ASSUMED_STARTUP_S = {"cpu": 10.0, "gpu": 120.0}  # launch, imports, NCCL init: used until a run measures it
ASSUMED_STORAGE_GBPS = 1.0  # GB/s of checkpoint writes when neither the config nor a run gives one
GIB = 1024**3


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


def step_rank_costs(packs: PackRows, world_size: int, attn_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Cost per (epoch, step) and rank, and the (epoch, step) of each row of that matrix."""
    cost = packs.num_tokens + attn_weight * packs.sum_per_row(packs.doc_lengths.astype(np.float64) ** 2)
    n_steps = int(packs.step.max()) + 1
    key = packs.epoch * n_steps + packs.step
    keys, idx = np.unique(key, return_inverse=True)
    per_rank = np.zeros((len(keys), world_size))
    np.add.at(per_rank, (idx, packs.rank), cost)
    return per_rank, keys


def per_context_rank(cost: np.ndarray, context: int) -> np.ndarray:
    """A data rank's planned cost as each of its `context` ranks (parallel.context) computes it: the share 1/C.

    Each rank of a context group holds 1/C of every row's positions (head-tail chunks), so it runs 1/C of the
    row's tokens through every layer (the 6 x params FLOPs per token) and the attention of 1/C of its queries.
    The attention term is divided as if head-tail split it evenly: exact for a row-long document, and for rows of
    shorter documents the busiest rank's excess is what the gate's context_balance check bounds
    (gate.max_context_cost_ratio), not modelled here. Not divided, because the cost model never counted them: the
    key/value all-gather of every attention layer (each rank receives the whole row's keys and values) and the
    masked kernel's pairs outside the causal documents; a measured rate carries them, which is why the ledger
    matches a record on its context degree."""
    return cost / context


def plan_step_costs(packs: PackRows, plan: Plan, max_steps: int | None, context: int) -> PlanCosts:
    """Each optimizer step's costliest rank in the planner's cost model, in run order, cut at max_steps: a
    launched rank's cost, so under parallel.context C a data rank's over C (per_context_rank)."""
    per_rank, keys = step_rank_costs(packs, plan.world_size, plan.attn_weight)
    return plan_costs(
        per_context_rank(per_rank, context), keys, int(packs.step.max()) + 1, plan.steps_per_epoch, max_steps
    )


@dataclass(frozen=True)
class Settings:
    world_size: int  # the launch's ranks (plan.json world_size x parallel.context): the GPUs the hours are of
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


def forecast(costs: PlanCosts, tp: Throughput, s: Settings, levels: Levels | None) -> Forecast:
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
    wall = startup + load + warmup + steps_s + validation_s + ckpt_s + export_s  # the terms' order, summed
    kwh, energy = None, None
    if levels is not None:
        joules = s.world_size * (
            (steps_s + validation_s) * levels.compute_w
            + ckpt_s * levels.wait_w
            + (startup + load + export_s) * levels.idle_w
            + warmup * levels.compute_w
        )
        kwh = round(joules / 3.6e6, 4)
        energy = ForecastEnergy(
            compute_w=levels.compute_w,
            wait_w=levels.wait_w,
            idle_w=levels.idle_w,
            source=levels.source,
            gpus_only=True,
        )
    return Forecast(
        wall_s=round(wall, 3),
        gpu_hours=round(wall * s.world_size / 3600, 4),
        kwh=kwh,
        terms_s=ForecastTerms(
            startup_s=round(startup, 3),
            load_s=round(load, 3),
            warmup_s=round(warmup, 3),
            steps_s=round(steps_s, 3),
            validation_s=round(validation_s, 3),
            checkpoints_s=round(ckpt_s, 3),
            export_s=round(export_s, 3),
        ),
        steps=len(costs.step_max_cost),
        validations=len(costs.eval_steps),
        checkpoints=n_ckpt,
        throughput=ForecastThroughput(
            source=tp.source,
            cost_per_s=round(tp.cost_per_s, 6),
            detail=tp.detail,
            startup_s=tp.startup_s,
            warmup_s=tp.warmup_s,
            load_s=tp.load_s,
            storage_gbps=tp.storage_gbps,
        ),
        storage_gbps=round(gbps, 4),
        storage_source=gbps_source,
        startup_source="measured" if tp.startup_s is not None else "assumed",
        load_source="measured" if tp.load_s is not None else "input weights / storage bandwidth",
        checkpoint_gib=round(s.checkpoint_bytes / GIB, 3),
        export_gib=round(s.export_bytes / GIB, 3),
        world_size=s.world_size,
        energy=energy,
    )


def job_plan(fc: Forecast, costs: PlanCosts, job_limit_s: float | None, stop_margin_s: float, max_jobs: int) -> JobPlan:
    """How many Slurm jobs of `job_limit_s` the forecast run takes when each job stops `stop_margin_s` before its
    limit (train/stop.py) and the next resumes, what one such stop costs at most, and whether the margin holds
    a stop's work: the step in flight, a validation pass's stop-check interval (the whole pass, as a bound) and
    the stop checkpoint. Pure: gate.json's forecast `jobs` and the gate's `jobs` check read it."""
    terms = fc.terms_s
    restart_s = terms.startup_s + terms.load_s + terms.warmup_s  # what every later job pays again
    one_checkpoint_s = fc.checkpoint_gib * GIB / (fc.storage_gbps * 1e9)
    cost_per_s = fc.throughput.cost_per_s
    longest_step_s = float(costs.step_max_cost.max()) / cost_per_s if len(costs.step_max_cost) else 0.0
    eval_pass_s = costs.eval_pass_cost / cost_per_s if costs.eval_steps else 0.0
    stop_work_s = longest_step_s + eval_pass_s + one_checkpoint_s
    out = JobPlan(
        job_limit_s=job_limit_s,
        stop_margin_s=stop_margin_s,
        max_jobs=max_jobs,
        stop_work_s=round(stop_work_s, 3),
        stop_cost_s=round(stop_margin_s + one_checkpoint_s + restart_s, 3),
        jobs=1,
        usable_s=None,
    )
    if job_limit_s is None or fc.wall_s <= job_limit_s:
        return out
    work = fc.wall_s - restart_s  # steps, validation, checkpoints and the export: what the jobs share
    usable = job_limit_s - stop_margin_s - restart_s - one_checkpoint_s  # each job's share of it
    return out.replace(usable_s=round(usable, 3), jobs=None if usable <= 0 else int(-(-work // usable)))


def check_jobs(plan: JobPlan | None) -> tuple[bool, str]:
    """(passed, detail) for the gate's `jobs` check on `job_plan`'s figures (None: no forecast)."""
    if plan is None:
        return True, "no forecast: the number of Slurm jobs is not known"
    margin, work = plan.stop_margin_s, plan.stop_work_s
    limit = plan.job_limit_s
    if limit is None:
        return True, "not a Slurm job: one attempt; a stop (SIGTERM, SIGUSR1, STOP_REQUESTED) resumes on a rerun"
    if plan.jobs is None:
        return False, (
            f"a job of {fmt_hours(limit)} does not cover start-up, load, one checkpoint and the stop margin "
            f"({margin:g} s): raise cluster.slurm.train.runtime_min"
        )
    cost = f"a stop costs at most {fmt_hours(plan.stop_cost_s)} (margin, stop checkpoint, restart)"
    if 0 < margin < work:
        return False, (
            f"cluster.slurm.train.stop_margin_s {margin:g} s is less than a stop's work ({work:.0f} s: the longest "
            "step, a validation pass and one checkpoint): the time limit would kill the stop checkpoint; raise it"
        )
    if plan.jobs > plan.max_jobs:
        return False, (
            f"{plan.jobs} jobs of {fmt_hours(limit)} needed, more than cluster.slurm.train.max_jobs "
            f"{plan.max_jobs}: raise max_jobs or runtime_min"
        )
    if margin == 0 and plan.jobs > 1:
        return False, f"{plan.jobs} jobs needed but stop_margin_s is 0 (no timed stop): set a margin"
    return True, f"{plan.jobs} job(s) of {fmt_hours(limit)} (at most {plan.max_jobs}); {cost}"


def check_budget(fc: Forecast | None, max_gpu_hours: float | None, max_kwh: float | None) -> tuple[bool, str]:
    """(within budget, detail) for gate.max_gpu_hours and gate.max_kwh."""
    if fc is None:
        if max_gpu_hours or max_kwh:
            return False, (
                "no forecast (see the forecast section), so gate.max_gpu_hours / gate.max_kwh cannot be checked"
            )
        return True, "no forecast; no budget set"
    shown = f"forecast {fmt_hours(fc.wall_s)} wall, {fc.gpu_hours:.4g} GPU-hours" + (
        f", {fc.kwh:.4g} kWh" if fc.kwh is not None else ""
    )
    over = []
    if max_gpu_hours and fc.gpu_hours > max_gpu_hours:
        over.append(f"{fc.gpu_hours:.4g} GPU-hours > gate.max_gpu_hours {max_gpu_hours:g}")
    if max_kwh:
        if fc.kwh is None:
            over.append(f"no energy forecast (no triage table) to check gate.max_kwh {max_kwh:g}")
        elif fc.kwh > max_kwh:
            over.append(f"{fc.kwh:.4g} kWh > gate.max_kwh {max_kwh:g}")
    limits = [f"gate.max_gpu_hours {max_gpu_hours:g}"] if max_gpu_hours else []
    limits += [f"gate.max_kwh {max_kwh:g}"] if max_kwh else []
    if over:
        return False, f"{shown}: " + "; ".join(over)
    return True, f"{shown}" + (f" (within {', '.join(limits)})" if limits else " (no budget set)")

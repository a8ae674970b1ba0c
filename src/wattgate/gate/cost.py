"""The gate's cost section: the train job's forecast (wall time, GPU-hours, kWh) and, when the ranks' step
sequences differ, where the run would hang and what that would have cost (wattgate/forecast/)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wattgate.durations import fmt_hours
from wattgate.forecast.failure import failure_cost, first_divergence
from wattgate.forecast.throughput import (
    Throughput,
    flops_throughput,
    host_matmul_flops,
    host_matmul_throughput,
    measured_record,
    measured_throughput,
)
from wattgate.forecast.walltime import (
    FORWARD_SHARE,
    PlanCosts,
    Settings,
    check_budget,
    check_jobs,
    forecast,
    job_plan,
    per_context_rank,
    plan_step_costs,
    step_rank_costs,
    table_levels,
)
from wattgate.ledger import read_ledger
from wattgate.config import context_degree, world_size
from wattgate.errors import InputError
from wattgate.cadence import Cadence, eval_steps
from wattgate.gate.checks import Check
from wattgate.gate.validation_checks import validation_divergence
from wattgate.gate.inputs import GateInputs
from wattgate.gate.memory import checkpoint_bytes, checkpoint_source
from wattgate.model_spec import DTYPE_BYTES, ModelSpec, export_dtype_name
from wattgate.gpus import is_cpu, peak_bf16_flops
from wattgate.triage_tables import TriageSettings
from wattgate.records.gate import Divergence, Failure, Forecast, GateReport, LastRunWait
from wattgate.records.run_config import RunConfig


def forecast_settings(config: RunConfig, spec: ModelSpec) -> Settings:
    cluster, t = config.cluster, config.train
    source = checkpoint_source(config)
    load_bytes = 0 if source is None else (source.file_bytes or spec.num_params * DTYPE_BYTES[source.dtype])
    slurm = cluster.launcher != "local"
    return Settings(
        world_size=world_size(config),
        on_gpu=not is_cpu(cluster.gpu_model),
        checkpoint_every=t.checkpoint_every,
        checkpoint_at_epoch_end=t.checkpoint_at_epoch_end,
        checkpoint_bytes=checkpoint_bytes(spec),
        export_bytes=spec.num_params * DTYPE_BYTES[export_dtype_name(config)],
        load_bytes=load_bytes,
        storage_gbps=cluster.storage_gbps,
        collective_timeout_s=t.collective_timeout_s,
        job_limit_s=cluster.slurm.train.runtime_min * 60.0 if slurm else None,
    )


def throughput(config: RunConfig, spec: ModelSpec, table) -> tuple[Throughput | None, str]:
    """The best throughput source: a measured run in the ledger, the calibrated matmul rate, the datasheet, and on
    CPU the host's own matmul rate."""
    cluster, t = config.cluster, config.train
    records = read_ledger(Path(config.forecast.ledger))
    context = context_degree(config)
    measured = measured_throughput(
        records, spec.shape(), world_size(config), cluster.gpu_model, t.seq_len, t.micro_batch_size, context
    )
    if measured is not None:
        return measured, ""
    mfu = config.forecast.assumed_mfu
    calibrated = ((table.phases or {}).get("compute") or {}).get("matmul_tflops") if table is not None else None
    if calibrated:
        return flops_throughput(
            spec.num_params,
            float(calibrated) * 1e12,
            mfu,
            "calibrated",
            f"{calibrated:g} TFLOP/s bf16 matmul measured by `wattgate calibrate` x forecast.assumed_mfu {mfu:g}",
        ), ""
    peak = peak_bf16_flops(cluster.gpu_model)
    if peak:
        return flops_throughput(
            spec.num_params,
            peak,
            mfu,
            "analytic",
            f"datasheet {peak / 1e12:g} TFLOP/s bf16 x forecast.assumed_mfu {mfu:g}",
        ), ""
    if is_cpu(cluster.gpu_model):  # ranks compute on the host: time its matmul rate (the best of ~0.1 s)
        flops = host_matmul_flops(budget_s=0.1)  # tens of repeats: enough for a best-of; the gate's 5 s target
        return host_matmul_throughput(spec.num_params, cluster.gpus_per_node, mfu, flops), ""
    return None, (
        f"no earlier run of this model shape on {world_size(config)} x {cluster.gpu_model}"
        + (f" at parallel.context {context}" if context > 1 else "")
        + f" in "
        f"{config.forecast.ledger} and no peak FLOP/s for {cluster.gpu_model}: train once "
        "(it appends its throughput) and rerun the gate"
    )


def last_run_wait(config: RunConfig, spec: ModelSpec) -> LastRunWait | None:
    """gate.json's `last_run_wait`: how much of the last run's time went to waiting for stragglers, as its report
    recorded it in the ledger (ledger.record_wait), for the run the forecast measures from (the newest of this
    model shape, world size, context degree and GPU model); None when the ledger has no such run."""
    cluster, t = config.cluster, config.train
    records = read_ledger(Path(config.forecast.ledger))
    r = measured_record(
        records,
        spec.shape(),
        world_size(config),
        cluster.gpu_model,
        t.seq_len,
        t.micro_batch_size,
        context_degree(config),
    )
    if r is None:
        return None
    hours, share, source = r.wait_hours, r.wait_share, r.wait_source
    unit = "rank-hours" if (source or "").startswith("watcher") else "GPU-hours"
    run = f"Last run in the ledger ({r.run_name!r}, {r.world_size} x {r.gpu_model})"
    if hours is None:
        line = f"{run}: its time lost to waiting for stragglers is not recorded (its run report adds it)."
    elif hours == 0:
        line = f"{run}: no time lost to waiting for stragglers ({source})."
    else:
        of = f"{100 * share:.3g}% of its time, " if share is not None else ""
        line = f"{run}: time lost to waiting for stragglers: {of}{hours:.4g} {unit} ({source})."
    return LastRunWait(run_name=r.run_name, wait_hours=hours, wait_share=share, unit=unit, source=source, line=line)


def triage_table(config: RunConfig):
    """The triage table the run would be triaged with, for the energy levels; None when there is none (cpu)."""
    settings = TriageSettings.merge(config)
    if not settings.has_table:
        return None
    try:
        return settings.table()
    except InputError:
        return None


@dataclass(frozen=True)
class CostSection:
    """gate.json's cost section: the forecast (or why there is none), the failure the gate prevented, and the
    ledger's last run's time lost to waiting."""

    forecast: Forecast | None = None
    forecast_unavailable: str | None = None
    failure: Failure | None = None
    last_run_wait: LastRunWait | None = None

    @classmethod
    def of(cls, report: GateReport) -> CostSection:
        return cls(report.forecast, report.forecast_unavailable, report.failure, report.last_run_wait)


def cost_section(inputs: GateInputs, spec: ModelSpec, equal_steps: Check) -> tuple[CostSection, Check]:
    """(gate.json's "forecast", "failure" and "last_run_wait" entries, the budget check)."""
    config, plan, packs = inputs.config, inputs.plan, inputs.packs
    world = plan.world_size
    wait = last_run_wait(config, spec)
    g = config.gate
    if len(packs) == 0 or packs.rank.min() < 0 or packs.rank.max() >= world:
        why = "the plan has no packs or ranks out of range (see equal_steps)"
        return CostSection(forecast_unavailable=why, last_run_wait=wait), Check(
            "budget", not (g.max_gpu_hours or g.max_kwh), why
        )
    costs = with_validation(plan_step_costs(packs, plan, config.train.max_steps, context_degree(config)), inputs)
    table = triage_table(config)
    tp, why = throughput(config, spec, table)
    settings = forecast_settings(config, spec)
    fc = None if tp is None else forecast(costs, tp, settings, table_levels(table) if table is not None else None)
    failure = None
    if not equal_steps.passed:
        div = first_divergence(packs.epoch, packs.step, packs.micro, packs.rank, world)
        failure = Failure(
            divergence=div,
            cost=None,
            line="every rank runs the same (epoch, step, micro) sequence: equal_steps failed for "
            "another reason (see its detail), not one that hangs a collective",
        )
        if div is not None:
            if fc is not None:
                cost = failure_cost(div, costs, fc, settings)
                failure = failure.replace(cost=cost, line=cost.line)
            else:
                failure = failure.replace(
                    line=f"would hang at epoch {div.epoch} step {div.step + 1} of "
                    f"{div.steps_in_epoch} (micro-batch {div.micro + 1}); its cost "
                    f"needs a forecast ({why})"
                )
    elif (vdiv := validation_divergence_at(inputs, costs)) is not None:
        failure = validation_failure(vdiv, costs, fc, settings, why)
    passed, detail = check_budget(fc, g.max_gpu_hours, g.max_kwh)
    if fc is not None:
        train_job = config.cluster.slurm.train
        fc = fc.replace(jobs=job_plan(fc, costs, settings.job_limit_s, train_job.stop_margin_s, train_job.max_jobs))
    out = CostSection(forecast=fc, forecast_unavailable=why or None, failure=failure, last_run_wait=wait)
    return out, Check("budget", passed, detail)


def jobs_check(cost: CostSection) -> Check:
    """The gate's `jobs` check: how many Slurm jobs the run takes and what a stop costs (forecast `jobs`)."""
    return Check("jobs", *check_jobs(cost.forecast.jobs if cost.forecast else None))


def with_validation(costs: PlanCosts, inputs: GateInputs) -> PlanCosts:
    """The plan's costs with its validation passes: after which steps (wattgate.cadence) and what one costs."""
    v, plan = inputs.validation, inputs.plan
    if v is None or v.packs is None or not len(v.packs) or v.packs.rank.max() >= plan.world_size:
        return costs
    per_rank, _ = step_rank_costs(
        dataclasses.replace(v.packs, step=v.packs.micro, micro=np.zeros_like(v.packs.micro)),
        plan.world_size,
        plan.attn_weight,
    )  # one row per validation micro-batch: each is a collective-bounded unit, like a step
    cadence = Cadence.from_train(inputs.config.train, validation=True)
    steps = eval_steps(len(costs.step_max_cost), costs.epoch_ends, cadence)
    # validation rows are split over the context ranks like training rows: a launched rank's share
    pass_cost = float(per_context_rank(per_rank, context_degree(inputs.config)).max(axis=1).sum()) * FORWARD_SHARE
    return dataclasses.replace(costs, eval_steps=tuple(steps), eval_pass_cost=pass_cost)


def validation_divergence_at(inputs: GateInputs, costs: PlanCosts) -> Divergence | None:
    """Where an uneven validation pass would hang: the first pass (its step) and the micro-batch only some ranks
    run; None when the ranks' validation counts agree (or there is no pass to run)."""
    v = inputs.validation
    if v is None or v.packs is None or not len(v.packs) or not costs.eval_steps:
        return None
    div = validation_divergence(v.packs, inputs.plan.world_size)
    if div is None:
        return None
    g = costs.eval_steps[0]
    return Divergence(
        epoch=int(costs.step_epoch[g - 1]),
        step=g,
        micro=div.micro,
        steps_in_epoch=int((costs.step_epoch == costs.step_epoch[g - 1]).sum()),
        ranks_with=div.ranks_with,
        ranks_without=div.ranks_without,
        per_rank=div.per_rank,
        step_in_epoch=int(costs.step_in_epoch[g - 1]),
    )


def validation_failure(
    vdiv: Divergence, costs: PlanCosts, fc: Forecast | None, settings: Settings, why: str
) -> Failure:
    """gate.json's `failure` for an uneven validation pass: where, and what reaching it and waiting would cost."""
    # validation_divergence_at sets both
    assert vdiv.per_rank is not None and vdiv.step_in_epoch is not None
    where = (
        f"would hang in the first validation pass, after step {vdiv.step} (epoch {vdiv.epoch}): validation "
        f"micro-batches per rank {list(vdiv.per_rank)}; rank(s) {', '.join(map(str, vdiv.ranks_with))} run "
        f"micro-batch {vdiv.micro + 1}, rank(s) {', '.join(map(str, vdiv.ranks_without))} never do"
    )
    failure = Failure(
        divergence=vdiv.replace(phase="eval"), cost=None, line=f"{where}; its cost needs a forecast ({why})"
    )
    if fc is not None:
        # reaching the pass: every step up to and including the one it follows (the pass itself is not counted)
        reach = Divergence(
            epoch=vdiv.epoch,
            step=vdiv.step_in_epoch + 1,
            micro=0,
            steps_in_epoch=vdiv.steps_in_epoch,
            ranks_with=vdiv.ranks_with,
            ranks_without=vdiv.ranks_without,
        )
        cost = failure_cost(reach, costs, fc, settings, where)
        failure = failure.replace(cost=cost, line=cost.line)
    return failure


def cost_markdown(cost: CostSection) -> list[str]:
    """gate.md's forecast and failure-cost sections."""
    lines = ["", "## Forecast of the train job", ""]
    fc = cost.forecast
    if fc is None:
        lines.append(f"Not available: {cost.forecast_unavailable}.")
    else:
        tp, terms = fc.throughput, fc.terms_s
        lines += [
            f"**{fmt_hours(fc.wall_s)} wall, {fc.gpu_hours:.4g} GPU-hours on {fc.world_size} GPUs"
            + (
                f", {fc.kwh:.4g} kWh (GPUs only)"
                if fc.kwh is not None
                else ", energy not forecast (no triage table for this GPU model)"
            )
            + "**",
            "",
            f"Throughput: {tp.source}: {tp.detail}; {tp.cost_per_s:.6g} cost units/s per rank "
            "(tokens + attn_weight x squared document lengths, the planner's cost).",
            "",
            "| term | seconds | how |",
            "|---|---:|---|",
            f"| start-up | {terms.startup_s:.1f} | {fc.startup_source} |",
            f"| load | {terms.load_s:.1f} | {fc.load_source} |",
            f"| warm-up | {terms.warmup_s:.1f} | the first steps' one-off cost "
            f"({'measured' if tp.warmup_s is not None else 'not known before a run'}) |",
            f"| {fc.steps} optimizer steps | {terms.steps_s:.1f} | each step's costliest rank / throughput |",
            f"| {fc.validations} validation passes | {terms.validation_s:.1f} | each "
            "pass's micro-batches' costliest ranks x 1/3 (forward only) / throughput |",
            f"| {fc.checkpoints} checkpoints | {terms.checkpoints_s:.1f} | "
            f"{fc.checkpoint_gib:.3g} GiB each at {fc.storage_gbps:.3g} GB/s ({fc.storage_source}) |",
            f"| export | {terms.export_s:.1f} | {fc.export_gib:.3g} GiB at {fc.storage_gbps:.3g} GB/s |",
            f"| **total** | **{fc.wall_s:.1f}** | |",
        ]
        if fc.energy:
            e = fc.energy
            lines += [
                "",
                f"Energy: steps at {e.compute_w:.0f} W, checkpoints at the wait level {e.wait_w:.0f} W, "
                f"the rest at idle {e.idle_w:.0f} W per GPU ({e.source}).",
            ]
        jobs = fc.jobs
        if jobs and jobs.job_limit_s is not None:
            lines += [
                "",
                f"Slurm jobs: {jobs.jobs if jobs.jobs is not None else 'none fits'} of "
                f"{fmt_hours(jobs.job_limit_s)} (cluster.slurm.train.runtime_min), each stopping "
                f"{jobs.stop_margin_s:g} s before its limit and resumed by the next (a stop's work: "
                f"{jobs.stop_work_s:.0f} s); a stop costs at most {fmt_hours(jobs.stop_cost_s)}.",
            ]
    if cost.last_run_wait:
        lines += ["", cost.last_run_wait.line]
    if cost.failure:
        lines += ["", "## Cost of the failure the gate prevented", "", cost.failure.line]
    return lines

"""The gate's cost section: the train job's forecast (wall time, GPU-hours, kWh) and, when the ranks' step
sequences differ, where the run would hang and what that would have cost (wattgate/forecast/)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path

import numpy as np

from wattgate.durations import fmt_hours
from wattgate.forecast.failure import failure_cost, failure_line, first_divergence
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
    plan_step_costs,
    step_rank_costs,
    table_levels,
)
from wattgate.ledger import read_ledger
from wattgate.config import world_size
from wattgate.errors import InputError
from wattgate.cadence import Cadence, eval_steps
from wattgate.gate.checks import Check
from wattgate.gate.validation_checks import validation_divergence
from wattgate.gate.inputs import GateInputs
from wattgate.gate.memory import checkpoint_bytes, checkpoint_source
from wattgate.model_spec import DTYPE_BYTES, ModelSpec, export_dtype_name
from wattgate.gpus import is_cpu, peak_bf16_flops
from wattgate.triage_tables import TriageSettings


def forecast_settings(config: dict, spec: ModelSpec) -> Settings:
    cluster, t = config["cluster"], config["train"]
    source = checkpoint_source(config)
    load_bytes = 0 if source is None else (source.file_bytes or spec.num_params * DTYPE_BYTES[source.dtype])
    slurm = cluster["launcher"] != "local"
    return Settings(
        world_size=world_size(config),
        on_gpu=not is_cpu(cluster["gpu_model"]),
        checkpoint_every=t["checkpoint_every"],
        checkpoint_at_epoch_end=t["checkpoint_at_epoch_end"],
        checkpoint_bytes=checkpoint_bytes(spec),
        export_bytes=spec.num_params * DTYPE_BYTES[export_dtype_name(config)],
        load_bytes=load_bytes,
        storage_gbps=cluster["storage_gbps"],
        collective_timeout_s=t["collective_timeout_s"],
        job_limit_s=cluster["slurm"]["train"]["runtime_min"] * 60.0 if slurm else None,
    )


def throughput(config: dict, spec: ModelSpec, table) -> tuple[Throughput | None, str]:
    """The best throughput source: a measured run in the ledger, the calibrated matmul rate, the datasheet, and on
    CPU the host's own matmul rate."""
    cluster, t = config["cluster"], config["train"]
    records = read_ledger(Path(config["forecast"]["ledger"]))
    measured = measured_throughput(
        records, asdict(spec), world_size(config), cluster["gpu_model"], t["seq_len"], t["micro_batch_size"]
    )
    if measured is not None:
        return measured, ""
    mfu = config["forecast"]["assumed_mfu"]
    calibrated = ((table.phases or {}).get("compute") or {}).get("matmul_tflops") if table is not None else None
    if calibrated:
        return flops_throughput(
            spec.num_params,
            float(calibrated) * 1e12,
            mfu,
            "calibrated",
            f"{calibrated:g} TFLOP/s bf16 matmul measured by `wattgate calibrate` x forecast.assumed_mfu {mfu:g}",
        ), ""
    peak = peak_bf16_flops(cluster["gpu_model"])
    if peak:
        return flops_throughput(
            spec.num_params,
            peak,
            mfu,
            "analytic",
            f"datasheet {peak / 1e12:g} TFLOP/s bf16 x forecast.assumed_mfu {mfu:g}",
        ), ""
    if is_cpu(cluster["gpu_model"]):  # ranks compute on the host: time its matmul rate (the best of ~0.1 s)
        flops = host_matmul_flops(budget_s=0.1)  # tens of repeats: enough for a best-of; the gate's 5 s target
        return host_matmul_throughput(spec.num_params, cluster["gpus_per_node"], mfu, flops), ""
    return None, (
        f"no earlier run of this model shape on {world_size(config)} x {cluster['gpu_model']} in "
        f"{config['forecast']['ledger']} and no peak FLOP/s for {cluster['gpu_model']}: train once "
        "(it appends its throughput) and rerun the gate"
    )


def last_run_wait(config: dict, spec: ModelSpec) -> dict | None:
    """gate.json's `last_run_wait`: how much of the last run's time went to waiting for stragglers, as its report
    recorded it in the ledger (ledger.record_wait), for the run the forecast measures from (the newest of this
    model shape, world size and GPU model); None when the ledger has no such run."""
    cluster, t = config["cluster"], config["train"]
    records = read_ledger(Path(config["forecast"]["ledger"]))
    r = measured_record(
        records, asdict(spec), world_size(config), cluster["gpu_model"], t["seq_len"], t["micro_batch_size"]
    )
    if r is None:
        return None
    hours, share, source = r.get("wait_hours"), r.get("wait_share"), r.get("wait_source")
    unit = "rank-hours" if str(source or "").startswith("watcher") else "GPU-hours"
    run = f"Last run in the ledger ({r.get('run_name')!r}, {r.get('world_size')} x {r.get('gpu_model')})"
    if hours is None:
        line = f"{run}: its time lost to waiting for stragglers is not recorded (its run report adds it)."
    elif hours == 0:
        line = f"{run}: no time lost to waiting for stragglers ({source})."
    else:
        of = f"{100 * share:.3g}% of its time, " if share is not None else ""
        line = f"{run}: time lost to waiting for stragglers: {of}{hours:.4g} {unit} ({source})."
    return {
        "run_name": r.get("run_name"),
        "wait_hours": hours,
        "wait_share": share,
        "unit": unit,
        "source": source,
        "line": line,
    }


def triage_table(config: dict):
    """The triage table the run would be triaged with, for the energy levels; None when there is none (cpu)."""
    settings = TriageSettings.merge(config)
    if not settings.has_table:
        return None
    try:
        return settings.table()
    except InputError:
        return None


def cost_section(inputs: GateInputs, spec: ModelSpec, equal_steps: Check) -> tuple[dict, Check]:
    """(gate.json's "forecast", "failure" and "last_run_wait" entries, the budget check)."""
    config, plan, packs = inputs.config, inputs.plan, inputs.packs
    world = plan["world_size"]
    out = {
        "forecast": None,
        "forecast_unavailable": None,
        "failure": None,
        "last_run_wait": last_run_wait(config, spec),
    }
    g = config["gate"]
    if len(packs) == 0 or packs.rank.min() < 0 or packs.rank.max() >= world:
        out["forecast_unavailable"] = "the plan has no packs or ranks out of range (see equal_steps)"
        return out, Check("budget", not (g["max_gpu_hours"] or g["max_kwh"]), out["forecast_unavailable"])
    costs = with_validation(plan_step_costs(packs, plan, config, config["train"].get("max_steps")), inputs)
    table = triage_table(config)
    tp, why = throughput(config, spec, table)
    settings = forecast_settings(config, spec)
    if tp is None:
        out["forecast_unavailable"] = why
    else:
        out["forecast"] = forecast(costs, tp, settings, table_levels(table) if table is not None else None)
    if not equal_steps.passed:
        div = first_divergence(packs.epoch, packs.step, packs.micro, packs.rank, world)
        out["failure"] = {
            "divergence": div,
            "cost": None,
            "line": "every rank runs the same (epoch, step, micro) sequence: equal_steps failed for "
            "another reason (see its detail), not one that hangs a collective",
        }
        if div is not None:
            if out["forecast"] is not None:
                out["failure"]["cost"] = failure_cost(div, costs, out["forecast"], settings)
                out["failure"]["line"] = out["failure"]["cost"]["line"]
            else:
                out["failure"]["line"] = (
                    f"would hang at epoch {div['epoch']} step {div['step'] + 1} of "
                    f"{div['steps_in_epoch']} (micro-batch {div['micro'] + 1}); its cost "
                    f"needs a forecast ({why})"
                )
    elif (vdiv := validation_divergence_at(inputs, costs)) is not None:
        out["failure"] = validation_failure(vdiv, costs, out["forecast"], settings, why)
    passed, detail = check_budget(out["forecast"], g["max_gpu_hours"], g["max_kwh"])
    if out["forecast"] is not None:
        train_job = config["cluster"]["slurm"]["train"]
        out["forecast"]["jobs"] = job_plan(
            out["forecast"], costs, settings.job_limit_s, train_job["stop_margin_s"], train_job["max_jobs"]
        )
    return out, Check("budget", passed, detail)


def jobs_check(cost: dict) -> Check:
    """The gate's `jobs` check: how many Slurm jobs the run takes and what a stop costs (forecast `jobs`)."""
    fc = cost.get("forecast")
    return Check("jobs", *check_jobs(fc.get("jobs") if fc else None))


def with_validation(costs: PlanCosts, inputs: GateInputs) -> PlanCosts:
    """The plan's costs with its validation passes: after which steps (wattgate.cadence) and what one costs."""
    v, plan = inputs.validation, inputs.plan
    if v is None or v.packs is None or not len(v.packs) or v.packs.rank.max() >= plan["world_size"]:
        return costs
    per_rank, _ = step_rank_costs(
        dataclasses.replace(v.packs, step=v.packs.micro, micro=np.zeros_like(v.packs.micro)),
        plan["world_size"],
        float(plan.get("attn_weight", inputs.config["pack"]["attn_weight"])),
    )  # one row per validation micro-batch: each is a collective-bounded unit, like a step
    cadence = Cadence.from_train(inputs.config["train"], validation=True)
    steps = eval_steps(len(costs.step_max_cost), costs.epoch_ends, cadence)
    return dataclasses.replace(
        costs, eval_steps=tuple(steps), eval_pass_cost=float(per_rank.max(axis=1).sum()) * FORWARD_SHARE
    )


def validation_divergence_at(inputs: GateInputs, costs: PlanCosts) -> dict | None:
    """Where an uneven validation pass would hang: the first pass (its step) and the micro-batch only some ranks
    run; None when the ranks' validation counts agree (or there is no pass to run)."""
    v = inputs.validation
    if v is None or v.packs is None or not len(v.packs) or not costs.eval_steps:
        return None
    div = validation_divergence(v.packs, inputs.plan["world_size"])
    if div is None:
        return None
    g = costs.eval_steps[0]
    return div | {
        "step": g,
        "epoch": int(costs.step_epoch[g - 1]),
        "step_in_epoch": int(costs.step_in_epoch[g - 1]),
        "steps_in_epoch": int((costs.step_epoch == costs.step_epoch[g - 1]).sum()),
    }


def validation_failure(vdiv: dict, costs: PlanCosts, fc: dict | None, settings: Settings, why: str) -> dict:
    """gate.json's `failure` for an uneven validation pass: where, and what reaching it and waiting would cost."""
    where = (
        f"would hang in the first validation pass, after step {vdiv['step']} (epoch {vdiv['epoch']}): validation "
        f"micro-batches per rank {vdiv['per_rank']}; rank(s) {', '.join(map(str, vdiv['ranks_with']))} run "
        f"micro-batch {vdiv['micro'] + 1}, rank(s) {', '.join(map(str, vdiv['ranks_without']))} never do"
    )
    failure = {
        "divergence": vdiv | {"phase": "eval"},
        "cost": None,
        "line": f"{where}; its cost needs a forecast ({why})",
    }
    if fc is not None:
        # reaching the pass: every step up to and including the one it follows (the pass itself is not counted)
        div = {"epoch": vdiv["epoch"], "step": vdiv["step_in_epoch"] + 1}
        ranks = {k: vdiv[k] for k in ("ranks_with", "ranks_without")}  # failure_cost's own line names them
        cost = failure_cost(div | {"micro": 0, "steps_in_epoch": vdiv["steps_in_epoch"]} | ranks, costs, fc, settings)
        cost["line"] = failure_line(div, cost, where)
        failure.update(cost=cost, line=cost["line"])
    return failure


def cost_markdown(report: dict) -> list[str]:
    """gate.md's forecast and failure-cost sections."""
    lines = ["", "## Forecast of the train job", ""]
    fc = report.get("forecast")
    if fc is None:
        lines.append(f"Not available: {report.get('forecast_unavailable')}.")
    else:
        tp = fc["throughput"]
        lines += [
            f"**{fmt_hours(fc['wall_s'])} wall, {fc['gpu_hours']:.4g} GPU-hours on {fc['world_size']} GPUs"
            + (
                f", {fc['kwh']:.4g} kWh (GPUs only)"
                if fc["kwh"] is not None
                else ", energy not forecast (no triage table for this GPU model)"
            )
            + "**",
            "",
            f"Throughput: {tp['source']}: {tp['detail']}; {tp['cost_per_s']:.6g} cost units/s per rank "
            "(tokens + attn_weight x squared document lengths, the planner's cost).",
            "",
            "| term | seconds | how |",
            "|---|---:|---|",
            f"| start-up | {fc['terms_s']['startup_s']:.1f} | {fc['startup_source']} |",
            f"| load | {fc['terms_s']['load_s']:.1f} | {fc['load_source']} |",
            f"| warm-up | {fc['terms_s']['warmup_s']:.1f} | the first steps' one-off cost "
            f"({'measured' if fc['throughput']['warmup_s'] is not None else 'not known before a run'}) |",
            f"| {fc['steps']} optimizer steps | {fc['terms_s']['steps_s']:.1f} | each step's costliest rank / "
            "throughput |",
            f"| {fc.get('validations', 0)} validation passes | {fc['terms_s'].get('validation_s', 0.0):.1f} | each "
            "pass's micro-batches' costliest ranks x 1/3 (forward only) / throughput |",
            f"| {fc['checkpoints']} checkpoints | {fc['terms_s']['checkpoints_s']:.1f} | "
            f"{fc['checkpoint_gib']:.3g} GiB each at {fc['storage_gbps']:.3g} GB/s ({fc['storage_source']}) |",
            f"| export | {fc['terms_s']['export_s']:.1f} | {fc['export_gib']:.3g} GiB at "
            f"{fc['storage_gbps']:.3g} GB/s |",
            f"| **total** | **{fc['wall_s']:.1f}** | |",
        ]
        if fc["energy"]:
            e = fc["energy"]
            lines += [
                "",
                f"Energy: steps at {e['compute_w']:.0f} W, checkpoints at the wait level {e['wait_w']:.0f} W, "
                f"the rest at idle {e['idle_w']:.0f} W per GPU ({e['source']}).",
            ]
        jobs = fc.get("jobs")
        if jobs and jobs["job_limit_s"] is not None:
            lines += [
                "",
                f"Slurm jobs: {jobs['jobs'] if jobs['jobs'] is not None else 'none fits'} of "
                f"{fmt_hours(jobs['job_limit_s'])} (cluster.slurm.train.runtime_min), each stopping "
                f"{jobs['stop_margin_s']:g} s before its limit and resumed by the next (a stop's work: "
                f"{jobs['stop_work_s']:.0f} s); a stop costs at most {fmt_hours(jobs['stop_cost_s'])}.",
            ]
    if report.get("last_run_wait"):
        lines += ["", report["last_run_wait"]["line"]]
    failure = report.get("failure")
    if failure:
        lines += ["", "## Cost of the failure the gate prevented", "", failure["line"]]
    return lines

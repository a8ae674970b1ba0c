"""The end of a run on rank 0: TRAINED (losses, throughput, memory peaks per phase, what was trained) and the
throughput ledger's line for the gate's forecast of the next run of the same shape. Each function reads a
finished train/loop.py Trainer (`t`; not imported here: the Trainer calls these)."""

from __future__ import annotations

from pathlib import Path

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.durations import duration
from wattgate.config import config_sha256, context_degree, expert_degree, replicate_degree
from wattgate.forecast.walltime import plan_step_costs
from wattgate.identity import train_identity
from wattgate.ledger import MeasuredSteps, RunShape, StorageWrites, append_ledger, run_record
from wattgate.model_spec import load_model_spec
from wattgate.records.trained import EXPORT, LOAD, Trained
from wattgate.run_files import PACKS, TRAINED, TRAINED_MD, read_packs
from wattgate.train.launch import allocator_record
from wattgate.train.mesh import mesh_layout
from wattgate.train.metrics import (
    folder_bytes,
    loss_summary,
    memory_summary,
    model_flops_utilization,
    process_age_s,
    validation_summary,
)


def write_trained(t, per_rank_memory: list[dict]) -> Trained:
    """TRAINED (rank 0): losses, throughput, and each rank's memory peak per phase with load/export times."""
    log, train, elapsed = t.log, t.train, t.elapsed
    log.metrics.flush()
    memory = memory_summary(per_rank_memory)
    worst = memory.max_over_ranks
    first, final = loss_summary(log.metrics.rows)
    tokens_per_s = log.tokens_done / elapsed if elapsed > 0 else None
    cuda = t.device.type == "cuda"
    summary = Trained(
        first_loss=first,
        final_loss=final,
        steps=t.total,
        resumed_from_step=t.start,
        world_size=t.world,
        mesh=mesh_layout(t.world, replicate_degree(t.config), expert_degree(t.config), context_degree(t.config))
        or None,
        device=t.device.type,
        params=t.n_params,
        tokens_per_s=tokens_per_s,
        data_cache=train.data_cache,
        data_copy_s=t.copy_s,
        wall_s=elapsed,
        load_s=worst[LOAD].seconds,
        export_s=worst[EXPORT].seconds,
        export_dtype=t.final_dtype,
        memory=memory,
        startup_s=round(t.startup_s, 3),
        allocator=allocator_record(),
        checkpoints=log.checkpoints,
        checkpoint_s=round(log.checkpoint_s, 3),
        validation=validation_summary(t.evals.rows if t.evals is not None else [], t.exported_step, train.export_from),
        job_s=round(process_age_s(), 3),  # rank 0's whole process, what the forecast predicts
        # what was trained: the config's hash (the gate's marker names the one it checked) and the settings
        # that change the result, readable without the config
        config_sha256=config_sha256(t.config),
        settings=train_identity(t.config.train),
        nonfinite_skipped_steps=t.skipped_steps,
        mfu=model_flops_utilization(tokens_per_s or 0, t.n_params, t.world, t.config.cluster.gpu_model)
        if cuda
        else None,
        # every phase has its CUDA peak on CUDA ranks (PhaseMemory)
        peak_memory_gib=max(p.cuda_peak_gib for p in worst.values() if p.cuda_peak_gib is not None) if cuda else None,
    )
    # a diverged loss is NaN: null. The readable summary first: TRAINED is the stage's declared output, last.
    write_bytes_atomic(t.paths.out / TRAINED_MD, trained_text(summary, t.paths.out).encode())
    write_json_atomic(t.paths.out / TRAINED, summary.to_json(), nonfinite="null")
    losses = f"loss {first:.4f} -> {final:.4f}" if first is not None else "no steps taken"
    v = summary.validation
    valid = f"; validation {v.final_loss:.4f} (best {v.best_loss:.4f} at step {v.best_step})" if v else ""
    print(
        f"train: done: {losses}{valid}, {tokens_per_s or 0:.0f} tok/s; peak host RSS per rank "
        + ", ".join(f"{p} {worst[p].host_peak_gib:.2f} GiB" for p in worst)
        + f"; export {summary.export_s:.1f} s -> {t.paths.out}",
        flush=True,
    )
    return summary


def _number(value, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def trained_text(summary: Trained, run: Path) -> str:
    """TRAINED.md: what TRAINED says, for a person (the report has the rest)."""
    v = summary.validation
    lines = [
        f"# Trained: {run.name}",
        "",
        f"- steps: {_number(summary.steps, 'd')} on {summary.world_size} {summary.device} rank(s)"
        + (f" (mesh {mesh_text(summary.mesh)})" if summary.mesh else "")
        + (f", resumed from step {summary.resumed_from_step}" if summary.resumed_from_step else ""),
        f"- loss: {_number(summary.first_loss, '.4f')} -> {_number(summary.final_loss, '.4f')}",
        f"- throughput: {_number(summary.tokens_per_s, ',.0f', ' tokens/s')}; training time "
        f"{duration(summary.wall_s)}, job time {duration(summary.job_s)}",
    ]
    if v is not None:
        lines.append(
            f"- validation: {_number(v.final_loss, '.4f')} at the end, best {_number(v.best_loss, '.4f')} at step "
            f"{v.best_step}; final/ holds step {v.exported_step} ({v.export_from})"
        )
    if summary.nonfinite_skipped_steps:
        lines.append(f"- steps skipped for a non-finite loss: {summary.nonfinite_skipped_steps}")
    lines += [
        f"- model: {run / 'final'} (Hugging Face safetensors, {summary.export_dtype})",
        f"- config sha256: {summary.config_sha256}",
    ]
    return "\n".join(lines) + "\n"


def mesh_text(mesh: dict[str, int]) -> str:
    """ "dp_replicate 2 x dp_shard 2": the mesh's dimensions in order."""
    return " x ".join(f"{name} {size}" for name, size in mesh.items())


def append_throughput(t, summary: Trained) -> None:
    """One line in the throughput ledger (forecast.ledger): this run's rate in the planner's cost units,
    start-up, load and storage times, for the gate's forecast of the next run of the same shape, world size (the
    launch's, as the gate's world_size(config)), parallel.context and GPU."""
    log, plan, config, start, total = t.log, t.plan, t.config, t.start, t.total
    if total <= start or not log.step_times:
        return
    first = t.first_step  # packs.parquet's first step
    startup_s, load_s, export_s, job_s = summary.startup_s, summary.load_s, summary.export_s, summary.job_s
    # write_trained measures each of them: only a TRAINED read back may lack one
    assert startup_s is not None and load_s is not None and export_s is not None and job_s is not None
    context = context_degree(config)
    # a launched rank's costs (a data rank's over C): the rate is per launched rank, as the gate's forecast reads it
    costs = plan_step_costs(read_packs(t.paths.plan_dir / PACKS), plan, total - first, context)
    record = run_record(
        run_name=config.run_name,
        run=RunShape(
            shape=load_model_spec(config).shape(),
            gpu_model=config.cluster.gpu_model,
            world_size=t.world,  # the ranks (plan.world_size is the data-parallel ranks under parallel.context)
            seq_len=config.train.seq_len,
            micro_batch_size=config.train.micro_batch_size,
            attn_weight=plan.attn_weight,
            context=context,
        ),
        steps=MeasuredSteps(
            costs=costs.step_max_cost[start - first : start - first + len(log.step_times)],
            times=log.step_times,
            tokens=log.tokens_done,
        ),
        writes=StorageWrites(
            checkpoints=log.checkpoints,
            checkpoint_s=log.checkpoint_s,
            checkpoint_bytes=log.checkpoint_bytes,
            export_s=export_s,
            export_bytes=folder_bytes(t.paths.out / "final"),
        ),
        startup_s=startup_s,
        load_s=load_s,
        job_s=job_s,
    )
    append_ledger(Path(config.forecast.ledger), record)

"""`wattgate train`: one process per rank (under torchrun), running exactly its planned micro-batches.

`_run` is the outline of a run: load the sharded model, resume, take the planned steps
(checkpointing on the way), export, summarize. Each part lives in its own module:
distributed (process group), model/weights (build, load, export), data (the plan's batches),
checkpoint (DCP), metrics (step log, memory peaks); wattgate.run_files reads the plan and manifest
and writes the heartbeats and metrics table.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path
from collections.abc import Callable

import torch
import torch.distributed as dist

from wattgate.artifacts import write_json_atomic
from wattgate.data.tokenizer import TOKENIZER_FILES
from wattgate.errors import InputError, StageFailed
from wattgate.forecast import append_ledger, process_age_s, run_record
from wattgate.gate.cost import plan_step_costs
from wattgate.gate.memory import export_dtype_name, load_model_spec
from wattgate.run_files import (
    MANIFEST,
    METRICS,
    PACKS,
    PLAN,
    Heartbeat,
    MetricsTable,
    read_manifest,
    read_packs,
    read_plan,
)
from wattgate.train import checkpoint as ckpt
from wattgate.train.data import DocStore, MicroBatchPlan, build_batch, read_rank_plan
from wattgate.train.distributed import device_uuid, equal_across_ranks, setup_rank
from wattgate.train.identity import run_identity
from wattgate.train.loss import forward_logits, loss_sum, to_tensors
from wattgate.train.metrics import (
    GIB,
    PhaseMemory,
    StepLog,
    folder_bytes,
    memory_summary,
    model_flops_utilization,
)
from wattgate.train.model import count_params, load_sharded_model
from wattgate.train.schedule import learning_rate
from wattgate.train.weights import DTYPES, export_hf_folder


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int
    micro_batch_size: int
    grad_accum: int
    epochs: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    seed: int
    checkpoint_every: int
    checkpoint_keep: int
    checkpoint_at_epoch_end: bool
    collective_timeout_s: float
    attn_implementation: str
    activation_checkpointing: bool
    mixed_precision: bool
    data_cache: str
    local_cache_dir: str | None
    log_every: int
    optimizer: str
    max_steps: int | None
    export_dtype: str
    export_max_shard_gib: float

    @classmethod
    def from_config(cls, config: dict) -> TrainSettings:
        t = config["train"]
        return cls(
            **{
                k: t[k]
                for k in (
                    "seq_len",
                    "micro_batch_size",
                    "grad_accum",
                    "epochs",
                    "lr",
                    "min_lr_ratio",
                    "warmup_steps",
                    "weight_decay",
                    "grad_clip",
                    "seed",
                    "checkpoint_every",
                    "checkpoint_keep",
                    "checkpoint_at_epoch_end",
                    "collective_timeout_s",
                    "attn_implementation",
                    "activation_checkpointing",
                    "data_cache",
                    "local_cache_dir",
                    "log_every",
                    "optimizer",
                    "max_steps",
                    "export_max_shard_gib",
                )
            },
            betas=tuple(t["betas"]),
            mixed_precision=t["mixed_precision"] == "bf16",
            export_dtype=export_dtype_name(config),
        )


def build_optimizer(model, s: TrainSettings) -> torch.optim.Optimizer:
    if s.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, foreach=True)


def lr_at(step: int, s: TrainSettings, total: int) -> float:
    """Linear warmup to lr, then cosine down to lr * min_lr_ratio at the last step (train/schedule.py)."""
    return learning_rate(step, total, s.lr, s.warmup_steps, s.min_lr_ratio)


def stage_local_copy(pretokenized: Path, s: TrainSettings, out: Path) -> tuple[Path, float]:
    """data_cache local: copy the shards to node-local scratch once per node; returns (path, seconds)."""
    if s.data_cache != "local":
        return pretokenized, 0.0
    root = Path(s.local_cache_dir or os.environ.get("TMPDIR") or "/tmp")
    _, manifest = read_manifest(pretokenized)
    dest = root / f"wattgate-{hashlib.sha256(manifest).hexdigest()[:16]}"
    start = time.perf_counter()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (dest / MANIFEST).exists():
        tmp = root / f"{dest.name}.tmp-{os.getpid()}"
        shutil.copytree(pretokenized, tmp, dirs_exist_ok=True)
        if dest.exists():  # another job on this node finished the same copy first
            shutil.rmtree(tmp)
        else:
            tmp.rename(dest)
    dist.barrier()  # local rank 0 copies; the others wait (a barrier across all ranks is simplest)
    return dest, time.perf_counter() - start


def train_step(
    model,
    optimizer,
    batches,
    world: int,
    device: torch.device,
    grad_clip: float,
    on_micro: Callable[[int], None] | None = None,
):
    """One optimizer step over this rank's micro-batches; returns (summed loss, grad norm, host->device s).

    `on_micro(k)` runs as the k-th micro-batch starts (the heartbeat: with the step's planned
    micro-batch count it tells the watcher which rank reached the step's gradient reduction first).

    The loss is normalized by the loss-bearing tokens of the whole global batch (all-reduced), so the
    gradient does not depend on how documents were packed or split over ranks and micro-batches.
    """
    counts = torch.tensor([sum(b.num_loss_tokens for b in batches)], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    # FSDP averages gradients over ranks; x world turns that average into a sum over ranks
    scale = world / max(counts.item(), 1.0)
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    to_device_s = 0.0
    for i, batch in enumerate(batches):
        if on_micro is not None:
            on_micro(i + 1)
        t = time.perf_counter()
        tensors = to_tensors(batch, device)
        to_device_s += time.perf_counter() - t
        model.set_requires_gradient_sync(i == len(batches) - 1)  # reduce-scatter once per step
        summed = loss_sum(forward_logits(model, tensors), tensors["labels"])
        (summed * scale).backward()
        step_loss += summed.detach().double()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2: materialize it on every rank, together
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss.item(), float(grad_norm), to_device_s


def loss_summary(rows: list[dict]) -> dict:
    """First and final step loss (token-weighted over ranks) from metrics rows."""
    per_step: dict[int, list[dict]] = {}
    for row in rows:
        per_step.setdefault(row["step"], []).append(row)

    def step_loss(step_rows):
        return sum(r["loss"] * r["loss_tokens"] for r in step_rows) / max(1, sum(r["loss_tokens"] for r in step_rows))

    if not per_step:
        return {"first_loss": None, "final_loss": None}
    return {"first_loss": step_loss(per_step[min(per_step)]), "final_loss": step_loss(per_step[max(per_step)])}


def group_steps(micro_batches: list[MicroBatchPlan]) -> list[list[MicroBatchPlan]]:
    return [list(g) for _, g in groupby(micro_batches, key=lambda m: (m.epoch, m.step))]


def planned_sequence(micro_batches: list[MicroBatchPlan]) -> list[tuple[int, int, int, int]]:
    """(epoch, step, micro, packs) of every micro-batch in order: the collectives this rank will issue."""
    return [(m.epoch, m.step, m.micro, len(m.packs)) for m in micro_batches]


def first_divergence(sequences: list[list[tuple]]) -> str:
    """Where the ranks' planned sequences first differ, in words."""
    for i in range(max(len(seq) for seq in sequences)):
        items = [seq[i] if i < len(seq) else None for seq in sequences]
        if len(set(items)) > 1:
            said = "; ".join(
                f"rank {r}: "
                + (
                    f"epoch {x[0]} step {x[1] + 1} micro-batch {x[2] + 1} ({x[3]} packs)"
                    if x
                    else "no more micro-batches"
                )
                for r, x in enumerate(items)
            )
            return f"micro-batch #{i + 1} of the run: {said}"
    return "nowhere"


def check_planned_sequences(micro_batches: list[MicroBatchPlan], device: torch.device) -> None:
    """Defense in depth behind the gate: every rank must plan the same sequence of micro-batches.

    Equal totals are not enough (a micro-batch moved from one step to the next keeps them and
    still hangs), so each rank all-reduces a hash of its (epoch, step, micro, packs) sequence;
    on a mismatch the sequences are gathered to name the first divergence.
    """
    sequence = planned_sequence(micro_batches)
    digest = hashlib.sha256(json.dumps(sequence).encode()).digest()
    if equal_across_ranks([int.from_bytes(digest[:7], "little")], device):
        return
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sequence)
    raise StageFailed(
        "planned counts differ across ranks (this would deadlock where they diverge): first at "
        f"{first_divergence(every)}; rerun pack and gate"
    )


def train(config: dict, pretokenized: Path, plan_dir: Path, out: Path) -> dict:
    s = TrainSettings.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    plan, _ = read_plan(plan_dir)
    rank, world, device = setup_rank(s.collective_timeout_s, out)
    try:
        if plan["world_size"] != world:
            raise InputError(
                f"{plan_dir / PLAN}: planned for world size {plan['world_size']}, "
                f"launched with {world}; rerun pack and gate for this launch"
            )
        micro_batches = read_rank_plan(plan_dir, rank)
        if config["train"]["check_planned_counts"]:
            check_planned_sequences(micro_batches, device)
        elif rank == 0:
            print("train: WARNING: train.check_planned_counts is false: uneven plans will hang", file=sys.stderr)
        return _run(config, s, plan, plan_dir, rank, world, device, micro_batches, pretokenized, out)
    finally:
        dist.destroy_process_group()


def resume_checkpoint(out: Path, identity: dict | None, rank: int) -> Path | None:
    """The newest complete checkpoint of this run identity, chosen by rank 0 and broadcast.

    Ranks never pick their own: on a shared filesystem with directory caching two ranks can
    see different newest checkpoints, and the job would hang in its first collective.
    """
    choice: list = [None]
    if rank == 0:
        ckpt.set_aside_mismatched(out / "checkpoints", identity)
        latest = ckpt.latest_complete(out / "checkpoints")
        choice = [str(latest) if latest is not None else None]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] is not None else None


def epoch_end_steps(steps: list[list[MicroBatchPlan]]) -> list[int]:
    """The 1-based global step that ends each epoch."""
    total = len(steps)
    return [g + 1 for g in range(total) if g + 1 == total or steps[g + 1][0].epoch != steps[g][0].epoch]


def export_final(model, s: TrainSettings, out: Path, pretokenized: Path, model_cfg: dict) -> Path:
    """final/: sharded safetensors in the export dtype, the config, the tokenizer the data was made with,
    and the input model's generation_config.json (its stop tokens and sampling defaults)."""
    manifest, _ = read_manifest(pretokenized)
    tokenizer_dir = manifest.get("tokenizer_path")
    extra = (
        sorted(p for p in Path(tokenizer_dir).iterdir() if p.name in TOKENIZER_FILES)
        if tokenizer_dir and Path(tokenizer_dir).is_dir()
        else []
    )
    generation = Path(model_cfg["path"]) / "generation_config.json" if model_cfg.get("path") else None
    if generation is not None and generation.is_file():
        extra.append(generation)
    return export_hf_folder(model, out, DTYPES[s.export_dtype], int(s.export_max_shard_gib * GIB), extra)


def _run(config, s: TrainSettings, plan, plan_dir, rank, world, device, micro_batches, pretokenized, out) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    startup_s = process_age_s()  # launch, imports and process-group init: the forecast's start-up term
    heartbeat = Heartbeat(out, rank, int(os.environ.get("LOCAL_RANK", "0")), device_uuid(device))
    heartbeat.beat(0, 0, "init")
    data_dir, copy_s = stage_local_copy(pretokenized, s, out)
    store = DocStore(data_dir)
    memory = PhaseMemory(device)
    memory.start()

    identity = run_identity(config, plan_dir, pretokenized) if rank == 0 else None  # rank 0 writes state.json
    latest = resume_checkpoint(out, identity, rank)
    model, source = load_sharded_model(
        config["model"], s, init_device_mesh(device.type, (world,)), device, fill=latest is None
    )
    optimizer = build_optimizer(model, s)
    start = 0
    if latest is not None:
        start = int(ckpt.load_checkpoint(latest, model, optimizer)["step"])
        source = f"{latest}"
    memory.end("load")

    # a plan that continues another world size's run (pack/segments.py) starts at its first global step: the
    # steps before it were run by the earlier segment and are only placeholders here
    first_step = int(plan["segments"][-1]["first_step"]) if plan.get("segments") else 0
    if start < first_step:
        raise InputError(
            f"checkpoint step {start} is before step {first_step}, where this plan continues the "
            "earlier world size's run; restore that checkpoint or delete the checkpoints and rerun pack"
        )
    steps = [None] * first_step + group_steps(micro_batches)
    if s.max_steps:  # a measurement run (scaling, dataio): the plan's first steps only
        steps = steps[: s.max_steps]
    total = len(steps)
    epoch_ends = [e for e in plan["epoch_ends"] if e <= total] if plan.get("epoch_ends") else epoch_end_steps(steps)
    heartbeat.set_plan(total, epoch_ends)
    on_cuda = device.type == "cuda"
    n_params = count_params(model)
    log = StepLog(
        MetricsTable.resume(out / METRICS, start) if rank == 0 else None,
        s.log_every,
        n_params,
        world,
        config["cluster"]["gpu_model"],
        on_cuda,
        tensorboard=config["train"]["tensorboard"],
    )
    if rank == 0:
        print(
            f"train: {world} rank(s) on {device.type}, {n_params / 1e6:.2f}M params from {source} "
            f"(load {memory.phases['load']['seconds']:.1f} s), step {start}/{total}, "
            f"data_cache {s.data_cache} (copy {copy_s:.2f} s)",
            flush=True,
        )

    t_run = time.perf_counter()
    for g in range(start, total):
        run_step(
            g, steps, epoch_ends, start, model, optimizer, store, s, world, device, heartbeat, log, out, plan, identity
        )
    elapsed = time.perf_counter() - t_run
    memory.end("steady")

    last_epoch = steps[-1][0].epoch if steps else 0
    heartbeat.beat(total, last_epoch, "export")
    export_final(model, s, out, pretokenized, config["model"])
    memory.end("export")
    per_rank = memory.gather()
    summary = {}
    if rank == 0:
        summary = write_summary(
            out,
            log,
            per_rank,
            total,
            start,
            world,
            device,
            n_params,
            elapsed,
            s,
            copy_s,
            config["cluster"]["gpu_model"],
            startup_s,
        )
        append_throughput(config, plan, plan_dir, out, log, summary, start, total)
    heartbeat.beat(total, last_epoch, "done")
    return summary


def append_throughput(
    config: dict, plan: dict, plan_dir: Path, out: Path, log: StepLog, summary: dict, start: int, total: int
) -> None:
    """One line in the throughput ledger (forecast.ledger): this run's rate in the planner's cost units, start-up,
    load and storage times, for the gate's forecast of the next run of the same shape, world size and GPU."""
    if total <= start or not log.step_times:
        return
    first = int(plan["segments"][-1]["first_step"]) if plan.get("segments") else 0  # packs.parquet's first step
    costs = plan_step_costs(read_packs(plan_dir / PACKS), plan, config, total - first)
    t = config["train"]
    record = run_record(
        run_name=config["run_name"],
        shape=asdict(load_model_spec(config)),
        gpu_model=config["cluster"]["gpu_model"],
        world_size=plan["world_size"],
        seq_len=t["seq_len"],
        micro_batch_size=t["micro_batch_size"],
        attn_weight=float(plan.get("attn_weight", config["pack"]["attn_weight"])),
        step_costs=costs.step_max_cost[start - first : start - first + len(log.step_times)],
        step_times=log.step_times,
        tokens=log.tokens_done,
        startup_s=summary["startup_s"],
        load_s=summary["load_s"],
        checkpoints=log.checkpoints,
        checkpoint_s=log.checkpoint_s,
        checkpoint_bytes=log.checkpoint_bytes,
        export_s=summary["export_s"],
        export_bytes=folder_bytes(out / "final"),
        job_s=summary["job_s"],
    )
    append_ledger(Path(config["forecast"]["ledger"]), record)


def run_step(
    g,
    steps,
    epoch_ends,
    start,
    model,
    optimizer,
    store,
    s: TrainSettings,
    world,
    device,
    heartbeat,
    log: StepLog,
    out: Path,
    plan: dict,
    identity: dict | None,
) -> None:
    """Optimizer step g: its micro-batches, the step figures for rank 0, and a checkpoint when due."""
    step_plan, total = steps[g], len(steps)
    epoch = step_plan[0].epoch
    lr = lr_at(g, s, total)
    for group in optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    batches = [build_batch(store, m.packs, s.seq_len) for m in step_plan]
    data_wait = time.perf_counter() - t0
    step_loss, grad_norm, to_device_s = train_step(
        model,
        optimizer,
        batches,
        world,
        device,
        s.grad_clip,
        on_micro=lambda k: heartbeat.beat(g, epoch, "train", micro=k, micros=len(batches)),
    )
    data_wait += to_device_s
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_time = time.perf_counter() - t0
    local = torch.tensor(
        [step_loss, sum(b.num_loss_tokens for b in batches), sum(b.num_tokens for b in batches), step_time, data_wait],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)  # one small collective: every rank's step figures for rank 0
    heartbeat.beat(g + 1, epoch, "train", loss=float(local[0] / max(local[1], 1)))
    log.record(g, epoch, start, total, gathered, lr, grad_norm, time.time())
    checkpoint_now = (
        (g + 1) % s.checkpoint_every == 0 or g + 1 == total or (s.checkpoint_at_epoch_end and g + 1 in epoch_ends)
    )
    # metrics first: a published checkpoint at step n implies metrics through step n are on disk
    if log.flush_due(g, checkpoint_now):
        log.metrics.flush()
    if checkpoint_now:
        heartbeat.beat(g + 1, epoch, "checkpoint")
        t_ckpt = time.perf_counter()
        folder = ckpt.save_checkpoint(
            out / "checkpoints",
            g + 1,
            model,
            optimizer,
            {"epoch": epoch, "step": g + 1, "plan": plan["packs_sha256"]},
            s.checkpoint_keep,
            identity,
        )
        if log.metrics is not None:
            log.record_checkpoint(time.perf_counter() - t_ckpt, folder)
        heartbeat.beat(g + 1, epoch, "train")


def write_summary(
    out: Path,
    log: StepLog,
    per_rank_memory: list[dict],
    total: int,
    start: int,
    world: int,
    device: torch.device,
    n_params: int,
    elapsed: float,
    s: TrainSettings,
    copy_s: float,
    gpu_model: str,
    startup_s: float = 0.0,
) -> dict:
    """TRAINED (rank 0): losses, throughput, and each rank's memory peak per phase with load/export times."""
    log.metrics.flush()
    memory = memory_summary(per_rank_memory)
    worst = memory["max_over_ranks"]
    summary = dict(
        loss_summary(log.metrics.rows),
        steps=total,
        resumed_from_step=start,
        world_size=world,
        device=device.type,
        params=n_params,
        tokens_per_s=log.tokens_done / elapsed if elapsed > 0 else None,
        data_cache=s.data_cache,
        data_copy_s=copy_s,
        wall_s=elapsed,
        load_s=worst["load"]["seconds"],
        export_s=worst["export"]["seconds"],
        export_dtype=s.export_dtype,
        memory=memory,
        startup_s=round(startup_s, 3),
        checkpoints=log.checkpoints,
        checkpoint_s=round(log.checkpoint_s, 3),
        job_s=round(process_age_s(), 3),
    )  # rank 0's whole process: what the forecast predicts
    if device.type == "cuda":
        summary["mfu"] = model_flops_utilization(summary["tokens_per_s"] or 0, n_params, world, gpu_model)
        summary["peak_memory_gib"] = max(p["cuda_peak_gib"] for p in worst.values())
    write_json_atomic(out / "TRAINED", summary, nonfinite="null")  # a diverged loss is NaN: null
    first, final = summary["first_loss"], summary["final_loss"]
    losses = f"loss {first:.4f} -> {final:.4f}" if first is not None else "no steps taken"
    print(
        f"train: done: {losses}, {summary['tokens_per_s'] or 0:.0f} tok/s; peak host RSS per rank "
        + ", ".join(f"{p} {worst[p]['host_peak_gib']:.2f} GiB" for p in worst)
        + f"; export {summary['export_s']:.1f} s -> {out}",
        flush=True,
    )
    return summary

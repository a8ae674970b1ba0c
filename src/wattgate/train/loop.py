"""`wattgate train`: one process per rank (under torchrun), running exactly its planned micro-batches."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from itertools import groupby
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from wattgate.artifacts import write_json_atomic
from wattgate.data.tokenizer import TOKENIZER_FILES
from wattgate.errors import InputError, StageFailed
from wattgate.train import checkpoint as ckpt
from wattgate.train.data import DocStore, MicroBatchPlan, build_batch, read_rank_plan
from wattgate.train.loss import forward_logits, loss_sum, to_tensors
from wattgate.train.model import build_model, count_params, parallelize
from wattgate.train.telemetry_files import Heartbeat, MetricsTable

METRICS_FLUSH_EVERY = 50  # steps; also at every checkpoint and at the end

# Dense bf16 peak per GPU (TFLOP/s, datasheet) for MFU; unknown models report none.
PEAK_BF16_TFLOPS = {"a100": 312, "a100-40gb": 312, "a100-80gb": 312, "h100": 989, "h200": 989,
                    "b200": 2250, "b300": 2250}


def model_flops_utilization(tokens_per_s: float, n_params: int, world: int, gpu_model: str) -> float | None:
    """6 x params FLOPs per trained token (forward + backward) over the GPUs' peak; attention not counted."""
    peak = PEAK_BF16_TFLOPS.get(gpu_model.lower())
    if not peak:
        return None
    return 6 * n_params * tokens_per_s / (world * peak * 1e12)


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

    @classmethod
    def from_config(cls, config: dict) -> "TrainSettings":
        t = config["train"]
        return cls(
            **{k: t[k] for k in ("seq_len", "micro_batch_size", "grad_accum", "epochs", "lr", "min_lr_ratio",
                                 "warmup_steps", "weight_decay", "grad_clip", "seed", "checkpoint_every",
                                 "checkpoint_keep", "checkpoint_at_epoch_end", "collective_timeout_s", "attn_implementation",
                                 "activation_checkpointing", "data_cache", "local_cache_dir", "log_every",
                                 "optimizer", "max_steps")},
            betas=tuple(t["betas"]),
            mixed_precision=t["mixed_precision"] == "bf16",
        )


def build_optimizer(model, s: "TrainSettings") -> torch.optim.Optimizer:
    if s.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, foreach=True)


def lr_at(step: int, s: TrainSettings, total: int) -> float:
    """Linear warmup to lr, then cosine down to lr * min_lr_ratio at the last step."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    span = max(1, total - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def die_with_parent() -> None:
    """Linux: SIGKILL this rank when its torchrun agent dies.

    torchrun starts every worker in a session of its own, so killing the launcher's process
    group (a watcher, scancel, kill -9) would otherwise leave orphan ranks running, holding
    GPUs and racing a restarted job over the same checkpoints.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    import signal

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(1)


# glibc mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """Linux/glibc: keep freed activation buffers in the heap instead of returning them to the OS.

    With glibc's adaptive defaults the CPU path unmapped and re-faulted its large per-step
    buffers every step: 30-80% more minor page faults and ~15% slower steps than a bare loop
    (bench/train_overhead.py). Fixed thresholds keep the memory mapped between steps.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 256 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def init_distributed(timeout_s: float, out: Path) -> tuple[int, int, torch.device]:
    """Ranks come from torchrun's environment (c10d hands out ranks in join order, not --node_rank)."""
    if "RANK" not in os.environ:  # run by hand: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        # NCCL flight recorder: on a timeout every rank dumps its last collectives, naming the one missing
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        (out / "nccl-trace").mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(out / "nccl-trace" / "rank_"))
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID as NVML reports it, so triage can match a rank to its trace rows."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def check_planned_counts(micro_batches: list[MicroBatchPlan], device: torch.device) -> None:
    """Defense in depth behind the gate: every rank must plan the same number of micro-batches and steps."""
    mine = torch.tensor([len(micro_batches), len({(m.epoch, m.step) for m in micro_batches})],
                        dtype=torch.int64, device=device)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if torch.equal(lo, hi):
        return
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    micro = {r: int(t[0]) for r, t in enumerate(every)}
    steps = {r: int(t[1]) for r, t in enumerate(every)}
    raise StageFailed(f"planned counts differ across ranks (this would deadlock at the epoch end): "
                      f"micro-batches per rank {micro}, optimizer steps per rank {steps}")


def stage_local_copy(pretokenized: Path, s: TrainSettings, out: Path) -> tuple[Path, float]:
    """data_cache local: copy the shards to node-local scratch once per node; returns (path, seconds)."""
    if s.data_cache != "local":
        return pretokenized, 0.0
    root = Path(s.local_cache_dir or os.environ.get("TMPDIR") or "/tmp")
    manifest = (pretokenized / "manifest.json").read_bytes()
    dest = root / f"wattgate-{hashlib.sha256(manifest).hexdigest()[:16]}"
    start = time.perf_counter()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (dest / "manifest.json").exists():
        tmp = root / f"{dest.name}.tmp-{os.getpid()}"
        shutil.copytree(pretokenized, tmp, dirs_exist_ok=True)
        if dest.exists():  # another job on this node finished the same copy first
            shutil.rmtree(tmp)
        else:
            tmp.rename(dest)
    dist.barrier()  # local rank 0 copies; the others wait (a barrier across all ranks is simplest)
    return dest, time.perf_counter() - start


def export_final(model, out: Path, tokenizer_dir: str | None, rank: int) -> None:
    """Hugging Face folder (safetensors, config, tokenizer) loadable offline with from_pretrained.

    Rank 0 gathers the full state dict and saves it through a plain (unsharded) copy of the
    model built on the meta device: save_pretrained on the FSDP-wrapped model would reach into
    DTensors, and collectives there could wait for ranks that already moved on.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(full, assign=True)
        plain.tie_weights()
        tmp, final = out / "final.tmp", out / "final"
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer_dir and Path(tokenizer_dir).is_dir():
            for p in Path(tokenizer_dir).iterdir():
                if p.name in TOKENIZER_FILES:
                    shutil.copy(p, tmp / p.name)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()  # no rank leaves before the export is on disk


def train_step(model, optimizer, batches, world: int, device: torch.device, grad_clip: float,
               on_micro: Callable[[int], None] | None = None):
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


def train(config: dict, pretokenized: Path, plan_dir: Path, out: Path) -> dict:
    s = TrainSettings.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    plan = json.loads((plan_dir / "plan.json").read_text())
    die_with_parent()
    keep_freed_memory()
    rank, world, device = init_distributed(s.collective_timeout_s, out)
    try:
        if plan["world_size"] != world:
            raise InputError(f"{plan_dir}/plan.json: planned for world size {plan['world_size']}, "
                             f"launched with {world}; rerun pack and gate for this launch")
        micro_batches = read_rank_plan(plan_dir, rank)
        if config["train"]["check_planned_counts"]:
            check_planned_counts(micro_batches, device)
        elif rank == 0:
            print("train: WARNING: train.check_planned_counts is false: uneven plans will hang", file=sys.stderr)
        return _run(config, s, plan, rank, world, device, micro_batches, pretokenized, out)
    finally:
        dist.destroy_process_group()


def _run(config, s: TrainSettings, plan, rank, world, device, micro_batches, pretokenized, out) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    heartbeat = Heartbeat(out, rank, int(os.environ.get("LOCAL_RANK", "0")), device_uuid(device))
    heartbeat.beat(0, 0, "init")
    data_dir, copy_s = stage_local_copy(pretokenized, s, out)
    store = DocStore(data_dir)
    model = build_model(config["model"], s.attn_implementation, s.seed)
    n_params = count_params(model)
    on_cuda = device.type == "cuda"
    gpu_model = config["cluster"]["gpu_model"]
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    parallelize(model, mesh, on_cuda, s.mixed_precision, s.activation_checkpointing)
    optimizer = build_optimizer(model, s)
    steps = group_steps(micro_batches)
    if s.max_steps:  # a measurement run (scaling, dataio): the plan's first steps only
        steps = steps[:s.max_steps]
    total = len(steps)
    epoch_ends = [g + 1 for g in range(total) if g + 1 == total or steps[g + 1][0].epoch != steps[g][0].epoch]
    heartbeat.set_plan(total, epoch_ends)
    start = 0
    if rank == 0:
        ckpt.set_aside_foreign(out / "checkpoints", plan["packs_sha256"])
    dist.barrier()
    latest = ckpt.latest_complete(out / "checkpoints")
    if latest is not None:
        state = ckpt.load_checkpoint(latest, model, optimizer)
        start = int(state["step"])
        if rank == 0:
            print(f"train: resumed from {latest} at step {start}/{total}", flush=True)
    metrics = MetricsTable.resume(out / "metrics.parquet", start) if rank == 0 else None
    if rank == 0:
        print(f"train: {world} rank(s) on {device.type}, {n_params / 1e6:.2f}M params, {total} steps, "
              f"data_cache {s.data_cache} (copy {copy_s:.2f} s)", flush=True)

    tokens_done, t_run = 0, time.perf_counter()
    for g in range(start, total):
        step_plan = steps[g]
        epoch = step_plan[0].epoch
        for group in optimizer.param_groups:
            group["lr"] = lr_at(g, s, total)
        t0 = time.perf_counter()
        batches = [build_batch(store, m.packs, s.seq_len) for m in step_plan]
        data_wait = time.perf_counter() - t0
        step_loss, grad_norm, to_device_s = train_step(
            model, optimizer, batches, world, device, s.grad_clip,
            on_micro=lambda k: heartbeat.beat(g, epoch, "train", micro=k, micros=len(batches)))
        data_wait += to_device_s
        if on_cuda:
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        local = torch.tensor([step_loss, sum(b.num_loss_tokens for b in batches),
                              sum(b.num_tokens for b in batches), step_time, data_wait], dtype=torch.float64,
                             device=device)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)  # one small collective: every rank's step figures for rank 0
        now = time.time()
        heartbeat.beat(g + 1, epoch, "train", loss=float(local[0] / max(local[1], 1)))
        step_tokens = int(sum(float(t[2]) for t in gathered))
        global_loss_tokens = sum(float(t[1]) for t in gathered)
        tokens_done += step_tokens
        if rank == 0:
            metrics.add([{"step": g + 1, "rank": r, "epoch": epoch, "loss": float(t[0] / max(t[1], 1)),
                          "tokens": int(t[2]), "loss_tokens": int(t[1]), "step_time_s": float(t[3]),
                          "data_wait_s": float(t[4]), "lr": lr_at(g, s, total), "time": now}
                         for r, t in enumerate(gathered)])
            if (g + 1) % s.log_every == 0 or g == start or g + 1 == total:
                loss = sum(float(t[0]) for t in gathered) / max(global_loss_tokens, 1)
                mfu = model_flops_utilization(step_tokens / step_time, n_params, world, gpu_model) if on_cuda else None
                print(f"train: step {g + 1}/{total} epoch {epoch} loss {loss:.4f} grad_norm {grad_norm:.3f} "
                      f"lr {lr_at(g, s, total):.2e} {step_tokens / step_time:.0f} tok/s "
                      f"data_wait {100 * data_wait / step_time:.2f}%" + (f" MFU {100 * mfu:.1f}%" if mfu else ""),
                      flush=True)
        checkpoint_now = (g + 1) % s.checkpoint_every == 0 or g + 1 == total or \
            (s.checkpoint_at_epoch_end and g + 1 in epoch_ends)
        # metrics first: a published checkpoint at step n implies metrics through step n are on disk
        if rank == 0 and (checkpoint_now or (g + 1) % METRICS_FLUSH_EVERY == 0):
            metrics.flush()
        if checkpoint_now:
            heartbeat.beat(g + 1, epoch, "checkpoint")
            ckpt.save_checkpoint(out / "checkpoints", g + 1, model, optimizer, {"epoch": epoch, "step": g + 1, "plan": plan["packs_sha256"]},
                                 s.checkpoint_keep)
            heartbeat.beat(g + 1, epoch, "train")
    elapsed = time.perf_counter() - t_run
    heartbeat.beat(total, steps[-1][0].epoch if steps else 0, "export")
    manifest = json.loads((pretokenized / "manifest.json").read_text())
    export_final(model, out, manifest.get("tokenizer_path"), rank)
    summary = {}
    if rank == 0:
        metrics.flush()
        summary = dict(loss_summary(metrics.rows), steps=total, resumed_from_step=start, world_size=world,
                       device=device.type, params=n_params,
                       tokens_per_s=tokens_done / elapsed if elapsed > 0 else None,
                       data_cache=s.data_cache, data_copy_s=copy_s, wall_s=elapsed)
        if on_cuda:
            summary["mfu"] = model_flops_utilization(summary["tokens_per_s"] or 0, n_params, world, gpu_model)
            summary["peak_memory_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
        write_json_atomic(out / "TRAINED", summary)
        print(f"train: done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
              f"{summary['tokens_per_s']:.0f} tok/s -> {out}", flush=True)
    heartbeat.beat(total, steps[-1][0].epoch if steps else 0, "done")
    return summary

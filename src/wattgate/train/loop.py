"""`wattgate train`: one process per rank (under torchrun), running exactly its planned micro-batches.

A Trainer's start-up (its __init__) loads the sharded model, resumes and schedules the rank's steps;
`Trainer.run` is the outline of the run from there: take the planned steps (each step's validation pass and
checkpoint decided by wattgate.cadence, the rule the gate and the forecast read too), export, summarize. One
Trainer holds the run's state (model, optimizer, document store, heartbeat, step log), all made in its __init__,
and reads the config's `train` section as it is. Each part lives in its own module: rank_inputs (the data and
this rank's micro-batches), distributed (process group), model/weights (build, load, export), optimizer (the
optimizer and its learning rate), data (the plan's batches, the prefetch thread), loss (the chunked loss),
checkpoint (DCP), metrics (step log, memory peaks); wattgate.run_files reads the plan and manifest and writes the
heartbeats and the metrics and validation tables.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist

from wattgate.cadence import StepActions
from wattgate.config import context_degree
from wattgate.errors import InputError
from wattgate.heartbeats import reserve_rank_error
from wattgate.train.metrics import process_age_s
from wattgate.run_files import EVAL, METRICS, PLAN, claim_output, read_plan
from wattgate.run_tables import EvalTable, MetricsTable
from wattgate.records.plan import Plan
from wattgate.train import checkpoint as ckpt
from wattgate.train.data import Batch, DocStore, MicroBatchPlan, StepPrefetcher, build_batch, host_tensors
from wattgate.train.distributed import setup_rank
from wattgate.train.export_files import export_extra_files
from wattgate.train.input_check import verify_inputs
from wattgate.identity import run_identity
from wattgate.model_spec import export_dtype_name
from wattgate.train.eval_sources import NO_SOURCES, read_eval_sources
from wattgate.train.context_loss import ContextPlace, context_summed_loss, context_token_losses
from wattgate.train.context_parallel import context_kernel
from wattgate.train.loss import summed_token_loss, token_losses
from wattgate.train.metrics import (
    GIB,
    PhaseMemory,
    StepLog,
)
from wattgate.train.model import clip_grad_norm, count_params
from wattgate.train.optimizer import build_optimizer, lr_at
from wattgate.train.rank_inputs import Paths, rank_batches, stage_local_copy
from wattgate.train.steps import StepClass, rank_schedule, step_class
from wattgate.train.step_verdicts import NonFiniteState, agreed_stop, doc_ids, nonfinite_line
from wattgate.train.stop import (
    EVAL_STOP_CHECK_MICROS,
    install_stop_signals,
    start_abort_watch,
    stop_abort_watch,
    write_stopped,
)
from wattgate.train.run_summary import append_throughput, write_trained
from wattgate.train.mesh import context_group
from wattgate.train.seams import Seams, training_seams
from wattgate.train.weights import DTYPES, EXPORT_FOLDER, ExportFiles, export_hf_folder
from wattgate.records.run_config import RunConfig
from wattgate.records.checkpoint import Position, RunIdentity
from wattgate.records.trained import LOAD, Trained

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def group_steps(micro_batches: list[MicroBatchPlan]) -> list[list[MicroBatchPlan]]:
    return [list(g) for _, g in groupby(micro_batches, key=lambda m: (m.epoch, m.step))]


def resume_checkpoint(
    out: Path, identity: RunIdentity | None, rank: int, storage: ckpt.CheckpointStorage = ckpt.CHECKPOINT_FOLDER
) -> Path | None:
    """The newest intact checkpoint of this run identity: rank 0 lists the candidates and broadcasts them, every
    rank hashes its share of each (train/checkpoint.py `agreed_latest`), and all take the same verdict.

    Ranks never list their own: on a shared filesystem with directory caching two ranks can see different
    newest checkpoints, and the job would hang in its first collective.
    """
    if rank == 0:
        assert identity is not None  # rank 0 knows this run's identity (Trainer.load)
        storage.set_aside_mismatched(out / "checkpoints", identity)
    return ckpt.agreed_latest(out / "checkpoints", rank, dist.get_world_size(), storage)


def export_final(model, dtype: str, max_shard_gib: float, out: Path, extra, files: ExportFiles = EXPORT_FOLDER) -> Path:
    """final/: sharded safetensors in `dtype` (model_spec.export_dtype_name) in files of at most
    `max_shard_gib` (train.export_max_shard_gib), the config, and `extra` (train/export_files.py: the tokenizer
    the data was made with, verified by its hash, and the input model's generation_config.json)."""
    return export_hf_folder(model, out, DTYPES[dtype], int(max_shard_gib * GIB), extra, files)


def train(config: RunConfig, pretokenized: Path, plan_dir: Path, out: Path) -> Trained | None:
    # SIGTERM/SIGUSR1/SIGINT from now on are stop requests, acted on at the next agreed point
    install_stop_signals(config.cluster.slurm.train.stop_margin_s)
    abort_watch = start_abort_watch(out)  # the watcher's kill of a hung job ends this rank even in a collective
    try:
        claim_output(out, "train")  # every rank, before it writes: what another rank made by now is train's own
        reserve_rank_error(out, int(os.environ.get("RANK", "0")))  # room for the line that names a full disk
        plan, _ = read_plan(plan_dir)
        rank, world, device = setup_rank(config.train.collective_timeout_s, out)
        try:
            context = context_degree(config)
            if plan.world_size * context != world:
                raise InputError(
                    f"{plan_dir / PLAN}: planned for world size {plan.world_size}"
                    + (f" x parallel.context {context}" if context > 1 else "")
                    + f", launched with {world}; rerun pack and gate for this launch"
                )
            where = (rank, world, device)
            seams = training_seams(config, out, where)
            return run_rank(config, plan, Paths(pretokenized, plan_dir, out), where, seams)
        finally:
            dist.destroy_process_group()
    finally:
        stop_abort_watch(abort_watch)


def run_rank(config: RunConfig, plan: Plan, paths: Paths, where: tuple, seams: Seams) -> Trained | None:
    """One rank's run once its process group is up: its plan, the sequence guard, the Trainer's outline."""
    batches = rank_batches(plan, paths, where, config.train.check_planned_counts, context_degree(config))
    return Trainer(config, plan, paths, where, seams, batches).run()


@dataclass(frozen=True)
class Loaded:
    """What Trainer.load gives: the sharded model and optimizer, and where the run starts."""

    identity: RunIdentity | None  # this run's (rank 0, which writes it into state.json; None elsewhere)
    model: torch.nn.Module
    context: ContextPlace | None  # this rank's context group (parallel.context > 1), None without one
    optimizer: torch.optim.Optimizer
    source: str  # where the values came from: model.path, a seeded init, or the checkpoint folder
    start: int  # the first step to take (0, or the checkpoint's step)
    pending_eval: bool  # the checkpoint was taken inside its step's validation pass: redo the pass first


class Trainer:
    """One rank's run: its state, and the outline `run` -> `run_step(g)` -> `train_step` / `evaluate`.

    What it writes outside the ranks' collectives (checkpoints, final/, heartbeats), how it is stopped and how
    its model is made come in `seams` (train/seams.py), as do the hooks around its steps."""

    def __init__(self, config: RunConfig, plan: Plan, paths: Paths, where: tuple, seams: Seams, batches: tuple):
        """The rank's start-up, in order: its inputs checked, the model and optimizer loaded (from the newest
        checkpoint of this run when there is one), its steps scheduled. `batches`: this rank's train and
        validation micro-batches (rank_batches)."""
        micro_batches, eval_batches = batches
        self.config, self.train, self.plan, self.paths = config, config.train, plan, paths
        self.rank, self.world, self.device = where
        self.seams, self.hooks = seams, seams.hooks
        self.startup_s = process_age_s()  # launch, imports and process-group init: the forecast's start-up term
        self.heartbeat = seams.heartbeat
        self.heartbeat.beat(0, 0, "init")
        data_dir, self.copy_s = stage_local_copy(paths.pretokenized, self.train, paths.out)
        # the shards, tokenizer and model files are the bytes the gate verified (train/input_check.py): checked
        # now, not at the end, so a changed tokenizer does not cost the run before final/ is refused
        verify_inputs(data_dir, paths.pretokenized, plan, paths.out, self.rank, self.world)
        self.store = DocStore(data_dir)
        self.memory = PhaseMemory(self.device)
        self.pin = self.device.type == "cuda"
        self.stop_request = seams.stop
        self.final_dtype = export_dtype_name(config)  # train.export_dtype, auto resolved to the model's
        self.skipped_steps = 0  # train.on_nonfinite skip_step: steps whose update was dropped in this attempt
        self.eval_interrupted = False  # a stop agreed inside a validation pass (the pass is redone on resume)
        self.eval_stop_reason: str | None = None  # that stop's reason (stop_agreed_in_eval)
        self.elapsed = 0.0  # the steps' wall time (run)
        self.memory.start()
        loaded = self.load()
        self.identity, self.model, self.optimizer = loaded.identity, loaded.model, loaded.optimizer
        self.context = loaded.context
        self.source, self.start, self.pending_eval = loaded.source, loaded.start, loaded.pending_eval
        # the steps this rank runs, the epoch ends, the cadence
        grouped = group_steps(micro_batches)
        self.sched = rank_schedule(plan, [st[0].epoch for st in grouped], self.train, bool(eval_batches))
        # a plan that continues another world size's run (pack/segments.py) starts at its first global step: the
        # steps before it were run by the earlier segment and are only placeholders here (train/steps.py)
        self.first_step = self.sched.first_step
        if self.start < self.first_step:
            raise InputError(
                f"checkpoint step {self.start} is before step {self.first_step}, where this plan continues the "
                "earlier world size's run; restore that checkpoint or delete the checkpoints and rerun pack"
            )
        self.total, self.epoch_ends = self.sched.total, list(self.sched.epoch_ends)
        self.steps = ([None] * self.first_step + grouped)[: self.total]
        self.eval_batches = eval_batches
        # the held-out documents' sources: with two or more, each pass reports a loss per source
        self.eval_sources = read_eval_sources(paths.pretokenized) if eval_batches else NO_SOURCES
        self.last_epoch = self.steps[-1][0].epoch if self.steps and self.steps[-1] else 0
        self.exported_step = self.total  # export() moves it to the best checkpoint's (train.export_from: best)
        self.heartbeat.set_plan(self.total, self.epoch_ends)
        self.n_params = count_params(self.model)
        self.log, self.evals = self.tables()
        if self.rank == 0:
            print(
                f"train: {self.world} rank(s) on {self.device.type}"
                + (
                    f" ({self.context.size} sharing each row, parallel.context; {self.context.kernel} attention)"
                    if self.context
                    else ""
                )
                + f", {self.n_params / 1e6:.2f}M params from "
                f"{self.source} (load {self.memory.phases[LOAD].seconds:.1f} s), step {self.start}/{self.total}, "
                f"data_cache {self.train.data_cache} (copy {self.copy_s:.2f} s)"
                + (f", validation {len(eval_batches)} micro-batch(es) per pass" if eval_batches else ""),
                flush=True,
            )

    def load(self) -> Loaded:
        """The sharded model and optimizer, from the newest checkpoint of this run when there is one."""
        identity = run_identity(self.config, self.paths.plan_dir, self.paths.pretokenized) if self.rank == 0 else None
        latest = resume_checkpoint(self.paths.out, identity, self.rank, self.seams.checkpoints)
        mesh = self.seams.model.device_mesh()
        place = context_group(mesh)
        kernel = context_kernel(self.train.attn_implementation, self.device.type)
        context = ContextPlace(*place, kernel) if place else None
        model, source = self.seams.model.build(mesh, latest is None)
        optimizer = build_optimizer(model, self.train)
        start, pending_eval = 0, False
        if latest is not None:
            state = ckpt.load_checkpoint(latest, model, optimizer, self.seams.checkpoints)
            start, pending_eval, source = state.step, bool(state.position.eval_pending), f"{latest}"
        self.memory.end("load")
        return Loaded(identity, model, context, optimizer, source, start, pending_eval)

    def tables(self) -> tuple[StepLog, EvalTable | None]:
        """The step log (rank 0's metrics table, from the resume point) and rank 0's validation table."""
        lead, out = self.rank == 0, self.paths.out
        log = StepLog(
            MetricsTable.resume(out / METRICS, self.start) if lead else None,
            self.train.log_every,
            self.n_params,
            self.world,
            self.config.cluster.gpu_model,
            self.device.type == "cuda",
            tensorboard=self.train.tensorboard,
        )
        evals = (
            EvalTable.resume(out / EVAL, self.start, self.eval_sources.names) if lead and self.eval_batches else None
        )
        return log, evals

    # ---------------------------------------------------------------- the outline

    def run(self) -> Trained | None:
        """The run from its start or resume point: TRAINED's record (rank 0; None on other ranks and after a
        graceful stop, which leaves STOPPED instead)."""
        t_run = time.perf_counter()
        if self.pending_eval and self.eval_batches:  # a stop inside this step's validation pass: redo the pass
            previous = self.steps[self.start - 1]
            self.evaluate(self.start, previous[0].epoch if previous else 0)
        prefetch = StepPrefetcher(self.step_batches, self.total)
        stopped = None
        try:
            for g in self.hooks.steps(self.start, self.total):  # every step from the resume point
                stopped = self.hooks.step(g, self.step_class(g), partial(self.run_step, g, prefetch))
                if stopped is not None:
                    break
        finally:
            prefetch.close()
        self.elapsed = time.perf_counter() - t_run
        self.memory.end("steady")
        if stopped is not None:
            self.finish_stopped(*stopped)
            return None
        self.export()
        summary = self.summarize()
        self.heartbeat.beat(self.total, self.last_epoch, "done")
        return summary

    def finish_stopped(self, step: int, epoch: int, reason: str) -> None:
        """After the stop checkpoint at `step`: close the logs, STOPPED (rank 0), no export and no TRAINED."""
        self.log.close()
        checkpoint = self.paths.out / "checkpoints" / f"step-{step}"
        if self.rank == 0:
            write_stopped(self.paths.out, step, checkpoint, reason)
            print(
                f"train: stopped at step {step}/{self.total} ({reason}): checkpoint {checkpoint} published; "
                "rerun to resume from it",
                flush=True,
            )
        self.heartbeat.beat(step, epoch, "done", stopped=reason)

    def actions(self, g: int) -> StepActions:
        """What follows step g (0-based; the cadence counts 1-based): wattgate.cadence, shared with the gate."""
        return self.sched.actions(g, self.start)

    def step_class(self, g: int) -> StepClass:
        """Step g's class (train/steps.py): what the collective proof enumerates from the plan for this rank."""
        return step_class(len(self.planned(g)), self.actions(g), len(self.eval_batches))

    def planned(self, g: int) -> list[MicroBatchPlan]:
        """Step g's micro-batches: a step this rank runs, at or after the plan's first step (those before are None)."""
        step_plan = self.steps[g]
        assert step_plan is not None, f"step {g} is before this plan's first step {self.first_step}"
        return step_plan

    def run_step(self, g: int, prefetch: StepPrefetcher) -> tuple[int, int, str] | None:
        """Optimizer step g: its micro-batches, the step figures (every rank's, with its stop request), the update
        when every rank's loss and the gradient norm are finite, then validation and a checkpoint when
        wattgate.cadence says so, or a stop every rank agreed on. Returns (step, epoch, reason) after a stop."""
        step_plan = self.planned(g)
        epoch, act = step_plan[0].epoch, self.actions(g)
        lr = lr_at(g, self.train, self.total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        batches = prefetch.get(g)  # built on the prefetch thread while step g - 1 ran
        data_wait = time.perf_counter() - t0
        on_micro = partial(self.heartbeat.beat, g, epoch, "train", micros=len(batches))
        step_loss, grad_norm, to_device_s, micro_losses = self.hooks.train_part(
            batches, lambda: self.train_step(batches, lambda k: on_micro(micro=k))
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        loss_tokens, tokens = sum(b.num_loss_tokens for b, _ in batches), sum(b.num_tokens for b, _ in batches)
        asked = self.stop_request.reason()
        carry_on = float(asked is None)  # 1 carries on: a value that says nothing (the proof's made-up 1) never stops
        figures = [float(step_loss), loss_tokens, tokens, step_time, data_wait + to_device_s, carry_on]
        local = torch.tensor(figures, dtype=torch.float64, device=self.device)
        gathered = torch.empty(self.world * len(figures), dtype=torch.float64, device=self.device)
        # one small collective: every rank's step figures for rank 0, and what every rank needs to decide alike
        # whether this step's update is taken (its loss) and whether the run stops here (its stop request)
        dist.all_gather_single(gathered, local)
        gathered = gathered.view(self.world, -1).cpu().tolist()  # one host read of every rank's figures
        norm = float(grad_norm)  # the same on every rank (clip_grad_norm_ reduces it over the mesh)
        if self.update_is_finite(g, gathered, norm, micro_losses):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.heartbeat.beat(g + 1, epoch, "train", loss=figures[0] / max(loss_tokens, 1))
        self.log.record(g, epoch, self.start, self.total, gathered, lr, norm, time.time())
        stop = agreed_stop(gathered, asked)  # the same on every rank: each rank's request is in `gathered`
        evaluate = partial(self.evaluate, g + 1, epoch)
        eval_loss = self.hooks.validation(len(self.eval_batches), evaluate) if act.evaluate else None
        if self.eval_interrupted:  # every rank agreed on a stop inside the pass
            stop, eval_loss = stop or self.eval_stop_reason, None
        # metrics first: a published checkpoint at step n implies metrics through step n are on disk
        if self.log.metrics is not None and self.log.flush_due(g, act.checkpoint or stop is not None):
            self.log.metrics.flush()
        if act.checkpoint or stop is not None:
            self.save(g + 1, epoch, eval_loss)
        return (g + 1, epoch, stop) if stop is not None else None

    def update_is_finite(self, g: int, gathered: list, grad_norm: float, micro_losses: list) -> bool:
        """Whether step g's update may be taken: every rank's loss and the gradient norm finite. Decided from
        figures every rank holds alike, so every rank takes (or drops) the update together. A non-finite step
        stops the run naming the step, the ranks and their micro-batches' documents (train.on_nonfinite stop),
        or is skipped up to train.nonfinite_skip_limit times (skip_step)."""
        bad = [r for r, t in enumerate(gathered) if not math.isfinite(float(t[0]))]
        if not bad and math.isfinite(grad_norm):
            return True
        # every rank takes this path together: one object gather of what each rank's micro-batches held
        mine = [(k, float(x), doc_ids(m)) for k, (x, m) in enumerate(zip(micro_losses, self.planned(g)), 1)]
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        what = nonfinite_line(g + 1, bad, grad_norm, everyone)
        if self.train.on_nonfinite == "skip_step" and self.skipped_steps < self.train.nonfinite_skip_limit:
            self.skipped_steps += 1
            if self.rank == 0:
                print(
                    f"train: WARNING: {what}; update skipped ({self.skipped_steps} of at most "
                    f"{self.train.nonfinite_skip_limit} in this attempt, train.on_nonfinite skip_step)",
                    file=sys.stderr,
                    flush=True,
                )
            return False
        limit = f" ({self.skipped_steps} steps skipped already)" if self.train.on_nonfinite == "skip_step" else ""
        raise NonFiniteState(
            f"{what}{limit}; stopped before the optimizer step: nothing non-finite was checkpointed or exported; "
            "rerun resumes from the newest checkpoint (lower train.lr, check those documents, or set "
            "train.on_nonfinite: skip_step)"
        )

    def check_finite_weights(self, step: int, what: str) -> None:
        """Every rank's parameter shards finite (one all-reduce), before a checkpoint or the export writes them:
        a finite gradient with a large learning rate can still overflow a weight."""
        shards = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        finite = torch.stack([torch.isfinite(t).all() for t in shards]).all() if shards else torch.tensor(True)
        flag = finite.to(device=self.device, dtype=torch.float32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if float(flag[0]) < 1.0:
            raise NonFiniteState(
                f"step {step}: the weights hold non-finite values after the optimizer step (the gradient norm was "
                f"finite: the learning rate or an overflow); {what} not written; rerun resumes from the newest "
                "checkpoint (lower train.lr)"
            )

    def step_batches(self, g: int) -> list:
        """Step g's (Batch, host tensors) per micro-batch: the prefetch thread's work."""
        return [self.prepared(m)[:2] for m in self.planned(g)]

    def prepared(self, m: MicroBatchPlan) -> tuple[Batch, dict[str, torch.Tensor], np.ndarray | None]:
        """A planned micro-batch built on the host: its Batch with this rank's counts, its host tensors, and under
        parallel.context its rows' split (ContextPlace.prepared), else None."""
        batch = build_batch(self.store, m.packs, self.train.seq_len)
        if self.context is None:
            return batch, host_tensors(batch, self.pin), None
        return self.context.prepared(batch, m.packs, self.train.seq_len, self.pin)

    def micro_loss(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """fp32 scalar: the summed next-token loss of this rank's tokens of a micro-batch's rows (all of them, or
        its context shard's under parallel.context: train/context_loss.py)."""
        kind, chunk = self.train.loss, self.train.loss_chunk_tokens
        if self.context is None:
            return summed_token_loss(self.model, tensors, kind, chunk)
        return context_summed_loss(self.model, self.context.shard(tensors), self.context, kind, chunk)

    def to_device(self, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in host.items()}

    def train_step(self, batches: list, on_micro):
        """Forward and backward over this rank's micro-batches, gradients reduced and clipped, the update not yet
        taken (run_step takes it once every rank's loss is known finite); returns (summed loss, grad norm,
        host->device s, each micro-batch's summed loss), the losses and norm as device tensors: the host waits on
        the device once per step, at the figures gather.

        `on_micro(k)` runs as the k-th micro-batch starts (the heartbeat: with the step's planned
        micro-batch count it tells the watcher which rank reached the step's gradient reduction first).

        The loss is normalized by the loss-bearing tokens of the whole global batch (all-reduced), so the
        gradient does not depend on how documents were packed or split over ranks and micro-batches.
        """
        model = self.model
        sharded = cast("FSDPModule", model)  # fully_shard made it one (train/model.py)
        counts = torch.tensor([sum(b.num_loss_tokens for b, _ in batches)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        # FSDP averages gradients over ranks; x world turns that average into a sum over ranks
        scale = (self.world / counts.clamp_min(1.0)).float()
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        micro_losses = []
        to_device_s = 0.0
        for i, (_, host) in enumerate(batches):
            on_micro(i + 1)
            t = time.perf_counter()
            tensors = self.to_device(host)
            to_device_s += time.perf_counter() - t
            sharded.set_requires_gradient_sync(i == len(batches) - 1)  # reduce-scatter once per step
            summed = self.micro_loss(tensors)
            (summed * scale[0]).backward()
            micro_losses.append(summed.detach())
            step_loss += micro_losses[-1].double()
        grad_norm = clip_grad_norm(model.parameters(), self.train.grad_clip)  # torch's, mesh by mesh under EP
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2: materialize it on every rank, together
            grad_norm = grad_norm.full_tensor()
        return step_loss.cpu(), grad_norm, to_device_s, micro_losses

    def evaluate(self, step: int, epoch: int) -> float | None:
        """A validation pass after `step`: every held-out document once, forward only; the loss is the summed
        token losses over the all-reduced loss-token count (fp64), the same on every rank and every world size;
        with two or more held-out sources each source's too, in the same all-reduce (train/eval_sources.py)."""
        t0 = time.perf_counter()
        self.model.eval()
        # [loss sum, loss tokens], then each source's sums and tokens (train/eval_sources.py): one all-reduce
        totals = torch.zeros(self.eval_sources.size, dtype=torch.float64, device=self.device)
        self.eval_interrupted = False
        held_out = (int(d) for m in self.eval_batches for pack in m.packs for d in pack)
        self.store.keep(held_out)  # decoded by the first pass, held for the later ones
        with torch.no_grad():
            for k, m in enumerate(self.eval_batches, 1):
                self.heartbeat.beat(step, epoch, "eval", micro=k, micros=len(self.eval_batches))
                batch, host, split = self.prepared(m)
                tensors = self.to_device(host)
                if self.eval_sources:
                    self.add_source_losses(totals, tensors, batch, m.packs, split)
                else:
                    totals[0] += self.hooks.forward(tensors, partial(self.micro_loss, tensors))
                # this rank's loss tokens: under parallel.context its shard's, so the all-reduce counts each once
                totals[1] += batch.num_loss_tokens
                # a long pass checks for a stop every few micro-batches: every rank has the same count, so the
                # check is a collective every rank reaches (the pass is abandoned and redone on resume)
                if k % EVAL_STOP_CHECK_MICROS == 0 and k < len(self.eval_batches) and self.stop_agreed_in_eval():
                    self.eval_interrupted = True
                    break
        if not self.eval_interrupted:
            dist.all_reduce(totals)
        cast(
            "FSDPModule", self.model
        ).reshard()  # a forward without backward leaves the root's parameters gathered: free them
        self.model.train()
        if self.eval_interrupted:
            self.heartbeat.beat(step, epoch, "train")
            return None
        loss = float(totals[0] / totals[1].clamp_min(1.0))
        if not math.isfinite(loss):
            raise NonFiniteState(
                f"step {step}: the validation loss is {loss} while the weights are finite (a forward overflow); "
                "nothing of this step was checkpointed; rerun resumes from the newest checkpoint"
            )
        self.heartbeat.beat(step, epoch, "train")
        if self.evals is not None:
            row = {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "perplexity": math.exp(min(loss, 700.0)),
                "tokens": int(totals[1]),
                **self.eval_sources.row(totals),
                "seconds": time.perf_counter() - t0,
                "time": time.time(),
            }
            self.evals.add([row])
            self.evals.flush()  # before any checkpoint of this step: a resume keeps exactly these rows
            self.log.record_eval(row)
        return loss

    def add_source_losses(
        self, totals: torch.Tensor, tensors: dict, batch, packs: list, split: np.ndarray | None
    ) -> None:
        """A validation micro-batch's per-position losses added to the pass's totals by source
        (train/eval_sources.py): the whole rows', or under parallel.context (`split`: its rows' split,
        ContextPlace.split) this rank's shard of them."""
        loss = (self.train.loss, self.train.loss_chunk_tokens)
        where = self.eval_sources.positions(packs, self.train.seq_len)
        if self.context is None or split is None:
            losses = self.hooks.forward(tensors, partial(token_losses, self.model, tensors, *loss))
            self.eval_sources.add(totals, losses, batch.labels, where)
            return
        shard = self.context.shard(tensors)
        losses = self.hooks.forward(tensors, partial(context_token_losses, self.model, shard, self.context, *loss))
        mine = np.take_along_axis(where.reshape(batch.labels.shape), self.context.local(split), axis=1).reshape(-1)
        self.eval_sources.add_targets(totals, losses, self.context.has_target(batch.labels, split).reshape(-1), mine)

    def stop_agreed_in_eval(self) -> bool:
        """Inside a validation pass: whether any rank has a stop request (one all-reduce, every rank alike)."""
        asked = self.stop_request.reason()
        carry_on = torch.tensor([float(asked is None)], device=self.device)
        dist.all_reduce(carry_on, op=dist.ReduceOp.MIN)
        self.eval_stop_reason = asked or "a stop requested on another rank"
        return float(carry_on[0]) < 0.5

    def save(self, step: int, epoch: int, eval_loss: float | None) -> None:
        self.heartbeat.beat(step, epoch, "checkpoint")
        self.check_finite_weights(step, f"checkpoint step-{step}")
        t_ckpt = time.perf_counter()
        position = Position(
            epoch=epoch,
            step=step,
            plan=self.plan.packs_sha256,
            eval_loss=eval_loss,  # train.keep_best and export_from: best read it
            eval_pending=True if self.eval_interrupted else None,  # the resumed run redoes this step's pass first
        )
        folder = ckpt.save_checkpoint(
            self.paths.out / "checkpoints",
            self.model,
            self.optimizer,
            position,
            self.train.checkpoint_keep,
            self.identity,
            keep_best=self.train.keep_best and bool(self.eval_batches),
            storage=self.seams.checkpoints,
        )
        if self.log.metrics is not None:
            self.log.record_checkpoint(time.perf_counter() - t_ckpt, folder)
        self.heartbeat.beat(step, epoch, "train")

    # ---------------------------------------------------------------- the end of the run

    def export(self) -> None:
        """final/ from the last step, or from the best validation checkpoint (train.export_from: best)."""
        self.log.close()
        self.heartbeat.beat(self.total, self.last_epoch, "export")
        if self.train.export_from == "best" and self.eval_batches:
            choice: list = [None]
            if self.rank == 0:  # rank 0 picks, as for resume: ranks never choose a checkpoint on their own
                best = self.seams.checkpoints.best(self.paths.out / "checkpoints")
                choice = [str(best) if best is not None else None]
            dist.broadcast_object_list(choice, src=0)
            if choice[0] is not None and Path(choice[0]).name != f"step-{self.total}":
                state = ckpt.load_checkpoint(Path(choice[0]), self.model, self.optimizer, self.seams.checkpoints)
                self.exported_step = state.step
        self.check_finite_weights(self.exported_step, "final/")
        # the tokenizer is verified by its hash on every rank once the weights are written (train/export_files.py)
        extra = partial(export_extra_files, self.paths.pretokenized, self.config.model)
        max_shard_gib = self.train.export_max_shard_gib
        export_final(self.model, self.final_dtype, max_shard_gib, self.paths.out, extra, self.seams.export)
        self.memory.end("export")

    def summarize(self) -> Trained | None:
        """TRAINED and the ledger line (rank 0; None on the others); every rank takes part in the memory gather."""
        per_rank = self.memory.gather()
        if self.rank != 0:
            return None
        summary = write_trained(self, per_rank)
        append_throughput(self, summary)
        return summary

"""One rank of the planned world, dry-run: the trainer's own code (train/rank_inputs.py `rank_batches`, the
Trainer's start-up, `Trainer.run`, `Trainer.run_step`) on the fake process group, with the model's tensors fake,
recording every collective it issues. The Trainer is the one `wattgate train` runs, given the dry run's seams
(train/seams.py): nothing of it is overridden or patched.

The phases, each recorded: start-up (the sequence guard, the resume choice, the model build), one step of each
class, the export and summary; then the graceful stop path (the first dry-run step again with every rank asked to
stop, through its checkpoint and STOPPED); then a resume: a second Trainer's start-up (the checkpoint every rank
agrees on, and torch.distributed.checkpoint's load of it).

What differs from a real rank, and why each is outside what the proof claims:
- the model (`ProxyModel`) is built at reduced depth (`depth` decoder layers, full width) with FakeTensors:
  shapes and dtypes without memory or arithmetic; the decoder layers are checked to be identical units or a
  repeating pattern (wattgate.proof.depth) so each step's collectives at the real depth follow from the proxy's;
- the steps (`DryRunSteps`, proof/hooks.py) are one step of every class the plan gives any rank
  (wattgate.train.steps), each run in full: its micro-batches, its log, validation pass and checkpoint; a train
  part or validation pass met before is replayed;
- no byte of a checkpoint or of final/ is kept (proof/storage.py): DCP's save and load run through a storage
  writer and reader that keep none, and the export's files are counted; what rank 0 publishes and sends
  reaches the other ranks through proof/relay.py;
- a continued plan (pack/segments.py) resumes from the checkpoint its earlier segment left at its first step;
- data_cache local is not copied (its barrier is on every rank alike), the ledger line, metrics and STOPPED go
  to the work folder, and no TensorBoard events are written (rank 0's own files, no collective).
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from wattgate.config import context_degree, expert_degree, replicate_degree
from wattgate.records.checkpoint import CheckpointState, Position
from wattgate.gpus import is_cpu
from wattgate.proof.depth import meta_model, truncate_layers
from wattgate.proof.experts import prepare_dry_run_experts
from wattgate.proof.hooks import ArmedStop, DryRunSteps, RecordingHeartbeat
from wattgate.proof.record import Collective, CollectiveRecorder, fake_host_reads, object_collectives
from wattgate.proof.relay import RankZeroRelay
from wattgate.proof.storage import NoBytesCheckpoints, NoBytesExport
from wattgate.train.checkpoint_hashing import HASH_ALGORITHM
from wattgate.train.loop import Trainer
from wattgate.train.mesh import data_parallel_mesh, forget_meshes, mesh_groups
from wattgate.train.model import bf16_mixed_precision
from wattgate.train.rank_inputs import Paths, rank_batches
from wattgate.train.seams import Seams
from wattgate.records.gate import ProofBeat
from wattgate.records.plan import Plan
from wattgate.records.run_config import ModelConfig, RunConfig, TrainConfig


@dataclass
class RankRecord:
    """What one rank issued: start-up (before the first step), each dry-run step's collectives, the end (export,
    summary), the graceful stop path and the resume; `classes` each dry-run step's class key as the Trainer
    computed it."""

    rank: int
    startup: list[Collective] = field(default_factory=list)
    steps: dict[int, list[Collective]] = field(default_factory=dict)
    classes: dict[int, list] = field(default_factory=dict)
    beats: dict[int, list[ProofBeat]] = field(default_factory=dict)  # per step: each heartbeat and the collective index
    end: list[Collective] = field(default_factory=list)
    stop: list[Collective] = field(default_factory=list)  # a step at which every rank agreed to stop, to its end
    stop_step: int | None = None  # that step (0-based)
    resume: list[Collective] = field(default_factory=list)  # a second Trainer's load from the newest checkpoint
    resume_step: int | None = None  # the step of the checkpoint it resumed from (None: it found none)
    layers: int = 0  # decoder layers in the proxy
    mesh_groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a 2-D mesh: each dimension's group
    experts: dict | None = None  # MoE: the experts' kernel in training and in this dry run, starved or not


def proxy_model(model_cfg: ModelConfig, train: TrainConfig, mesh, on_gpu: bool, depth: int):
    """The model at full width and `depth` layers on the meta device, sharded as the trainer shards it, then
    given FakeTensor storage on the CPU (FSDP2 refuses meta parameters in its lazy init)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from wattgate.train.model import meta_model_of, model_hf_config, parallelize
    from wattgate.train.weights import materialize

    config = model_hf_config(model_cfg)
    layers = int(config.num_hidden_layers)
    truncate_layers(config, min(layers, depth))  # the pattern's first layers
    # The model stays on meta, outside the fake mode, until materialize: FSDP2 splits each parameter into world-size
    # chunks, ops that cost far more each through FakeTensor dispatch (at world 1024 most of a dry run)
    with unset_fake_temporarily():
        model = meta_model_of(config, proof_attention(train, config))
        # on_cuda mirrors the real run's mixed-precision policy: its all-gathers are bf16 there
        parallelize(model, mesh, on_gpu, bf16_mixed_precision(train), train.activation_checkpointing, False)
    # a proxy shallower than model.path reads its own layers' tensors; the folder is checked at its own depth
    full_depth = meta_model(model_cfg) if depth < layers else None
    materialize(model, torch.device("cpu"), model_cfg, train.seed, fill=False, full_depth=full_depth)
    return model


def proof_attention(train: TrainConfig, config) -> str:
    """The attention kernel the dry run builds with: the run's own when it builds on the gate's CPU (sdpa, eager),
    else what `auto` picks on CPU among the kernels this model class supports (Gemma 2: eager). The kernel moves
    no collective (FSDP2's collectives follow the parameters), so only whether the model builds depends on it."""
    from wattgate.train.attention import resolve_attn_implementation
    from wattgate.train.model import causal_lm_class

    requested = train.attn_implementation if train.attn_implementation in ("sdpa", "eager") else "auto"
    return resolve_attn_implementation(requested, "cpu", False, causal_lm_class(config))


PROXY_SOURCE = "fake tensors (collective proof)"


@dataclass
class ProxyModel:
    """ModelSource of a dry run: the run's mesh (train/mesh.py, over the fake group's world) built from a real
    (tiny) tensor, its groups named in `recorder` and `record`; the model `proxy_model` builds, and its layer count
    (and, for Mixture-of-Experts, the experts' kernel) noted in `record`."""

    model_cfg: ModelConfig
    train: TrainConfig
    replicate: int
    expert: int
    on_gpu: bool
    depth: int
    record: RankRecord
    recorder: CollectiveRecorder
    starved: bool = False
    context: int = 1  # parallel.context

    def device_mesh(self):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the mesh's rank lookup reads its (tiny) tensor: a real one
            mesh = data_parallel_mesh("cpu", dist.get_world_size(), self.replicate, self.expert, self.context)
            groups = mesh_groups(mesh)
        self.recorder.mesh_groups.update(groups)
        self.record.mesh_groups = dict(groups.values())
        return mesh

    def build(self, mesh, fill: bool):
        model = proxy_model(self.model_cfg, self.train, mesh, self.on_gpu, self.depth)
        self.record.layers = int(model.config.num_hidden_layers)
        # Mixture-of-Experts: a kernel fake tensors run, and on the skewed run no token reaching any expert
        compute = torch.bfloat16 if self.on_gpu and bf16_mixed_precision(self.train) else torch.float32
        self.record.experts = prepare_dry_run_experts(model, compute, self.starved)
        return model, PROXY_SOURCE


def earlier_segment(plan: Plan) -> dict[str, CheckpointState]:
    """The checkpoint a continued plan (pack/segments.py) resumes from: the earlier segment's, at its first step."""
    if not plan.segments:
        return {}
    first = plan.first_step
    return {
        f"step-{first}": CheckpointState(
            step=first, position=Position(step=first), files={}, hash_algorithm=HASH_ALGORITHM
        )
    }


def stop_and_resume(trainer: Trainer, batches: tuple, stop: ArmedStop, steps: DryRunSteps, record: RankRecord) -> None:
    """After the run: the graceful stop path (the first dry-run step again with every rank asked to stop there, a
    time limit or preemption, through its checkpoint and STOPPED), then a resume (a second Trainer's start-up over
    the same `batches`, with the same seams: the checkpoint every rank agrees on, and DCP's load of it)."""
    from wattgate.train.data import StepPrefetcher

    collectives = steps.recorder.collectives
    g = next((g for g in steps.chosen if trainer.start <= g < trainer.total), None)
    if g is not None:
        mark = len(collectives)
        stop.arm()
        prefetch = StepPrefetcher(trainer.step_batches, trainer.total)
        try:
            stopped = trainer.run_step(g, prefetch)
        finally:
            prefetch.close()
        if stopped is not None:
            trainer.finish_stopped(*stopped)
        record.stop, record.stop_step = collectives[mark:], g
    mark = len(collectives)
    where = (trainer.rank, trainer.world, trainer.device)
    resumed = Trainer(trainer.config, trainer.plan, trainer.paths, where, trainer.seams, batches)
    record.resume = collectives[mark:]
    record.resume_step = resumed.start if resumed.source != PROXY_SOURCE else None


def dry_run_rank(
    config: RunConfig,
    paths: Paths,
    rank: int,
    steps: list[int],
    depth: int,
    replay: bool = True,
    starved: bool = False,
    relay: Path | None = None,
) -> RankRecord:
    """Rank `rank` of plan.json's world, from its plan to its export, its stop path and a resume, on the fake process
    group (`replay` False: every train step and validation pass runs, none replayed; for the tests that check the
    replay; `starved`: no token reaches any expert of an MoE model, proof/experts.py). `relay`: the folder rank 0's
    dry run sends through (proof/relay.py); rank 0 without one keeps its objects to itself, any other rank needs
    the one its rank 0 wrote."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from wattgate.run_files import read_plan

    plan, _ = read_plan(paths.plan_dir)
    world = plan.world_size * context_degree(config)  # under parallel.context the plan's are the data ranks
    # data_cache local is not copied, the ledger line goes to the work folder, and no TensorBoard events are
    # written (rank 0's own event files, no collective: not worth importing TensorBoard per dry run)
    config = config.replace(
        train=config.train.replace(data_cache="shared", tensorboard=False),
        forecast=config.forecast.replace(ledger=str(paths.out / "throughput.jsonl")),
    )
    shared = RankZeroRelay(relay, rank)
    record, recorder = RankRecord(rank), CollectiveRecorder()
    heartbeat, stop = RecordingHeartbeat(recorder), ArmedStop()
    steps_hook = DryRunSteps(recorder, heartbeat, record, steps, replay)
    on_gpu = not is_cpu(config.cluster.gpu_model)
    seams = Seams(
        heartbeat=heartbeat,
        stop=stop,
        model=ProxyModel(
            config.model,
            config.train,
            replicate_degree(config),
            expert_degree(config),
            on_gpu,
            depth,
            record,
            recorder,
            starved,
            context_degree(config),
        ),
        checkpoints=NoBytesCheckpoints(shared, earlier_segment(plan)),
        export=NoBytesExport(),
        hooks=steps_hook,
    )
    paths.out.mkdir(parents=True, exist_ok=True)
    hook = sys.excepthook  # init_process_group wraps it with a "[rank<r>]:" prefix that outlives the group
    forget_meshes()  # this rank's meshes equal another rank's to torch's caches (train/mesh.py)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        quiet = contextlib.redirect_stdout(io.StringIO())  # the trainer's progress lines are not the gate's
        with quiet, fake, recorder, fake_host_reads(), object_collectives(recorder, shared):
            where = (rank, world, torch.device("cpu"))
            batches = rank_batches(plan, paths, where, config.train.check_planned_counts, context_degree(config))
            trainer = Trainer(config, plan, paths, where, seams, batches)
            trainer.run()
            record.end = recorder.collectives[steps_hook.end_mark :]
            stop_and_resume(trainer, batches, stop, steps_hook, record)
    finally:
        shared.close()
        dist.destroy_process_group()
        forget_meshes()
        sys.excepthook = hook
    return record

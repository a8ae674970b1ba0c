"""One rank of the planned world, dry-run: the trainer's own code (train/loop.py `run_rank`, `Trainer.run`) on
the fake process group, with the model's tensors fake, recording every collective it issues.

What differs from a real rank, and why each is outside what the proof claims:
- the model is built at reduced depth (`depth` decoder layers, full width) with FakeTensors: shapes and
  dtypes without memory or arithmetic; the decoder layers are checked to be identical units (wattgate.proof.depth)
  so each step's collectives at the real depth follow from the proxy's;
- `steps_to_run` is one step of every class the plan gives any rank (wattgate.train.steps), each run in full:
  its micro-batches, its log, validation pass and checkpoint;
- tensor bytes are never written (a FakeTensor has none): torch.distributed.checkpoint's save is recorded as one
  collective fingerprinted by the state dict's structure (its internal exchange is a function of that
  structure), and the export's safetensors files are written sparse at their real sizes;
- a shared filesystem is simulated for the folders rank 0 creates before the others write into them;
- a continued plan (pack/segments.py) starts at its first step without loading a checkpoint (torch's DCP
  load is not dry-run);
- data_cache local is not copied (its barrier is on every rank alike), and the ledger line goes to the work
  folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from wattgate.gpus import is_cpu
from wattgate.proof.depth import truncate_layers
from wattgate.proof.experts import prepare_dry_run_experts
from wattgate.proof.record import Collective, CollectiveRecorder, _default_group, object_collectives
from wattgate.train import loop as train_loop
from wattgate.train.loop import Paths, Trainer, run_rank
from wattgate.train.settings import TrainSettings


@dataclass
class RankRecord:
    """What one rank issued: start-up (before the first step), each dry-run step's collectives, and the end
    (export, summary); `classes` each dry-run step's class key as the Trainer computed it."""

    rank: int
    startup: list[Collective] = field(default_factory=list)
    steps: dict[int, list[Collective]] = field(default_factory=dict)
    classes: dict[int, list] = field(default_factory=dict)
    beats: dict[int, list[dict]] = field(default_factory=dict)  # per step: each heartbeat and the collective index
    end: list[Collective] = field(default_factory=list)
    stop: list[Collective] = field(default_factory=list)  # a step at which every rank agreed to stop, to its end
    stop_step: int | None = None  # that step (0-based)
    layers: int = 0  # decoder layers in the proxy
    experts: dict | None = None  # MoE: the experts' kernel in training and in this dry run, starved or not


def proxy_model(model_cfg: dict, s: TrainSettings, mesh, on_gpu: bool, depth: int):
    """The model at full width and `depth` layers on the meta device, sharded as the trainer shards it, then
    given FakeTensor storage on the CPU (FSDP2 refuses meta parameters in its lazy init)."""
    from transformers import AutoModelForCausalLM

    from wattgate.train.model import model_hf_config, parallelize
    from wattgate.train.weights import materialize

    config = model_hf_config(model_cfg)
    truncate_layers(config, min(int(config.num_hidden_layers), depth))  # the pattern's first layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=proof_attention(s, config)
        )
    model.config.architectures = [type(model).__name__]
    # on_cuda mirrors the real run's mixed-precision policy: its all-gathers are bf16 there
    parallelize(model, mesh, on_gpu, s.mixed_precision, s.activation_checkpointing, False)
    materialize(model, torch.device("cpu"), model_cfg, s.seed, fill=False)
    return model


def proof_attention(s: TrainSettings, config) -> str:
    """The attention kernel the dry run builds with: the run's own when it builds on the gate's CPU (sdpa, eager),
    else what `auto` picks on CPU among the kernels this model class supports (Gemma 2: eager). The kernel moves
    no collective (FSDP2's collectives follow the parameters), so only whether the model builds depends on it."""
    from wattgate.train.attention import resolve_attn_implementation
    from wattgate.train.model import causal_lm_class

    requested = s.attn_implementation if s.attn_implementation in ("sdpa", "eager") else "auto"
    return resolve_attn_implementation(requested, "cpu", False, causal_lm_class(config))


class AskedToStop:
    """The stop request every rank of the dry run gets at its stop step (train/stop.py StopRequest's interface)."""

    def reason(self) -> str:
        return "a stop request (collective proof)"


class DryRunTrainer(Trainer):
    """The Trainer with the dry run's model, its chosen steps, and each step's collectives cut out."""

    proof: dict  # set by dry_run_rank: recorder, record, steps, depth, on_gpu

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        recorder, beats, beat = self.proof["recorder"], self.proof["beats"], self.heartbeat.beat

        def marked(step: int, epoch: int, phase: str, **extra) -> None:
            # where the watcher's view of a rank (its heartbeat) sits in the collective sequence
            beats.append({"index": len(recorder.collectives), "phase": phase, "micro": extra.get("micro")})
            beat(step, epoch, phase, **extra)

        self.heartbeat.beat = marked

    def device_mesh(self):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the mesh's rank lookup reads its (tiny) tensor: a real one
            return super().device_mesh()

    def build_model(self, mesh, fill: bool):
        p = self.proof
        model = proxy_model(self.config["model"], self.s, mesh, p["on_gpu"], p["depth"])
        p["record"].layers = int(model.config.num_hidden_layers)
        # Mixture-of-Experts: a kernel fake tensors run, and on the skewed run no token reaching any expert
        compute = torch.bfloat16 if p["on_gpu"] and self.s.mixed_precision else torch.float32
        p["record"].experts = prepare_dry_run_experts(model, compute, p.get("starved", False))
        return model, "fake tensors (collective proof)"

    def load(self) -> None:
        super().load()
        if self.plan.get("segments"):  # a continued plan resumes at its first step; the dry run has no checkpoint
            self.start = int(self.plan["segments"][-1]["first_step"])

    def run(self, micro_batches, eval_batches) -> dict:
        """The run as planned, then the stop path: the first dry-run step again with every rank asked to stop
        there (a time limit, preemption), through its checkpoint and STOPPED."""
        from wattgate.train.data import StepPrefetcher

        summary = super().run(micro_batches, eval_batches)
        recorder, record = self.proof["recorder"], self.proof["record"]
        g = next((g for g in self.proof["steps"] if self.start <= g < self.total), None)
        if g is None:
            return summary
        mark = len(recorder.collectives)
        self.proof["stop_mark"] = mark  # the export and summary end here
        self.stop_request = AskedToStop()
        prefetch = StepPrefetcher(self.step_batches, self.total)
        try:
            stopped = Trainer.run_step(self, g, prefetch)  # the Trainer's own step, not this class's recording one
        finally:
            prefetch.close()
        if stopped is not None:
            self.finish_stopped(*stopped)
        record.stop, record.stop_step = recorder.collectives[mark:], g
        return summary

    def steps_to_run(self) -> list[int]:
        record, recorder = self.proof["record"], self.proof["recorder"]
        record.startup = list(recorder.collectives)
        self.proof["end_mark"] = len(recorder.collectives)
        return [g for g in self.proof["steps"] if self.start <= g < self.total]

    def run_step(self, g: int, prefetch) -> None:
        recorder, record = self.proof["recorder"], self.proof["record"]
        mark, first_beat = len(recorder.collectives), len(self.proof["beats"])
        super().run_step(g, prefetch)
        record.steps[g] = recorder.collectives[mark:]
        record.beats[g] = [dict(b, index=b["index"] - mark) for b in self.proof["beats"][first_beat:]]
        record.classes[g] = self.step_class(g).key()
        self.proof["end_mark"] = len(recorder.collectives)

    def train_step(self, batches: list, on_micro):
        """The Trainer's own train step; a later one with the same micro-batches' shapes replays its collectives."""
        key = (
            "train",
            tuple(tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(host.items())) for _, host in batches),
        )
        return self.replayed(key, lambda beat: super(DryRunTrainer, self).train_step(batches, beat), on_micro)

    def evaluate(self, step: int, epoch: int):
        """The Trainer's own validation pass; a later one (the same micro-batches) replays its collectives."""
        beat = self.heartbeat.beat

        def run(recording):
            self.heartbeat.beat = lambda _step, _epoch, *args, **kwargs: recording(*args, **kwargs)
            try:
                with self.pass_forwards() if self.proof["replay"] else contextlib.nullcontext():
                    loss = super(DryRunTrainer, self).evaluate(step, epoch)
            finally:
                self.heartbeat.beat = beat
            return None if self.eval_interrupted else loss  # an interrupted pass is not one to replay

        self.eval_interrupted = False
        loss = self.replayed(("eval", len(self.eval_batches)), run, lambda *a, **k: beat(step, epoch, *a, **k))
        return loss

    @contextlib.contextmanager
    def pass_forwards(self):
        """Inside a validation pass: its first two forwards run, a later one with the same input shapes replays
        the collectives of the one before it and returns its loss. The first forward gathers the root's
        parameters and leaves them gathered (no backward reshards them), so from the second on every forward
        starts in the same state: the root gathered, every layer resharded after its own forward."""
        recorder, real, done = self.proof["recorder"], train_loop.summed_token_loss, []

        def forward(model, tensors: dict, loss):
            key = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(tensors.items()))
            if len(done) >= 2 and done[-1][0] == key:
                recorder.collectives.extend(done[-1][1])
                return done[-1][2]
            mark = len(recorder.collectives)
            out = real(model, tensors, loss)
            done.append((key, recorder.collectives[mark:], out))
            return out

        train_loop.summed_token_loss = forward
        try:
            yield
        finally:
            train_loop.summed_token_loss = real

    def replayed(self, key: tuple, run, beat):
        """`run(beat)` the first time this rank meets `key`, recording its collectives and heartbeats; later
        the same collectives and heartbeats (at the same places) and the same result, without running it.

        Why sound: the proof's premise is that collectives follow the plan's counts and shapes, never values;
        a train step's body and a validation pass are functions of nothing else once FSDP2 is initialized (a
        step starts and ends with every unit resharded), so a second run would issue the same sequence. Each
        rank still runs the Trainer's own code once for every key it has; it is what one step of each class
        shares with another (issue 31: the default's classes repeat one train step six times per rank)."""
        if not self.proof["replay"]:
            return run(beat)
        recorder, tapes = self.proof["recorder"], self.proof["tapes"]
        if key in tapes:
            collectives, beats, result = tapes[key]
            at = 0
            for offset, args, kwargs in beats:
                recorder.collectives.extend(collectives[at:offset])
                at = offset
                beat(*args, **kwargs)
            recorder.collectives.extend(collectives[at:])
            return result
        mark, beats = len(recorder.collectives), []

        def recording(*args, **kwargs):
            beats.append((len(recorder.collectives) - mark, args, kwargs))
            beat(*args, **kwargs)

        result = run(recording)
        if result is not None:
            tapes[key] = (recorder.collectives[mark:], beats, result)
        return result

    def save(self, step: int, epoch: int, eval_loss: float | None) -> None:
        if self.rank != 0:  # rank 0 made this folder on the shared filesystem before its first barrier
            (self.paths.out / "checkpoints" / f"step-{step}.tmp").mkdir(parents=True, exist_ok=True)
        super().save(step, epoch, eval_loss)

    def export(self) -> None:
        if self.rank != 0:
            (self.paths.out / "final.tmp").mkdir(parents=True, exist_ok=True)
        super().export()


def state_structure(state: dict) -> str:
    """16 hex of the state dict's structure (keys, global shapes, dtypes): what DCP's planning exchange reads."""

    def walk(value, prefix: str, out: list) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k], f"{prefix}.{k}", out)
        elif isinstance(value, torch.Tensor):
            out.append(f"{prefix}:{str(value.dtype)}{list(value.shape)}")
        else:
            out.append(f"{prefix}:{type(value).__name__}")

    items: list[str] = []
    walk(state, "", items)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


@contextlib.contextmanager
def byte_sinks(recorder: CollectiveRecorder):
    """No tensor bytes: DCP's save becomes one recorded collective over the state's structure, and a
    safetensors stream advances (sparse) by each tensor's size instead of reading its data."""
    import torch.distributed.checkpoint as dcp

    from wattgate.train import safetensors_io

    real_save, real_write = dcp.save, safetensors_io.SafetensorsStream.write

    def save(state, checkpoint_id=None, **kwargs):
        recorder.add("dcp.save", _default_group(None), f"state {state_structure(state)}")
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)

    def write(self, tensor: torch.Tensor) -> None:
        self.file.seek(tensor.numel() * torch.empty((), dtype=self.dtype).element_size(), 1)
        self.file.truncate()

    dcp.save, safetensors_io.SafetensorsStream.write = save, write
    try:
        yield
    finally:
        dcp.save, safetensors_io.SafetensorsStream.write = real_save, real_write


def dry_run_rank(
    config: dict, paths: Paths, rank: int, steps: list[int], depth: int, replay: bool = True, starved: bool = False
) -> RankRecord:
    """Rank `rank` of plan.json's world, from its plan to its export, on the fake process group (`replay`
    False: every train step and validation pass runs, none replayed; for the tests that check the replay; `starved`:
    no token reaches any expert of an MoE model, proof/experts.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from wattgate.run_files import read_plan

    plan, _ = read_plan(paths.plan_dir)
    world = int(plan["world_size"])
    s = dataclasses.replace(
        TrainSettings.from_config(config), data_cache="shared", ledger=paths.out / "throughput.jsonl"
    )
    record, recorder = RankRecord(rank), CollectiveRecorder()
    proof = {
        "recorder": recorder,
        "record": record,
        "steps": sorted(steps),
        "depth": depth,
        "end_mark": 0,
        "beats": [],
        "replay": replay,
        "tapes": {},
        "starved": starved,
    }
    proof["on_gpu"] = not is_cpu(config["cluster"]["gpu_model"])
    trainer_class = type("DryRunTrainer", (DryRunTrainer,), {"proof": proof})
    paths.out.mkdir(parents=True, exist_ok=True)
    hook = sys.excepthook  # init_process_group wraps it with a "[rank<r>]:" prefix that outlives the group
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        quiet = contextlib.redirect_stdout(io.StringIO())  # the trainer's progress lines are not the gate's
        with quiet, fake, recorder, object_collectives(recorder), byte_sinks(recorder):
            run_rank(trainer_class, (config, s, plan), paths, (rank, world, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
    record.end = recorder.collectives[proof["end_mark"] : proof.get("stop_mark")]
    return record

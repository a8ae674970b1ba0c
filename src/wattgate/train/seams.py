"""What a Trainer (train/loop.py) is given rather than builds: every part whose effect leaves the ranks'
collectives (bytes on disk, the watcher's heartbeats, a stop request, how the model is made) and the points
around its steps where a caller looks in.

Training passes `training_seams`: the run folder's checkpoints and final/, heartbeat files, the stop request
the signals and STOP_REQUESTED make, the sharded model from model.path or a seeded init, and `EveryStep`. The
collective proof (wattgate.proof.dryrun) passes its own (a fake-tensor model, storage that keeps no bytes,
heartbeats and steps recorded against the collectives) and runs the Trainer's own code unchanged: nothing of
the Trainer is overridden or patched, so what the gate proves is what `wattgate train` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from wattgate.train.checkpoint import CHECKPOINT_FOLDER, CheckpointStorage
from wattgate.train.weights import EXPORT_FOLDER, ExportFiles

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed.device_mesh import DeviceMesh

    from wattgate.records.run_config import ModelConfig, RunConfig, TrainConfig

    from wattgate.train.steps import StepClass

T = TypeVar("T")


class HeartbeatSink(Protocol):
    """The rank's heartbeat (wattgate.heartbeats.Heartbeat writes `heartbeat/rank-<r>.json` and its events)."""

    def set_plan(self, total_steps: int, epoch_ends: list[int]) -> None: ...

    def beat(self, step: int, epoch: int, phase: str, **extra) -> None: ...


class StopSource(Protocol):
    """Whether this rank has been asked to stop (train/stop.py StopRequest): a reason, or None."""

    def reason(self) -> str | None: ...


class ModelSource(Protocol):
    """The device mesh and the sharded model on it, with where its values came from."""

    def device_mesh(self) -> DeviceMesh: ...

    def build(self, mesh, fill: bool) -> tuple[torch.nn.Module, str]: ...


class StepHooks(Protocol):
    """Around the outline `run` -> `run_step` -> `train_step` / `evaluate`: which steps run, and each step, train
    part, validation pass and validation forward as it runs (`run()` is the Trainer's own code for it)."""

    def steps(self, start: int, total: int) -> Iterable[int]: ...

    def step(self, g: int, step_class: StepClass, run: Callable[[], T]) -> T: ...

    def train_part(self, batches: list, run: Callable[[], T]) -> T: ...

    def validation(self, micros: int, run: Callable[[], T]) -> T: ...

    def forward(self, tensors: dict[str, torch.Tensor], run: Callable[[], T]) -> T: ...


class EveryStep:
    """StepHooks of a training run: every step from the resume point, each part run as it is."""

    def steps(self, start: int, total: int) -> Iterable[int]:
        return range(start, total)

    def step(self, g: int, step_class: StepClass, run: Callable[[], T]) -> T:
        return run()

    def train_part(self, batches: list, run: Callable[[], T]) -> T:
        return run()

    def validation(self, micros: int, run: Callable[[], T]) -> T:
        return run()

    def forward(self, tensors: dict[str, torch.Tensor], run: Callable[[], T]) -> T:
        return run()


@dataclass(frozen=True)
class ShardedModel:
    """ModelSource of a training run: the mesh of train/mesh.py (1-D over the world, or HSDP's replicas of shard
    groups), the model built by train/model.py."""

    model_cfg: ModelConfig | dict
    train: TrainConfig
    device: torch.device
    world: int
    replicate: int = 1  # parallel.replicate, resolved (wattgate.config.replicate_degree)
    expert: int = 1  # parallel.expert
    context: int = 1  # parallel.context

    def device_mesh(self) -> DeviceMesh:
        from wattgate.train.mesh import data_parallel_mesh

        return data_parallel_mesh(self.device.type, self.world, self.replicate, self.expert, self.context)

    def build(self, mesh, fill: bool) -> tuple[torch.nn.Module, str]:
        from wattgate.train.model import load_sharded_model

        return load_sharded_model(self.model_cfg, self.train, mesh, self.device, fill)


@dataclass(frozen=True)
class Seams:
    """Everything a Trainer is given besides its config, plan, paths and place in the world."""

    heartbeat: HeartbeatSink
    stop: StopSource
    model: ModelSource
    checkpoints: CheckpointStorage = CHECKPOINT_FOLDER
    export: ExportFiles = EXPORT_FOLDER
    hooks: StepHooks = EveryStep()


def training_seams(config: RunConfig, out: Path, where: tuple[int, int, torch.device]) -> Seams:
    """The seams of `wattgate train`: this rank's heartbeat files and stop request in run folder `out`, and the
    model of `config` on its mesh (parallel.replicate), built as its `train` section says; checkpoints, final/ and
    the steps as the defaults have them."""
    import os

    from wattgate.config import context_degree, expert_degree, replicate_degree
    from wattgate.heartbeats import Heartbeat
    from wattgate.train.distributed import device_uuid
    from wattgate.train.stop import StopRequest

    rank, world, device = where
    heartbeat = Heartbeat(out, rank, int(os.environ.get("LOCAL_RANK", "0")), device_uuid(device))
    degrees = (replicate_degree(config), expert_degree(config), context_degree(config))
    model = ShardedModel(config.model, config.train, device, world, *degrees)
    return Seams(heartbeat, StopRequest(out), model)

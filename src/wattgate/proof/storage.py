"""Checkpoint and export storage for the collective proof: the dry run's checkpoints and final/ keep no bytes, while
everything around them runs as in training on the fake process group (train/checkpoint.py `save_checkpoint`,
`agreed_latest`, `load_checkpoint`, train/weights.py `export_hf_folder`): the barriers, the gathers, the resume
verdict, and torch.distributed.checkpoint's own save and load with their planning exchange. What DCP issues is
then recorded as it issues it (proof/record.py), not assumed.

- `NoBytesWriter`, DCP's StorageWriter: every write item is resolved by the planner (the state dict's value,
  as FileSystemWriter takes it) and counted, and nothing is kept.
- `NoBytesReader`, DCP's StorageReader: the checkpoint's metadata is what DCP's default planner records for the
  state the load fills, as this rank's save of it (every key; each tensor as this rank's chunks of it), and every
  tensor this rank's plan reads is looked up through the planner and committed without data; other values stay.
- `DryRunSavePlanner`: DCP's default save planner, less its check that the ranks' chunks tile every tensor. The dry
  run's gathers take every rank's object to be this rank's (proof/record.py), so the coordinator sees copies of its
  own plan, which cannot tile anything; in a real job a failed check raises on every rank at once (DCP sends the
  coordinator's exception to all), which hangs nobody.
- `NoBytesCheckpoints` (CheckpointStorage): the checkpoints rank 0 publishes are records in memory, relayed to the
  other ranks (proof/relay.py) as the shared run folder carries state.json; a continued plan (pack/segments.py)
  starts with the checkpoint its earlier segment left at the first step, so its dry run resumes from it.
- `NoBytesExport` (ExportFiles): final/'s files are counted, not written.
"""

from __future__ import annotations

import dataclasses
import io
from collections import ChainMap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from wattgate.records.checkpoint import CheckpointState, RunIdentity
from wattgate.proof.relay import RankZeroRelay
from wattgate.train.checkpoint import DAMAGED_SUFFIX


@dataclass(frozen=True)
class NoBytes:
    """Where an item would be in its file (DCP's storage_data for it)."""

    file: str
    offset: int
    length: int


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class NoBytesWriter(StorageWriter):
    """DCP's StorageWriter that resolves every item and keeps none; `written` is {file: {bytes}} of this rank."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)
        self.written: dict[str, dict] = {}

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]  # one file per rank

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name, offset, results = f"{plan.storage_data}0.distcp", 0, []
        for item in plan.items:
            data = planner.resolve_data(item)
            length = data.getbuffer().nbytes if isinstance(data, io.BytesIO) else data.numel() * data.element_size()
            results.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=NoBytes(name, offset, length))
            )
            offset += length
        self.written[name] = {"bytes": offset}
        return _done(results)

    def finish(self, metadata: Metadata, results: list) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def write_rng(self, name: str, state: dict) -> None:
        pass


def saved_metadata(state: dict) -> Metadata:
    """What DCP's default planner records when this rank saves `state` as the only rank: every key, each tensor
    with this rank's chunks of it."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    _, metadata = create_default_global_save_plan([planner.create_local_plan()])
    return metadata


class NoBytesReader(StorageReader):
    """DCP's StorageReader of a checkpoint without bytes into `state` (see the module docstring).

    It reads the plan this rank made: DCP's default global load plan is every rank's own local plan, unchanged
    (create_default_global_load_plan); in the dry run the scatter brings rank 0's, made for rank 0's shards."""

    def __init__(self, path: Path, state: dict):
        super().__init__()
        self.path, self.state = Path(path), state
        self.plan: LoadPlan | None = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return saved_metadata(self.state)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self.plan = plan
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for item in (self.plan or plan).items:
            if item.type != LoadItemType.BYTE_IO:  # a value other than a tensor stays as the state holds it
                planner.commit_tensor(item, planner.resolve_tensor(item).detach())
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class DryRunSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner without the check that the gathered plans' chunks tile every tensor (module docstring)."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata, planner_data=dict(ChainMap(*(p.planner_data for p in plans))))
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata


def _step_of(name: str) -> int:
    return int(name.split("-", 1)[1])


class NoBytesCheckpoints:
    """CheckpointStorage of a dry run (module docstring): `published` holds rank 0's checkpoints' state.json by
    folder name (`step-<n>`: every rank's dry run has its own run folder, the name is what they share)."""

    def __init__(self, relay: RankZeroRelay, seed: dict[str, CheckpointState] | None = None):
        self.relay = relay
        self.published: dict[str, CheckpointState] = dict(seed or {})

    def _record(self, path: Path) -> CheckpointState | None:
        name = Path(path).name
        return self.published.get(name) or self.relay.get(f"checkpoint {name}")

    def begin(self, tmp: Path) -> None:
        pass

    def writer(self, tmp: Path) -> NoBytesWriter:
        return NoBytesWriter(tmp)

    def save_planner(self) -> DryRunSavePlanner:
        return DryRunSavePlanner()

    def publish(self, tmp: Path, final: Path, state: CheckpointState) -> None:
        self.published[Path(final).name] = state
        self.relay.put(f"checkpoint {Path(final).name}", state)

    def prune(self, root: Path, keep: int, also_keep: Path | None, upto: int) -> None:
        complete = sorted((name for name in self.published if _step_of(name) <= upto), key=_step_of)
        for old in complete[:-keep]:
            if also_keep is None or old != also_keep.name:
                del self.published[old]

    def best(self, root: Path) -> Path | None:
        scored = [
            (state.position.eval_loss, -_step_of(name), name)
            for name, state in self.published.items()
            if state.position.eval_loss is not None
        ]
        return root / min(scored)[2] if scored else None

    def set_aside_mismatched(self, root: Path, identity: RunIdentity) -> None:
        pass  # every checkpoint of a dry run is this run's

    def candidates(self, root: Path) -> list[Path]:
        return [root / name for name in sorted(self.published, key=_step_of, reverse=True)]

    def verify(self, path: Path, share: tuple[int, int]) -> tuple[bool, str]:
        if self._record(path) is None:
            return False, f"{Path(path).name} was not saved in the dry run"
        return True, ""

    def set_aside(self, path: Path) -> Path:
        self.published.pop(Path(path).name, None)
        return Path(path).parent.with_name(Path(path).parent.name + DAMAGED_SUFFIX) / Path(path).name

    def reader(self, path: Path, state: dict) -> NoBytesReader:
        return NoBytesReader(path, state)

    def read_rng(self, path: Path, rank: int) -> None:
        return None

    def read_state(self, path: Path) -> CheckpointState:
        record = self._record(path)
        if record is None:
            raise RuntimeError(f"{Path(path).name} was not saved in the dry run")
        return record


class _Counted:
    """A safetensors stream that counts the bytes of what is written to it, each tensor in its entry's dtype."""

    def __init__(self, written: dict, name: str, entries: list):
        self.written, self.name = written, name
        self.itemsizes = iter([torch.empty((), dtype=dtype).element_size() for _, _, dtype in entries])
        written[name] = 0

    def write(self, tensor: torch.Tensor) -> None:
        self.written[self.name] += tensor.numel() * next(self.itemsizes)

    def close(self) -> None:
        pass


class NoBytesExport:
    """ExportFiles of a dry run: `written` is {file name: tensor bytes} of the safetensors files this rank wrote."""

    def __init__(self):
        self.written: dict[str, int] = {}

    def begin(self, tmp: Path) -> None:
        pass

    def stream(self, path: Path, entries: list) -> _Counted:
        return _Counted(self.written, Path(path).name, entries)

    def write_json(self, path: Path, record: dict) -> None:
        pass

    def write_config(self, path: Path, config) -> None:
        pass

    def copy(self, src: Path, dest: Path) -> None:
        pass

    def publish(self, tmp: Path, final: Path) -> None:
        pass

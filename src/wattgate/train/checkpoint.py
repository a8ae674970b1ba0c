"""Distributed checkpoints: model, optimizer, scheduler, RNG and data position, atomically published and
verified by content.

Every rank writes its shards with torch.distributed.checkpoint into `step-<n>.tmp/` through a writer that
hashes each file's bytes as it writes them (xxh3_128, the shards' algorithm), and its RNG state the same way;
rank 0 gathers every rank's {name: bytes, hash}, writes `state.json` (data position, scheduler, every file's
size and hash, `hash_algorithm`) and renames the folder to `step-<n>/`.

At resume rank 0 re-hashes the newest candidate before choosing it (`latest_complete`). One that is
incomplete or damaged is skipped with one line naming the file and what differs, and moved to the sibling
`checkpoints.damaged/`, as is every checkpoint above the one resumed from: they are off this run's path, and
left in place they would count toward `train.checkpoint_keep` and make prune (which keeps the highest steps)
delete the checkpoints this run writes next.

What every rank does together (the barriers, DCP's save and load, the gathers and the resume verdict) is
`save_checkpoint`, `agreed_latest` and `load_checkpoint`; where the bytes go is a `CheckpointStorage` they are
given: `CheckpointFolder` (the files above) in training, the collective proof's own that keeps no bytes
(wattgate.proof.storage), so DCP's own collectives are dry-run as training issues them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from wattgate.artifacts import write_json_atomic
from wattgate.errors import InputError
from wattgate.identity import identity_differences
from wattgate.records.checkpoint import CheckpointState, FileEntry, Position, RunIdentity
from wattgate.train.checkpoint_hashing import HASH_ALGORITHM, HashingWriter, named_error

STATE = "state.json"
DAMAGED_SUFFIX = ".damaged"  # checkpoints.damaged/: set aside at resume, never a candidate nor pruned


RNG_TORCH, RNG_CUDA = "torch", "cuda"  # a rank's RNG file: the CPU generator's state, each CUDA device's
MODEL, OPTIM = "model", "optim"  # the state dict DCP saves and loads


def _rng_state() -> dict:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {RNG_TORCH: torch.get_rng_state(), RNG_CUDA: cuda}


def _os_error_of(exc: CheckpointException, folder: Path) -> BaseException:
    """The OSError behind DCP's CheckpointException (every rank gets every rank's failures): a full disk is
    one line naming the file, not a traceback per rank. Anything else stays the CheckpointException."""
    for rank in sorted(exc.failures):
        err = exc.failures[rank][0]
        if isinstance(err, OSError):
            return named_error(err, folder)  # an fsync error names no file: the folder at least
    return exc


# ---------------------------------------------------------------- where the bytes go


class CheckpointWriter(Protocol):
    """DCP's storage writer for one checkpoint folder (a torch.distributed.checkpoint StorageWriter), which also
    writes this rank's RNG state and keeps {file name: record} of what this rank wrote (gathered for state.json)."""

    written: dict[str, dict]

    def write_rng(self, name: str, state: dict) -> None: ...


class CheckpointStorage(Protocol):
    """Where checkpoints' bytes go and come from; the collectives around them are `save_checkpoint`,
    `agreed_latest` and `load_checkpoint`, the same whatever the storage. Methods marked rank 0 run there only."""

    def begin(self, tmp: Path) -> None:
        """Rank 0: a fresh, empty `step-<n>.tmp/` (a killed save's leftovers removed)."""

    def writer(self, tmp: Path) -> StorageWriter:
        """This rank's writer into `tmp` (a CheckpointWriter)."""

    def save_planner(self) -> SavePlanner | None:
        """DCP's save planner (None: DCP's default)."""

    def publish(self, tmp: Path, final: Path, state: CheckpointState) -> None:
        """Rank 0: state.json written into `tmp`, then `tmp` renamed onto `final`."""

    def prune(self, root: Path, keep: int, also_keep: Path | None, upto: int) -> None:
        """Rank 0: the newest `keep` published checkpoints kept (and `also_keep`), none above `upto` counted."""

    def best(self, root: Path) -> Path | None:
        """Rank 0: the published checkpoint with the lowest validation loss, or None."""

    def set_aside_mismatched(self, root: Path, identity: RunIdentity) -> None:
        """Rank 0, at resume: `root` moved aside when it holds checkpoints of another run identity."""

    def candidates(self, root: Path) -> list[Path]:
        """Rank 0, at resume: the published checkpoints, newest first."""

    def verify(self, path: Path, share: tuple[int, int]) -> tuple[bool, str]:
        """Every rank, at resume: (intact, why not) for its `share` (k, n) of the checkpoint's files."""

    def set_aside(self, path: Path) -> Path:
        """Rank 0: a checkpoint that is not intact moved out of the candidates; returns where it went."""

    def reader(self, path: Path, state: dict) -> StorageReader:
        """This rank's DCP reader of checkpoint `path` into `state` (the state dict the load fills)."""

    def read_rng(self, path: Path, rank: int) -> dict | None:
        """Rank `rank`'s saved RNG state (None: none was saved)."""

    def read_state(self, path: Path) -> CheckpointState:
        """The checkpoint's state.json."""


class CheckpointFolder:
    """CheckpointStorage on the run folder's file system: the files this module's docstring describes."""

    def begin(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def writer(self, tmp: Path) -> HashingWriter:
        return HashingWriter(tmp, {})

    def save_planner(self) -> None:
        return None

    def publish(self, tmp: Path, final: Path, state: CheckpointState) -> None:
        write_json_atomic(tmp / STATE, state.to_json())
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)

    def prune(self, root: Path, keep: int, also_keep: Path | None, upto: int) -> None:
        prune(root, keep, also_keep, upto=upto)

    def best(self, root: Path) -> Path | None:
        return best_checkpoint(root)

    def set_aside_mismatched(self, root: Path, identity: RunIdentity) -> None:
        set_aside_mismatched(root, identity)

    def candidates(self, root: Path) -> list[Path]:
        return _candidates(root)

    def verify(self, path: Path, share: tuple[int, int]) -> tuple[bool, str]:
        return verify(path, share)

    def set_aside(self, path: Path) -> Path:
        return set_aside(path)

    def reader(self, path: Path, state: dict) -> StorageReader:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)

    def read_rng(self, path: Path, rank: int) -> dict | None:
        rng_file = path / f"rng-rank-{rank}.pt"
        return read_rng_state(rng_file) if rng_file.exists() else None

    def read_state(self, path: Path) -> CheckpointState:
        return CheckpointState.read(path / STATE, "train")


CHECKPOINT_FOLDER = CheckpointFolder()


# ---------------------------------------------------------------- save, publish, prune


def save_checkpoint(
    root: Path,
    model,
    optimizer,
    position: Position,
    keep: int,
    identity: RunIdentity | None,
    keep_best: bool = False,
    storage: CheckpointStorage = CHECKPOINT_FOLDER,
) -> Path:
    """Write the checkpoint of `position.step` (all ranks), publish it, and prune to the newest `keep` (rank 0);
    `keep_best` also keeps the one whose position holds the lowest validation loss (`eval_loss`, train.keep_best).

    A write error (e.g. a full disk) raises the OSError naming the file on every rank; `step-<n>.tmp/` stays
    unpublished (never a resume candidate; the next save of that step starts it over)."""
    rank, step = dist.get_rank(), position.step
    assert step is not None, "a checkpoint's position names its step (train writes it into every one)"
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    if rank == 0:
        storage.begin(tmp)
    dist.barrier()
    state = {MODEL: get_model_state_dict(model), OPTIM: get_optimizer_state_dict(model, optimizer)}
    writer = storage.writer(tmp)
    ours = cast(CheckpointWriter, writer)  # CheckpointStorage.writer's contract: a StorageWriter and a CheckpointWriter
    try:
        dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer, planner=storage.save_planner())
    except CheckpointException as exc:
        raise _os_error_of(exc, tmp) from None
    ours.write_rng(f"rng-rank-{rank}.pt", _rng_state())
    # each rank knows only its own files' hashes; the gather is also the wait for every rank's files
    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(ours.written, gathered, dst=0)
    if rank == 0:
        assert gathered is not None  # rank 0 gathers
        files = {name: FileEntry.from_json(rec, STATE) for part in gathered for name, rec in (part or {}).items()}
        record = CheckpointState(
            step=step,
            position=position,
            files=dict(sorted(files.items())),
            hash_algorithm=HASH_ALGORITHM,
            world_size=dist.get_world_size(),
            identity=identity,
        )
        storage.publish(tmp, final, record)
        storage.prune(root, keep, storage.best(root) if keep_best else None, upto=step)
    dist.barrier()
    return final


def prune(root: Path, keep: int, also_keep: Path | None = None, upto: int | None = None) -> None:
    """Keep the newest `keep` published checkpoints (and `also_keep`). With `upto` (the step just saved) one
    numbered higher is neither counted nor deleted: resume moves those aside, and counting one would delete
    this run's own."""
    complete = sorted(
        (p for p in root.glob("step-*") if p.suffix != ".tmp" and (upto is None or _step_of(p) <= upto)),
        key=_step_of,
    )
    for old in complete[:-keep]:
        if also_keep is None or old != also_keep:
            shutil.rmtree(old, ignore_errors=True)


def eval_loss_of(path: Path) -> float | None:
    """The validation loss recorded with a complete checkpoint (None: no pass ran at its step, or unreadable)."""
    state, _ = _read_state(path)
    return float(state.position.eval_loss) if state is not None and state.position.eval_loss is not None else None


def best_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the lowest validation loss (the newest of equals); None if none has one."""
    scored = []
    for path in root.glob("step-*"):
        loss = eval_loss_of(path) if path.is_dir() and path.suffix != ".tmp" and is_complete(path)[0] else None
        if loss is not None:
            scored.append((loss, -_step_of(path), path))
    return min(scored)[2] if scored else None


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("-", 1)[1])
    except ValueError:
        return -1


# ---------------------------------------------------------------- which checkpoint is loadable


def _read_state(path: Path) -> tuple[CheckpointState | None, str]:
    """(state.json, "") when it is a checkpoint state, else (None, why): `files` maps every name to
    {bytes, hash} under `hash_algorithm`."""
    try:
        data = json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError, RecursionError):
        return None, f"no readable {STATE}"
    try:
        state = CheckpointState.from_json(data, STATE)
    except InputError as exc:
        return None, f"{STATE} is not a checkpoint state ({str(exc).removeprefix(STATE + ': ')})"
    if state.hash_algorithm != HASH_ALGORITHM:
        return None, f"{STATE} records {state.hash_algorithm!r} hashes; this wattgate verifies {HASH_ALGORITHM}"
    if any(entry.hash is None for entry in state.files.values()):
        return None, f"{STATE} is not a checkpoint state ('files' maps each name to its bytes and hash)"
    return state, ""


def is_complete(path: Path) -> tuple[bool, str]:
    """Every file state.json lists present at its size (cheap: no byte is read; `verify` reads them all)."""
    state, why = _read_state(path)
    if state is None:
        return False, why
    for name in state.files:
        f = path / name
        if not f.exists():
            return False, f"missing {name}"
        if f.stat().st_size != state.size_of(name):
            return False, f"{name} is {f.stat().st_size} bytes, expected {state.size_of(name)}"
    return True, ""


def file_hash(path: Path) -> str:
    """xxh3_128 of a file, memory-mapped and hashed in place (as data/pretokenize.py shard_hash)."""
    import mmap

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                h.update(mm)
    return h.hexdigest()


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> tuple[bool, str]:
    """is_complete, then the content hash of every file against the one state.json recorded when it was written.
    `share` (k, n): only every n-th file from the k-th is hashed, so n ranks read a checkpoint once between them
    (`agreed_latest`)."""
    ok, why = is_complete(path)
    if not ok:
        return ok, why
    state, _ = _read_state(path)
    assert state is not None  # is_complete just read it
    k, n = share
    for name, entry in sorted(state.files.items())[k::n]:
        try:
            got = file_hash(path / name)
        except OSError as exc:
            return False, f"{name} is unreadable ({exc.strerror or exc})"
        if got != entry.hash:
            return False, f"{name} has {HASH_ALGORITHM} {got}, {STATE} recorded {entry.hash} (its bytes changed)"
    return True, ""


def agreed_latest(root: Path, rank: int, world: int, storage: CheckpointStorage = CHECKPOINT_FOLDER) -> Path | None:
    """`latest_complete` with every rank reading its share of each candidate's bytes: rank 0 lists the candidates
    and broadcasts them, each rank hashes every world-th file, one object all-gather per candidate gives every rank
    the same verdict. A 100 GB checkpoint is then read at the job's aggregate bandwidth, not rank 0's."""
    names: list = [None]
    if rank == 0:
        names = [[str(p) for p in storage.candidates(root)]]
    dist.broadcast_object_list(names, src=0)
    for candidate in map(Path, names[0] or []):
        ok, why = storage.verify(candidate, (rank, world))
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, None if ok else why)
        problem = next((v for v in verdicts if v is not None), None)
        if problem is None:
            return candidate
        if rank == 0:
            where = storage.set_aside(candidate)
            print(
                f"train: WARNING: skipping checkpoint {candidate}: {problem}; moved to {where}",
                file=sys.stderr,
                flush=True,
            )
    return None


def _candidates(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step-*") if p.is_dir() and p.suffix != ".tmp"), key=_step_of, reverse=True)


def newest_recorded_identity(root: Path) -> tuple[RunIdentity | None, Position | None] | None:
    """(identity, position) the newest checkpoint under `root` with a readable state.json records; None without
    one. What a run folder from before launch recorded its identity says about the run in it."""
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step-*"), key=_step_of, reverse=True):
        state, _ = _read_state(path)
        if state is not None:
            return state.identity, state.position
    return None


def set_aside_mismatched(root: Path, identity: RunIdentity) -> Path | None:
    """Move `root` aside when it holds checkpoints of another run identity (wattgate/identity.py).

    Resuming those would return the old model (or mix its weights with a new schedule). Called
    by rank 0 before it picks the resume point; one line names the keys that differ.
    """
    if not root.is_dir():
        return None
    differing: dict[str, list[str]] = {}
    for path in sorted(root.glob("step-*"), key=_step_of):
        state, _ = _read_state(path)
        if state is None:
            continue
        diffs = identity_differences(state.identity, identity, state.position)
        if diffs:
            differing[path.name] = diffs
    if not differing:
        return None
    stale = root.with_name(f"{root.name}.stale-{int(time.time())}")
    os.replace(root, stale)
    newest = max(differing, key=lambda name: _step_of(Path(name)))
    held = ", ".join(sorted(differing, key=lambda n: _step_of(Path(n))))
    print(
        f"train: WARNING: {root} held checkpoints of another run ({held}; "
        f"{newest} differs in {', '.join(differing[newest])}); moved to {stale}, starting from step 0",
        file=sys.stderr,
        flush=True,
    )
    return stale


def set_aside(path: Path) -> Path:
    """Move checkpoint folder `path` into the sibling `<root>.damaged/` (a name already there gets the time in ns)."""
    folder = path.parent.with_name(path.parent.name + DAMAGED_SUFFIX)
    folder.mkdir(exist_ok=True)
    dest = folder / path.name
    if dest.exists():  # that step was set aside before: keep both
        dest = folder / f"{path.name}.{time.time_ns()}"
    os.replace(path, dest)
    return dest


def latest_complete(root: Path) -> Path | None:
    """The newest intact checkpoint (rank 0, at resume): each candidate, newest first, is verified by content.

    One that is not intact is reported in one line and moved to `<root>.damaged/`, so every checkpoint left
    in `root` is at or below the step resumed from: those above are off this run's path, and would count
    toward checkpoint_keep and make prune delete this run's newer ones."""
    speak = not dist.is_initialized() or dist.get_rank() == 0
    for path in _candidates(root):
        ok, why = verify(path)
        if ok:
            return path
        where = set_aside(path)
        if speak:
            print(f"train: WARNING: skipping checkpoint {path}: {why}; moved to {where}", file=sys.stderr, flush=True)
    return None


def load_checkpoint(path: Path, model, optimizer, storage: CheckpointStorage = CHECKPOINT_FOLDER) -> CheckpointState:
    """Restore model, optimizer and this rank's RNG; returns state.json (data position, step)."""
    state: dict[str, Any] = {MODEL: get_model_state_dict(model), OPTIM: get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path), storage_reader=storage.reader(path, state))
    set_model_state_dict(model, state[MODEL])
    set_optimizer_state_dict(model, optimizer, state[OPTIM])
    rng = storage.read_rng(path, dist.get_rank())
    if rng is not None:
        torch.set_rng_state(rng[RNG_TORCH])
        if rng[RNG_CUDA]:
            torch.cuda.set_rng_state_all(rng[RNG_CUDA])
    return storage.read_state(path)


def read_rng_state(path: Path) -> dict:
    """A rank's saved RNG state: tensors only, so a tampered file can never run code when unpickled."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise InputError(
            f"{path}: not an RNG state wattgate wrote ({str(exc).splitlines()[0]}); delete this checkpoint folder"
        ) from None

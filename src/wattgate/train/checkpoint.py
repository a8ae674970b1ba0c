"""Distributed checkpoints: model, optimizer, scheduler, RNG and data position, atomically published.

Every rank writes its shards with torch.distributed.checkpoint into
`step-<n>.tmp/`; rank 0 then writes `state.json` (data position, scheduler,
and the size of every file) and renames the folder to `step-<n>/`. A folder
is loaded only if state.json lists files that are all present with their
sizes; anything else is skipped with a warning, never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from wattgate.artifacts import write_json_atomic
from wattgate.errors import InputError
from wattgate.identity import identity_differences

STATE = "state.json"


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def save_checkpoint(
    root: Path, step: int, model, optimizer, position: dict, keep: int, identity: dict, keep_best: bool = False
) -> Path:
    """Write checkpoint `step` (all ranks), publish it, and prune to the newest `keep` (rank 0); `keep_best`
    also keeps the one whose position holds the lowest validation loss (`eval_loss`, train.keep_best)."""
    rank = dist.get_rank()
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-rank-{rank}.pt")
    dist.barrier()
    if rank == 0:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        write_json_atomic(
            tmp / STATE,
            {
                "step": step,
                "position": position,
                "files": files,
                "world_size": dist.get_world_size(),
                "identity": identity,
            },
        )
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        prune(root, keep, best_checkpoint(root) if keep_best else None)
    dist.barrier()
    return final


def prune(root: Path, keep: int, also_keep: Path | None = None) -> None:
    complete = sorted((p for p in root.glob("step-*") if p.suffix != ".tmp"), key=_step_of)
    for old in complete[:-keep]:
        if also_keep is None or old != also_keep:
            shutil.rmtree(old, ignore_errors=True)


def eval_loss_of(path: Path) -> float | None:
    """The validation loss recorded with a complete checkpoint (None: no pass ran at its step, or unreadable)."""
    try:
        state = json.loads((path / STATE).read_text())
        loss = (state.get("position") or {}).get("eval_loss")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None


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


def is_complete(path: Path) -> tuple[bool, str]:
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError, RecursionError):
        return False, f"no readable {STATE}"
    files = state.get("files", {}) if isinstance(state, dict) else None
    if not isinstance(files, dict) or not isinstance(state.get("step"), int):
        return False, f"{STATE} is not a checkpoint state (an object with a whole 'step' and 'files')"
    for name, size in files.items():
        f = path / name
        if not f.exists():
            return False, f"missing {name}"
        if f.stat().st_size != size:
            return False, f"{name} is {f.stat().st_size} bytes, expected {size}"
    return True, ""


def set_aside_mismatched(root: Path, identity: dict) -> Path | None:
    """Move `root` aside when it holds checkpoints of another run identity (wattgate/identity.py).

    Resuming those would return the old model (or mix its weights with a new schedule). Called
    by rank 0 before it picks the resume point; one line names the keys that differ.
    """
    if not root.is_dir():
        return None
    differing: dict[str, list[str]] = {}
    for path in sorted(root.glob("step-*"), key=_step_of):
        try:
            state = json.loads((path / STATE).read_text())
            recorded, position = state.get("identity"), state.get("position")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        diffs = identity_differences(recorded, identity, position)
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


def latest_complete(root: Path) -> Path | None:
    """The newest loadable checkpoint; incomplete ones are reported and skipped."""
    candidates = sorted(
        (p for p in root.glob("step-*") if p.is_dir() and p.suffix != ".tmp"), key=_step_of, reverse=True
    )
    for path in candidates:
        ok, why = is_complete(path)
        if ok:
            return path
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"train: WARNING: skipping checkpoint {path}: {why}", file=sys.stderr, flush=True)
    return None


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG; returns state.json (data position, step)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    rng_file = path / f"rng-rank-{dist.get_rank()}.pt"
    if rng_file.exists():
        rng = read_rng_state(rng_file)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"]:
            torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / STATE).read_text())


def read_rng_state(path: Path) -> dict:
    """A rank's saved RNG state: tensors only, so a tampered file can never run code when unpickled."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise InputError(
            f"{path}: not an RNG state wattgate wrote ({str(exc).splitlines()[0]}); delete this checkpoint folder"
        ) from None

"""What one rank reads before its Trainer starts (train/loop.py): the pretokenized data (copied to node-local
scratch with train.data_cache local) and its planned train and validation micro-batches, once the sequence
guard has compared every rank's plan."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from wattgate.artifacts import sha256_file
from wattgate.errors import InputError
from wattgate.records.plan import Plan
from wattgate.records.run_config import TrainConfig
from wattgate.run_files import EVAL_PACKS, MANIFEST, read_manifest
from wattgate.train.data import MicroBatchPlan, read_rank_plan
from wattgate.train.sequence_guard import check_planned_sequences, planned_sequence


@dataclass(frozen=True)
class Paths:
    """A run's folders: the pretokenized data, the plan (pack's output) and the run folder."""

    pretokenized: Path
    plan_dir: Path
    out: Path


def stage_local_copy(pretokenized: Path, train: TrainConfig, out: Path) -> tuple[Path, float]:
    """data_cache local: copy the shards to node-local scratch once per node; returns (path, seconds)."""
    if train.data_cache != "local":
        return pretokenized, 0.0
    root = Path(train.local_cache_dir or os.environ.get("TMPDIR") or "/tmp")
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


def read_eval_plan(plan_dir: Path, plan: Plan, rank: int) -> list[MicroBatchPlan]:
    """This rank's validation micro-batches (none without a split), from the eval_packs.parquet plan.json names:
    the gate's marker covers plan.json, and plan.json the pass's file by its hash."""
    section = plan.validation
    if section is None:
        return []
    path = plan_dir / EVAL_PACKS
    try:
        actual = sha256_file(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot read the validation pass ({exc.strerror}); rerun pack and gate") from None
    if actual != section.packs_sha256:
        raise InputError(f"{path}: changed since it was planned (sha256 differs from plan.json); rerun pack and gate")
    return read_rank_plan(plan_dir, rank, EVAL_PACKS)


def rank_batches(plan: Plan, paths: Paths, where: tuple, check_counts: bool, context: int = 1) -> tuple[list, list]:
    """This rank's train and validation micro-batches, once the sequence guard has compared every rank's plan
    (`check_counts`: train.check_planned_counts); the collective proof (wattgate.proof) calls this and builds the
    Trainer with its own seams on the fake process group, so start-up is proved as it runs.

    With parallel.context C the plan is the data-parallel ranks': rank r trains data rank r // C's micro-batches
    (train/mesh.py context_mesh: the C consecutive ranks of a context group share them)."""
    rank, _, device = where
    micro_batches = read_rank_plan(paths.plan_dir, rank // context)
    eval_batches = read_eval_plan(paths.plan_dir, plan, rank // context)
    if check_counts:
        check_planned_sequences(planned_sequence(micro_batches, eval_batches), device)
    elif rank == 0:
        print("train: WARNING: train.check_planned_counts is false: uneven plans will hang", file=sys.stderr)
    return micro_batches, eval_batches

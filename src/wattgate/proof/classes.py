"""The step classes a plan gives each rank, from packs.parquet, eval_packs.parquet and plan.json alone (no run):
the same functions the loop calls (wattgate.train.steps), fed from the plan's columns instead of the rank's
micro-batch list."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wattgate.records.gate import ClassDivergence
from wattgate.records.plan import Plan
from wattgate.run_files import EVAL_PACKS
from wattgate.run_files import PACKS, arrow_numpy, read_parquet
from wattgate.train.steps import StepClass, rank_schedule, rank_step_classes


def rank_steps(epoch: np.ndarray, step: np.ndarray, micro: np.ndarray) -> tuple[list[int], list[int]]:
    """One rank's planned steps in execution order: (each step's epoch, each step's micro-batch count)."""
    if not len(epoch):
        return [], []
    keys = np.unique(np.stack([epoch, step, micro], axis=1).astype(np.int64), axis=0)  # sorted like read_rank_plan
    steps, counts = np.unique(keys[:, :2], axis=0, return_counts=True)
    return steps[:, 0].tolist(), counts.tolist()


@dataclass(frozen=True)
class PlanColumns:
    """The placement columns of a packs.parquet (or eval_packs.parquet), one entry per row."""

    epoch: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    rank: np.ndarray


def plan_columns(plan_dir: Path, name: str) -> PlanColumns | None:
    path = Path(plan_dir) / name
    if not path.exists():
        return None
    table = read_parquet(path, ["epoch", "step", "micro", "rank"], "pack")
    return PlanColumns(*(arrow_numpy(table.column(c)) for c in ("epoch", "step", "micro", "rank")))


def eval_micros_by_rank(cols: PlanColumns | None, world: int) -> list[int]:
    """The validation pass's micro-batch count on each rank (0 without a pass)."""
    if cols is None:
        return [0] * world
    return [len(np.unique(cols.micro[cols.rank == r])) for r in range(world)]


def classes_by_rank(plan: Plan, plan_dir: Path, s) -> list[list[StepClass]]:
    """Every rank's class at every global step it runs (a fresh start), from the plan's files."""
    world = plan.world_size
    cols = plan_columns(plan_dir, PACKS)
    evals = eval_micros_by_rank(plan_columns(plan_dir, EVAL_PACKS) if plan.validation is not None else None, world)
    validation = any(evals)
    out = []
    for r in range(world):
        mine = cols.rank == r
        epochs, micros = rank_steps(cols.epoch[mine], cols.step[mine], cols.micro[mine])
        sched = rank_schedule(plan, epochs, s, validation)
        out.append(rank_step_classes(sched, micros, evals[r], start=sched.first_step))
    return out


def first_steps(classes: list[list[StepClass]], first: int = 0) -> list[int]:
    """The global steps to dry-run: for every rank, the first step of each class it has (the union over ranks,
    so a step where ranks differ is run by all of them)."""
    chosen: set[int] = set()
    for seq in classes:
        seen: set[StepClass] = set()
        for i, c in enumerate(seq):
            if c not in seen:
                seen.add(c)
                chosen.add(first + i)
    return sorted(chosen)


def class_divergence(classes: list[list[StepClass]], first: int = 0) -> ClassDivergence | None:
    """Where some rank's class sequence first differs from rank 0's (None: every rank's is the same)."""
    base = classes[0]
    for r, seq in enumerate(classes[1:], 1):
        for i in range(max(len(seq), len(base))):
            mine = seq[i] if i < len(seq) else None
            ref = base[i] if i < len(base) else None
            if mine != ref:
                return ClassDivergence(
                    rank=r,
                    step=first + i + 1,
                    label=mine.label if mine else "no step",
                    rank0_class=ref.label if ref else "no step",
                )
    return None

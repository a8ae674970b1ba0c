"""The step classes a plan gives each rank, from packs.parquet, eval_packs.parquet and plan.json alone (no run):
the same functions the loop calls (wattgate.train.steps), fed from the plan's columns instead of the rank's
micro-batch list."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wattgate.records.gate import ClassDivergence
from wattgate.records.plan import Plan
from wattgate.records.run_config import TrainConfig
from wattgate.run_files import EVAL_PACKS
from wattgate.run_files import PACKS, arrow_numpy, read_parquet
from wattgate.train.steps import StepClass, rank_schedule, rank_step_classes


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


def micro_batches_by_rank(cols: PlanColumns | None, world: int, keys: tuple[str, ...]) -> list[tuple]:
    """Per rank, its micro-batches in execution order: (their `keys` columns, an array of one row per micro-batch;
    the packed rows each holds). One sort of the whole plan, not one pass per rank."""
    if cols is None:
        return [(np.zeros((0, len(keys)), np.int64), np.zeros(0, np.int64))] * world
    stacked = np.stack([cols.rank, *(getattr(cols, k) for k in keys)], axis=1).astype(np.int64)
    micros, rows = np.unique(stacked, axis=0, return_counts=True)  # sorted by rank, then as read_rank_plan reads
    bounds = np.searchsorted(micros[:, 0], np.arange(world + 1))
    return [(micros[a:b, 1:], rows[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class RankPlan:
    """What a rank's plan gives it, as far as its collectives can tell: its class at every global step it runs (a
    fresh start), and the packed rows of each of its micro-batches in order (training's, then validation's): the
    micro-batch shapes."""

    classes: list[StepClass]
    rows: bytes


def plans_by_rank(plan: Plan, plan_dir: Path, train: TrainConfig) -> list[RankPlan]:
    """Every rank's RankPlan, from the plan's files and the config's `train` section (the same functions the loop
    calls)."""
    world = plan.world_size
    train_micros = micro_batches_by_rank(plan_columns(plan_dir, PACKS), world, ("epoch", "step", "micro"))
    eval_cols = plan_columns(plan_dir, EVAL_PACKS) if plan.validation is not None else None
    evals = micro_batches_by_rank(eval_cols, world, ("micro",))
    validation = any(len(rows) for _, rows in evals)
    out = []
    for (micros, rows), (_, eval_rows) in zip(train_micros, evals):
        steps, counts = np.unique(micros[:, :2], axis=0, return_counts=True)
        sched = rank_schedule(plan, steps[:, 0].tolist(), train, validation)
        classes = rank_step_classes(sched, counts.tolist(), len(eval_rows), start=sched.first_step)
        out.append(RankPlan(classes, rows.tobytes() + b"/" + eval_rows.tobytes()))
    return out


def classes_by_rank(plan: Plan, plan_dir: Path, train: TrainConfig) -> list[list[StepClass]]:
    """Every rank's class at every global step it runs (a fresh start), from the plan's files."""
    return [p.classes for p in plans_by_rank(plan, plan_dir, train)]


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

"""The train stage's tables, written by rank 0 and read by the report: metrics.parquet (a row per step and rank)
and eval.parquet (a row per validation pass, with each held-out source's columns after the whole's), their
schemas and the writers that rewrite them atomically (docs/architecture.md "Artifacts")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path
from wattgate.run_files import EVAL, check_columns, read_metrics_table, read_parquet

if TYPE_CHECKING:
    import pandas as pd


# column names of metrics.parquet and eval.parquet (readers index rows and frames by these)
STEP, RANK, EPOCH, LOSS, TOKENS, LOSS_TOKENS = "step", "rank", "epoch", "loss", "tokens", "loss_tokens"
STEP_TIME_S, DATA_WAIT_S, LR, TIME, GRAD_NORM = "step_time_s", "data_wait_s", "lr", "time", "grad_norm"
PERPLEXITY, SECONDS = "perplexity", "seconds"  # eval.parquet

METRICS_SCHEMA = pa.schema(
    [
        (STEP, pa.int64()),
        (RANK, pa.int32()),
        (EPOCH, pa.int32()),
        (LOSS, pa.float64()),
        (TOKENS, pa.int64()),
        (LOSS_TOKENS, pa.int64()),
        (STEP_TIME_S, pa.float64()),
        (DATA_WAIT_S, pa.float64()),
        (LR, pa.float64()),
        (TIME, pa.float64()),
        # the step's gradient norm before clipping, over the whole model (the same on every rank's row); null in
        # rows written before the column existed (a run resumed across the change)
        (GRAD_NORM, pa.float64()),
    ]
)


class MetricsTable:
    """Rows per (step, rank), held by rank 0 and rewritten atomically (so a kill keeps all flushed rows)."""

    SCHEMA = METRICS_SCHEMA

    def __init__(self, path: Path, rows: list[dict] | None = None):
        self.path = path
        self.rows: list[dict] = rows or []
        self.schema = self.SCHEMA

    @classmethod
    def resume(cls, path: Path, upto_step: int) -> MetricsTable:
        """Rows of steps already taken (<= upto_step) from an earlier, interrupted run."""
        table = read_metrics_table(path) if upto_step >= 0 else None
        if table is None:
            return cls(path)
        return cls(path, [r for r in table.to_pylist() if r[STEP] <= upto_step])

    def add(self, rows: list[dict]) -> None:
        self.rows.extend(rows)

    def flush(self) -> None:
        table = pa.Table.from_pylist(self.rows, schema=self.schema)
        with atomic_path(self.path) as tmp:
            pq.write_table(table, tmp)


EVAL_SCHEMA = pa.schema(
    [
        (STEP, pa.int64()),  # the optimizer step the pass followed (1-based)
        (EPOCH, pa.int32()),
        (LOSS, pa.float64()),  # summed token losses / loss tokens, over every rank
        (PERPLEXITY, pa.float64()),
        (TOKENS, pa.int64()),  # loss tokens scored
        (SECONDS, pa.float64()),  # the pass's wall time
        (TIME, pa.float64()),  # unix s at its end
    ]
)


# With two or more held-out sources (a mixture), each source's columns follow EVAL_SCHEMA's, in the
# sources' order: `loss/<source>` (float64: its summed token losses / its loss tokens, over every rank) and
# `tokens/<source>` (int64: its loss tokens scored). "/" is in no other column's name.
SOURCE_LOSS_PREFIX, SOURCE_TOKENS_PREFIX = "loss/", "tokens/"


def source_loss_column(source: str) -> str:
    return f"{SOURCE_LOSS_PREFIX}{source}"


def source_tokens_column(source: str) -> str:
    return f"{SOURCE_TOKENS_PREFIX}{source}"


def eval_sources_of(columns) -> list[str]:
    """The sources eval.parquet's columns (or a row's keys) hold a loss for, in their order."""
    return [c[len(SOURCE_LOSS_PREFIX) :] for c in columns if c.startswith(SOURCE_LOSS_PREFIX)]


def eval_schema(sources=()) -> pa.Schema:
    """eval.parquet's schema: EVAL_SCHEMA, then each source's loss and tokens columns."""
    extra = [
        f
        for name in sources
        for f in ((source_loss_column(name), pa.float64()), (source_tokens_column(name), pa.int64()))
    ]
    return pa.schema([*EVAL_SCHEMA, *(pa.field(n, t) for n, t in extra)])


class EvalTable(MetricsTable):
    """eval.parquet: one row per validation pass (rank 0), rewritten after each pass, before any checkpoint of
    the same step: a checkpoint at step n implies the passes through step n are on disk, and a resume keeps
    exactly those (no duplicate rows). `sources`: the per-source columns (none for a single source)."""

    SCHEMA = EVAL_SCHEMA

    def __init__(self, path: Path, rows: list[dict] | None = None, sources=()):
        super().__init__(path, rows)
        self.schema = eval_schema(sources)

    @classmethod
    def resume(cls, path: Path, upto_step: int, sources=()) -> EvalTable:
        """The passes after steps already taken (<= upto_step) from an earlier, interrupted run."""
        table = read_metrics_table(path) if upto_step >= 0 else None
        rows = [] if table is None else [r for r in table.to_pylist() if r[STEP] <= upto_step]
        return cls(path, rows, sources)


def read_eval(run: str | os.PathLike) -> pd.DataFrame | None:
    """eval.parquet as a frame (None: the run has no validation passes)."""
    path = Path(run) / EVAL
    if not path.is_file():
        return None
    table = read_parquet(path, None, "train")
    check_columns(path, table.column_names, [f.name for f in EVAL_SCHEMA], "validation table", "train")
    return table.to_pandas()

"""Heartbeats (one small JSON per rank, rewritten atomically every step) and the metrics table.

The watcher (outside the training processes) reads heartbeats to tell
progress from a hang; the report reads metrics.parquet. Both follow the
contracts in docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path, write_bytes_atomic

METRICS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("epoch", pa.int32()),
        ("loss", pa.float64()),
        ("tokens", pa.int64()),
        ("loss_tokens", pa.int64()),
        ("step_time_s", pa.float64()),
        ("data_wait_s", pa.float64()),
        ("lr", pa.float64()),
        ("time", pa.float64()),
    ]
)


PHASES = ("init", "train", "checkpoint", "export", "done")


class Heartbeat:
    """`heartbeat/rank-<r>.json`: the rank's latest step and phase, rewritten atomically every step.

    Phase changes are also appended to `rank-<r>.events.jsonl` (a few lines per
    checkpoint, not per step) so triage can place checkpoints in time after the run.
    """

    def __init__(self, out: Path, rank: int, local_rank: int = 0, gpu: int | None = None):
        self.path = out / "heartbeat" / f"rank-{rank}.json"
        self.events = out / "heartbeat" / f"rank-{rank}.events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.base = {"rank": rank, "local_rank": local_rank, "gpu": gpu, "host": socket.gethostname(),
                     "pid": os.getpid()}
        self.phase = None
        self.plan: dict = {}

    def set_plan(self, total_steps: int, epoch_ends: list[int]) -> None:
        """This rank's planned schedule: total steps and the global step that ends each epoch."""
        self.plan = {"total_steps": total_steps, "epoch_ends": epoch_ends}

    def beat(self, step: int, epoch: int, phase: str, **extra) -> None:
        assert phase in PHASES, phase
        record = dict(self.base, step=step, epoch=epoch, phase=phase, time=time.time(), **self.plan, **extra)
        write_bytes_atomic(self.path, (json.dumps(record) + "\n").encode())
        if phase != self.phase:
            self.phase = phase
            event = {"time": record["time"], "rank": self.base["rank"], "step": step, "epoch": epoch, "phase": phase}
            with open(self.events, "a") as f:
                f.write(json.dumps(event) + "\n")


class MetricsTable:
    """Rows per (step, rank), held by rank 0 and rewritten atomically (so a kill keeps all flushed rows)."""

    def __init__(self, path: Path, rows: list[dict] | None = None):
        self.path = path
        self.rows: list[dict] = rows or []

    @classmethod
    def resume(cls, path: Path, upto_step: int) -> MetricsTable:
        """Rows of steps already taken (<= upto_step) from an earlier, interrupted run."""
        if not path.exists() or upto_step < 0:
            return cls(path)
        rows = [r for r in pq.read_table(path).to_pylist() if r["step"] <= upto_step]
        return cls(path, rows)

    def add(self, rows: list[dict]) -> None:
        self.rows.extend(rows)

    def flush(self) -> None:
        table = pa.Table.from_pylist(self.rows, schema=METRICS_SCHEMA)
        with atomic_path(self.path) as tmp:
            pq.write_table(table, tmp)

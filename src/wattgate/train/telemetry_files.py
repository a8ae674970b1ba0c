"""Heartbeats (one small JSON per rank, rewritten atomically every step) and the metrics table.

The watcher (outside the training processes) reads heartbeats to tell
progress from a hang; the report reads metrics.parquet. Both follow the
contracts in ARCHITECTURE.md.
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


class Heartbeat:
    def __init__(self, out: Path, rank: int):
        self.path = out / "heartbeat" / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.base = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}

    def beat(self, step: int, epoch: int, phase: str, **extra) -> None:
        record = dict(self.base, step=step, epoch=epoch, phase=phase, time=time.time(), **extra)
        write_bytes_atomic(self.path, (json.dumps(record) + "\n").encode())


class MetricsTable:
    """Rows per (step, rank), held by rank 0 and rewritten atomically (so a kill keeps all flushed rows)."""

    def __init__(self, path: Path, rows: list[dict] | None = None):
        self.path = path
        self.rows: list[dict] = rows or []

    @classmethod
    def resume(cls, path: Path, upto_step: int) -> "MetricsTable":
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

"""The throughput ledger (results/throughput.jsonl): what a record may hold, and its reader and writer.

A line is a `wattgate.records.ledger.LedgerLine`: the gate forecasts from these numbers, so a value no run can
have is an input error naming the line and the field (every field is checked on read).

train appends one record per finished run (run_record, append_ledger); the gate reads them all (read_ledger)
for the measured throughput of the same model shape, world size, context degree and GPU model. The run's report
adds to its record how much of its time went to waiting for stragglers (record_wait: `wait_hours`,
`wait_share`, `wait_source`), which a later run's gate states.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wattgate.artifacts import write_bytes_atomic
from wattgate.errors import InputError
from wattgate.records.ledger import LEDGER_VERSION, LedgerLine, LedgerWhere

LEDGER_NAME = "throughput.jsonl"
WARMUP_STEPS = 5  # first steps of a run kept out of its measured rate (one-off costs)


def shape_key(shape: dict) -> str:
    """A short stable name for a model shape (the decoder's dimensions)."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def ledger_path(results: Path) -> Path:
    return Path(results) / LEDGER_NAME


def read_ledger(path: Path) -> list[LedgerLine]:
    """Every record of a throughput ledger (none if it does not exist); a damaged line is an input error."""
    if not path.exists():
        return []
    records = []
    for lineno, line in enumerate(_ledger_lines(path), 1):
        if not line.strip():
            continue
        where = LedgerWhere(f"{path}:{lineno}")
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise where.refused(str(exc)) from None
        records.append(LedgerLine.from_json(data, where))
    return records


def _check_is_file(path: Path) -> None:
    if not path.is_file():
        raise InputError(f"{path}: forecast.ledger is not a file (a folder?); point it at a throughput.jsonl file")


def _ledger_lines(path: Path) -> list[str]:
    _check_is_file(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the throughput ledger ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise InputError(
            f"{path}:{lineno}: the throughput ledger is not UTF-8 text (byte {exc.start}); fix or delete that line"
        ) from None


def append_ledger(path: Path, record: LedgerLine) -> None:
    """Add one record; the ledger is rewritten to a temp name and renamed, so a killed job leaves no half line."""
    if path.exists():
        _check_is_file(path)
    existing = path.read_bytes() if path.exists() else b""
    if existing and not existing.endswith(b"\n"):
        existing += b"\n"
    write_bytes_atomic(path, existing + (json.dumps(record.to_json(), sort_keys=True) + "\n").encode())


def record_wait(
    path: Path, run_name: str, wait_hours: float, source: str, steps: int | None = None
) -> LedgerLine | None:
    """Add to a run's ledger record what its ranks spent waiting for stragglers: `wait_hours` (GPU-hours, or
    rank-hours without GPU telemetry), their share of the run's world_size x job_s (null without a job time) and
    `source`. The record is the newest of that run name (with `steps`, the newest of that many steps first: a
    rerun under the same name keeps its own). The other lines are kept byte for byte. Returns the updated record,
    or None when the ledger holds no record of the run."""
    path = Path(path)
    records = read_ledger(path)  # every line checked, as the gate reads them
    mine = [i for i, r in enumerate(records) if r.run_name == run_name]
    if steps is not None and any(records[i].steps == steps for i in mine):
        mine = [i for i in mine if records[i].steps == steps]
    if not mine:
        return None
    at = max(mine, key=lambda i: (records[i].time or 0, i))
    old = records[at]
    rank_hours = (old.world_size or 0) * (old.job_s or 0.0) / 3600.0
    updated = old.replace(
        wait_hours=round(float(wait_hours), 6),
        wait_share=round(min(float(wait_hours) / rank_hours, 1.0), 6) if rank_hours > 0 else None,
        wait_source=source,
    ).to_json()
    says = f"run {run_name!r}: the waiting for stragglers cannot be recorded ({{}})"
    rec = LedgerLine.from_json(updated, LedgerWhere(str(path), says=says))  # checked as the gate reads it
    lines = [line for line in _ledger_lines(path) if line.strip()]  # the records, in order
    lines[at] = json.dumps(rec.to_json(), sort_keys=True)
    write_bytes_atomic(path, ("\n".join(lines) + "\n").encode())
    return rec


def warmup_steps(n: int) -> int:
    """Steps at the start of a run that carry one-off costs (allocator, thread pools, kernel selection)."""
    return min(WARMUP_STEPS, n // 4)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    """What a forecast matches a ledger record on (forecast/throughput.py): the model's shape (the decoder's
    dimensions), the GPU model, the world size (the launch's ranks), the context degree, the sequence length and
    micro-batch size; and the planner's attention weight, which the record's cost units were counted with."""

    shape: dict
    gpu_model: str
    world_size: int
    seq_len: int
    micro_batch_size: int
    attn_weight: float
    # parallel.context: a CP run's rate carries the key/value all-gathers and the masked attention kernel, so it
    # never stands for a C = 1 run's (nor the reverse)
    context: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredSteps:
    """A run's timed steps: each one's planned cost (in the planner's units), its seconds, and the tokens they
    trained."""

    costs: np.ndarray
    times: list[float]
    tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageWrites:
    """What a run wrote, for the ledger's storage rate: its checkpoints (how many, their seconds in all, the
    last one's bytes) and its export (seconds, bytes)."""

    checkpoints: int
    checkpoint_s: float
    checkpoint_bytes: int
    export_s: float
    export_bytes: int


def run_record(
    *,
    run_name: str,
    run: RunShape,
    steps: MeasuredSteps,
    writes: StorageWrites,
    startup_s: float,
    load_s: float,
    job_s: float,
) -> LedgerLine:
    """A finished run's throughput: what a forecast for the same shape, world size, context degree and GPU model
    reuses (`context` is written only when > 1: a C = 1 line is what it was before context parallelism).

    The rate is measured after the first warm-up steps; their time beyond that rate is warmup_s, a one-off
    term of every run (so a short first run does not make a long second one look slow)."""
    times = np.asarray(steps.times, float)
    costs = np.asarray(steps.costs, float)[: len(times)]
    w = warmup_steps(len(times))
    steady_s, steady_cost = float(times[w:].sum()), float(costs[w:].sum())
    rate = steady_cost / steady_s if steady_s > 0 else 0.0
    warmup_s = max(float(times[:w].sum()) - float(costs[:w].sum()) / rate, 0.0) if rate > 0 else 0.0
    written = writes.checkpoints * writes.checkpoint_bytes + writes.export_bytes
    io_s = writes.checkpoint_s + writes.export_s
    return LedgerLine(
        version=LEDGER_VERSION,
        time=round(time.time(), 3),
        run_name=run_name,
        shape=run.shape,
        shape_key=shape_key(run.shape),
        gpu_model=run.gpu_model.lower(),
        world_size=run.world_size,
        context=run.context if run.context > 1 else None,
        seq_len=run.seq_len,
        micro_batch_size=run.micro_batch_size,
        attn_weight=run.attn_weight,
        steps=len(times),
        cost_per_s=rate,
        tokens_per_s=steps.tokens / float(times.sum()) if times.sum() > 0 else 0.0,
        step_s=round(float(times.sum()), 6),
        warmup_s=round(warmup_s, 3),
        startup_s=round(startup_s, 3),
        load_s=round(load_s, 3),
        checkpoints=writes.checkpoints,
        checkpoint_s=round(writes.checkpoint_s, 3),
        export_s=round(writes.export_s, 3),
        storage_gbps=written / io_s / 1e9 if io_s > 0 and written > 0 else None,
        job_s=round(job_s, 3),
    )

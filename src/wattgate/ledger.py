"""The throughput ledger (results/throughput.jsonl): what a record may hold, and its reader and writer.

The gate forecasts from these numbers, so a value no run can have is an input error naming the field, never
a crash or a forecast that "fits" a budget because a term is negative. Fields are optional (a hand-written
line may hold only `cost_per_s`), but any field present must be of its type and within its range.

train appends one record per finished run (run_record, append_ledger); the gate reads them all (read_ledger)
for the measured throughput of the same model shape, world size and GPU model. The run's report adds to its
record how much of its time went to waiting for stragglers (record_wait: `wait_hours`, `wait_share`,
`wait_source`), which a later run's gate states.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np

from wattgate.artifacts import write_bytes_atomic
from wattgate.errors import InputError

LEDGER_NAME = "throughput.jsonl"
LEDGER_VERSION = 1
WARMUP_STEPS = 5  # first steps of a run kept out of its measured rate (one-off costs)

MAX_SECONDS = 1e8  # ~3 years: longer than any job; a duration beyond it is a broken line, not a measurement
MAX_RATE = 1e15  # cost units (token-equivalents) or tokens per second per rank: far above any accelerator
MAX_GBPS = 1e5
MAX_COUNT = 1 << 40
FUTURE_SLACK_S = 86400.0  # clocks of the hosts that wrote the ledger may disagree by a little


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _in(lo: float, hi: float, *, low_open: bool = False, what: str = ""):
    def check(v) -> str | None:
        if not _number(v) or v > hi or (v <= lo if low_open else v < lo):
            return what or f"a finite number {'>' if low_open else '>='} {lo:g} and <= {hi:g}"
        return None

    return check


def _count(lo: int):
    def check(v) -> str | None:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= MAX_COUNT:
            return f"a whole number >= {lo}"
        return None

    return check


def _text(v) -> str | None:
    return None if isinstance(v, str) and v.strip() else "a non-empty string"


def _shape(v) -> str | None:
    return None if isinstance(v, dict) else "an object (the model's dimensions)"


def _optional(check):
    return lambda v: None if v is None else check(v)


def _time(v) -> str | None:
    if not _number(v) or v <= 0 or v > time.time() + FUTURE_SLACK_S:
        return "unix seconds, not in the future"
    return None


DURATION = _in(0.0, MAX_SECONDS)
FIELDS = {
    "version": _count(1),
    "time": _time,
    "run_name": _text,
    "shape": _shape,
    "shape_key": _text,
    "gpu_model": _text,
    "world_size": _count(1),
    "seq_len": _count(1),
    "micro_batch_size": _count(1),
    "attn_weight": _in(0.0, MAX_RATE),
    "steps": _count(0),
    "cost_per_s": _in(0.0, MAX_RATE, low_open=True),
    "tokens_per_s": _in(0.0, MAX_RATE),
    "step_s": DURATION,
    "warmup_s": DURATION,
    "startup_s": DURATION,
    "load_s": DURATION,
    "checkpoints": _count(0),
    "checkpoint_s": DURATION,
    "export_s": DURATION,
    "storage_gbps": _optional(_in(0.0, MAX_GBPS, low_open=True)),
    "job_s": DURATION,
    # added by the run's report (record_wait): GPU-hours (rank-hours without GPU telemetry) the ranks spent waiting
    # for stragglers, their share of the run's world_size x job_s, and what measured them
    "wait_hours": _optional(_in(0.0, MAX_SECONDS)),
    "wait_share": _optional(_in(0.0, 1.0)),
    "wait_source": _optional(_text),
}
REQUIRED = ("cost_per_s",)


def record_problem(rec) -> str | None:
    """Why `rec` (one parsed ledger line) is not a usable record, or None when it is."""
    if not isinstance(rec, dict):
        return f"a JSON object expected, got {type(rec).__name__}"
    for name in REQUIRED:
        if name not in rec:
            return f"no {name!r}"
    for name, check in FIELDS.items():
        if name in rec and (expected := check(rec[name])):
            return f"field {name!r} is {rec[name]!r}: expected {expected}"
    return None


def shape_key(shape: dict) -> str:
    """A short stable name for a model shape (the decoder's dimensions)."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def ledger_path(results: Path) -> Path:
    return Path(results) / LEDGER_NAME


def read_ledger(path: Path) -> list[dict]:
    """Every record of a throughput ledger (none if it does not exist); a damaged line is an input error."""
    if not path.exists():
        return []
    records = []
    for lineno, line in enumerate(_ledger_lines(path), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            problem = record_problem(rec)
            if problem:
                raise ValueError(problem)
        except ValueError as exc:
            raise InputError(
                f"{path}:{lineno}: not a throughput record ({exc}); fix or delete that line "
                "(train appends one per finished run)"
            ) from None
        records.append(rec)
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


def append_ledger(path: Path, record: dict) -> None:
    """Add one record; the ledger is rewritten to a temp name and renamed, so a killed job leaves no half line."""
    if path.exists():
        _check_is_file(path)
    existing = path.read_bytes() if path.exists() else b""
    if existing and not existing.endswith(b"\n"):
        existing += b"\n"
    write_bytes_atomic(path, existing + (json.dumps(record, sort_keys=True) + "\n").encode())


def record_wait(path: Path, run_name: str, wait_hours: float, source: str, steps: int | None = None) -> dict | None:
    """Add to a run's ledger record what its ranks spent waiting for stragglers: `wait_hours` (GPU-hours, or
    rank-hours without GPU telemetry), their share of the run's world_size x job_s (null without a job time) and
    `source`. The record is the newest of that run name (with `steps`, the newest of that many steps first: a
    rerun under the same name keeps its own). The other lines are kept byte for byte. Returns the updated record,
    or None when the ledger holds no record of the run."""
    path = Path(path)
    records = read_ledger(path)  # every line checked, as the gate reads them
    mine = [i for i, r in enumerate(records) if r.get("run_name") == run_name]
    if steps is not None and any(records[i].get("steps") == steps for i in mine):
        mine = [i for i in mine if records[i].get("steps") == steps]
    if not mine:
        return None
    at = max(mine, key=lambda i: (records[i].get("time", 0), i))
    rec = dict(records[at])
    rank_hours = rec.get("world_size", 0) * rec.get("job_s", 0.0) / 3600.0
    rec["wait_hours"] = round(float(wait_hours), 6)
    rec["wait_share"] = round(min(float(wait_hours) / rank_hours, 1.0), 6) if rank_hours > 0 else None
    rec["wait_source"] = source
    problem = record_problem(rec)
    if problem:
        raise InputError(f"{path}: run {run_name!r}: the waiting for stragglers cannot be recorded ({problem})")
    lines = [line for line in _ledger_lines(path) if line.strip()]  # the records, in order
    lines[at] = json.dumps(rec, sort_keys=True)
    write_bytes_atomic(path, ("\n".join(lines) + "\n").encode())
    return rec


def warmup_steps(n: int) -> int:
    """Steps at the start of a run that carry one-off costs (allocator, thread pools, kernel selection)."""
    return min(WARMUP_STEPS, n // 4)


def run_record(
    *,
    run_name: str,
    shape: dict,
    gpu_model: str,
    world_size: int,
    seq_len: int,
    micro_batch_size: int,
    attn_weight: float,
    step_costs: np.ndarray,
    step_times: list[float],
    tokens: int,
    startup_s: float,
    load_s: float,
    checkpoints: int,
    checkpoint_s: float,
    checkpoint_bytes: int,
    export_s: float,
    export_bytes: int,
    job_s: float,
) -> dict:
    """A finished run's throughput: what a forecast for the same shape, world size and GPU model reuses.

    The rate is measured after the first warm-up steps; their time beyond that rate is warmup_s, a one-off
    term of every run (so a short first run does not make a long second one look slow)."""
    times = np.asarray(step_times, float)
    costs = np.asarray(step_costs, float)[: len(times)]
    w = warmup_steps(len(times))
    steady_s, steady_cost = float(times[w:].sum()), float(costs[w:].sum())
    rate = steady_cost / steady_s if steady_s > 0 else 0.0
    warmup_s = max(float(times[:w].sum()) - float(costs[:w].sum()) / rate, 0.0) if rate > 0 else 0.0
    written = checkpoints * checkpoint_bytes + export_bytes
    io_s = checkpoint_s + export_s
    return {
        "version": LEDGER_VERSION,
        "time": round(time.time(), 3),
        "run_name": run_name,
        "shape": shape,
        "shape_key": shape_key(shape),
        "gpu_model": gpu_model.lower(),
        "world_size": world_size,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "attn_weight": attn_weight,
        "steps": int(len(times)),
        "cost_per_s": rate,
        "tokens_per_s": tokens / float(times.sum()) if times.sum() > 0 else 0.0,
        "step_s": round(float(times.sum()), 6),
        "warmup_s": round(warmup_s, 3),
        "startup_s": round(startup_s, 3),
        "load_s": round(load_s, 3),
        "checkpoints": checkpoints,
        "checkpoint_s": round(checkpoint_s, 3),
        "export_s": round(export_s, 3),
        "storage_gbps": written / io_s / 1e9 if io_s > 0 and written > 0 else None,
        "job_s": round(job_s, 3),
    }

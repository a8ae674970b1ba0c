"""What a throughput-ledger record may hold (forecast.read_ledger checks every line with it).

The gate forecasts from these numbers, so a value no run can have is an input error naming the field, never
a crash or a forecast that "fits" a budget because a term is negative. Fields are optional (a hand-written
line may hold only `cost_per_s`), but any field present must be of its type and within its range.
"""

from __future__ import annotations

import math
import time

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

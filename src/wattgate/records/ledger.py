"""One line of the throughput ledger (results/throughput.jsonl): a finished train run's measured rate, start-up,
load and storage times, for the gate's forecast of the next run of the same shape. Format: docs/architecture.md,
"results/throughput.jsonl".

The gate forecasts from these numbers, so a value no run can have is an input error naming the line and the
field, never a crash or a forecast that "fits" a budget because a term is negative. Every field but `cost_per_s`
is optional (a hand-written line may hold only that), but one that is there must be of its type and in range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from time import time as now
from typing import Any

from wattgate.errors import InputError
from wattgate.records.base import Record, Where, spec

LEDGER_VERSION = 1
MAX_SECONDS = 1e8  # ~3 years: longer than any job; a duration beyond it is a broken line, not a measurement
MAX_RATE = 1e15  # cost units (token-equivalents) or tokens per second per rank: far above any accelerator
MAX_GBPS = 1e5
MAX_COUNT = 1 << 40
FUTURE_SLACK_S = 86400.0  # clocks of the hosts that wrote the ledger may disagree by a little


@dataclass(frozen=True)
class LedgerWhere(Where):
    """A ledger line's place (`<file>:<line>`): its errors name the field and what is wrong, in `says` (by default:
    fix or delete that line)."""

    says: str = "not a throughput record ({}); fix or delete that line (train appends one per finished run)"

    def bad(self, key: str, what: str, value: Any = dataclasses.MISSING) -> InputError:
        if key == "<top level>":
            return self.refused(f"a JSON object expected, got {type(value).__name__}")
        return self.refused(f"field {key!r} is {value!r}: expected {what}")

    def missing(self, key: str) -> InputError:
        return self.refused(f"no {key!r}")

    def refused(self, problem: str) -> InputError:
        return InputError(f"{self.path}: {self.says.format(problem)}")


def _seconds(**kw):
    return spec(minimum=0, maximum=MAX_SECONDS, omit_none=True, default=None, **kw)


def _count(lo: int):
    return spec(minimum=lo, maximum=MAX_COUNT, omit_none=True, default=None)


def _text():
    return spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerLine(Record):
    """One run's record in the throughput ledger (ledger.run_record writes it; ledger.record_wait adds `wait_*`)."""

    version: int | None = _count(1)
    time: float | None = spec(omit_none=True, default=None)  # unix s, not in the future
    run_name: str | None = _text()
    shape: dict[str, Any] | None = spec(omit_none=True, default=None)  # the decoder's dimensions
    shape_key: str | None = _text()  # 16 hex of the shape's sha256
    gpu_model: str | None = _text()  # lower case
    world_size: int | None = _count(1)  # the launch's ranks (plan.json world_size x context)
    # parallel.context: ranks sharing each packed row; written only when > 1, so a line without it (every line
    # before context parallelism, and every C = 1 run's) reads as 1
    context: int | None = _count(1)
    seq_len: int | None = _count(1)
    micro_batch_size: int | None = _count(1)
    attn_weight: float | None = spec(minimum=0, maximum=MAX_RATE, omit_none=True, default=None)
    steps: int | None = _count(0)
    cost_per_s: float = spec(minimum=0, maximum=MAX_RATE)  # planner cost units per second per rank, > 0
    tokens_per_s: float | None = spec(minimum=0, maximum=MAX_RATE, omit_none=True, default=None)
    step_s: float | None = _seconds()
    warmup_s: float | None = _seconds()  # the warm-up steps' time beyond the measured rate
    startup_s: float | None = _seconds()
    load_s: float | None = _seconds()
    checkpoints: int | None = _count(0)
    checkpoint_s: float | None = _seconds()
    export_s: float | None = _seconds()
    # bytes written by checkpoints and export over their time, > 0; null (written by train) when none
    storage_gbps: float | None = spec(minimum=0, maximum=MAX_GBPS, omit_none=True, default=None)
    job_s: float | None = _seconds()
    # added by the run's report (ledger.record_wait): GPU-hours (rank-hours without GPU telemetry) the ranks spent
    # waiting for stragglers, their share of world_size x job_s (null without a job time), and what measured them
    wait_hours: float | None = _seconds()
    wait_share: float | None = spec(minimum=0, maximum=1, omit_none=True, default=None)
    wait_source: str | None = _text()

    @classmethod
    def from_json(cls, data: Any, where: Where | str = "record", prefix: str = "") -> LedgerLine:
        where = where if isinstance(where, Where) else LedgerWhere(where)
        line = super(LedgerLine, cls).from_json(data, where, prefix)
        if not line.cost_per_s > 0:
            raise where.bad("cost_per_s", f"a finite number > 0 and <= {MAX_RATE:g}", line.cost_per_s)
        if line.storage_gbps is not None and not line.storage_gbps > 0:
            raise where.bad("storage_gbps", f"null or a finite number > 0 and <= {MAX_GBPS:g}", line.storage_gbps)
        if line.time is not None and not 0 < line.time <= now() + FUTURE_SLACK_S:
            raise where.bad("time", "unix seconds, not in the future", line.time)
        texts = {
            "run_name": line.run_name,
            "shape_key": line.shape_key,
            "gpu_model": line.gpu_model,
            "wait_source": line.wait_source,
        }
        for key, text in texts.items():
            if text is not None and not text.strip():
                raise where.bad(key, "a non-empty string", text)
        return line

    def to_json(self) -> dict:
        out = Record.to_json(self)
        if self.version is not None:  # train's line: storage_gbps null when nothing was written
            out.setdefault("storage_gbps", None)
        if self.wait_source is not None:  # the report's addition: wait_share null without a job time
            out.setdefault("wait_share", None)
        return out

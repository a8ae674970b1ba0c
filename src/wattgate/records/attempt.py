"""The train job's attempt records in the run folder: who holds a run lock (`launch.lock`, `train.lock`), how an
attempt ended (`attempt-outcome.json`) and a graceful stop (`STOPPED`). Format: docs/architecture.md,
"results/train/<run_name>/".
"""

from __future__ import annotations

from dataclasses import dataclass

from wattgate.records.base import Record, spec


@dataclass(frozen=True, kw_only=True, slots=True)
class LockHolder(Record):
    """A run lock file's holder (train/run_lock.py), in the order it is written. Every key is optional on read: a
    lock file that holds no record names no holder."""

    role: str | None = None
    host: str | None = None
    pid: int | None = None
    started: float | None = None  # unix s
    slurm_job: str | None = None
    attempt: int | None = spec(minimum=0, default=None)  # the previous holder's plus one: launch's attempt number
    locked: bool | None = None  # false where the filesystem has no locks


@dataclass(frozen=True, kw_only=True, slots=True)
class AttemptOutcome(Record):
    """attempt-outcome.json (launch, at the end of each attempt): its exit status and one line, and whether a retry
    may succeed."""

    attempt: int | None = None  # launch's attempt in this run folder as it printed it (null: refused before that)
    snakemake_try: int | None = None  # Snakemake's try of the train job (--attempt)
    time: float | None = None
    exit_status: int | None = None
    line: str | None = None  # null on success
    retry: bool | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StopRequestRecord(Record):
    """STOP_REQUESTED (launch, on a signal or the Slurm time limit; or a person, with any content): a request
    to stop at the next agreed point."""

    signal: str | None = None  # the signal launch got (null: none, e.g. the time limit)
    reason: str | None = None
    time: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Stopped(Record):
    """STOPPED (rank 0, after a graceful stop published its checkpoint). step and checkpoint are null in the record
    launch makes of one it cannot read."""

    step: int | None = None
    checkpoint: str | None = None
    reason: str | None = None  # SIGTERM, SIGUSR1, STOP_REQUESTED or "a stop requested on rank <r>"
    time: float | None = spec(omit_none=True, default=None)

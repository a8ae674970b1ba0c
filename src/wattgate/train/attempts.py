"""How each attempt of the train job ended, kept in the run folder (`attempt-outcome.json`), so that Snakemake's
retry of the job (`wattgate launch --attempt N`, N > 1) can tell a failure a retry may cure (a stop at a time
limit, a rank killed with its node, a lost peer, a hang) from one it would repeat (a rank's own error: a
non-finite loss, an input error, a full disk), and end the latter at once instead of training again to the same
failure on a fresh allocation. A person's rerun (`--attempt` 1, the default) always runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from wattgate.artifacts import SPARE_BYTES, canonical_json, write_bytes_or_spare
from wattgate.errors import InputError, StageFailed
from wattgate.records.attempt import AttemptOutcome
from wattgate.records.base import Where
from wattgate.run_files import ATTEMPT_OUTCOME, read_json_object


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: launch's exit status, its one line (None on success), and whether a retry may
    succeed."""

    exit_status: int
    line: str | None
    retry: bool
    attempt: int | None = None  # launch's attempt number in the run folder (None: refused before it held the folder)


def record_outcome(run: Path, snakemake_try: int, outcome: Outcome) -> None:
    """attempt-outcome.json, only into a run folder train has claimed (never a foreign --out, nor one a launch was
    refused before it claimed it: that refusal needs no record to be repeated). On a full disk it goes into the room
    launch set aside at its start (`artifacts.reserve_spare`), its line cut to fit: a retry must still tell a
    repeatable failure. An OSError when even that fails (the caller says so before the attempt's own line)."""
    from wattgate.artifacts import marker_stage

    if Path(run).is_dir() and marker_stage(run) == "train":
        line = (
            outcome.line
            if outcome.line is None or len(outcome.line) < SPARE_BYTES // 2
            else (outcome.line[: SPARE_BYTES // 2] + " [...]")
        )
        record = AttemptOutcome(
            attempt=outcome.attempt,
            snakemake_try=snakemake_try,
            time=time.time(),
            exit_status=outcome.exit_status,
            line=line,
            retry=outcome.retry,
        )
        write_bytes_or_spare(Path(run) / ATTEMPT_OUTCOME, canonical_json(record.to_json()).encode())


def check_retry(run: Path, attempt: int) -> None:
    """Snakemake's retry `attempt` of the train job: end it (the previous attempt's exit status and line) when the
    previous attempt failed in a way a retry repeats. No record (a job Slurm killed at its limit) is a retry."""
    path = Path(run) / ATTEMPT_OUTCOME
    found = read_json_object(path, "the previous attempt's outcome", "train")
    if not found:
        return
    previous = AttemptOutcome.from_json(found, Where(str(path), "train"))
    if previous.retry is not False or previous.exit_status in (0, None):
        return
    # the attempt as launch printed it (train.attempts.log's header), else Snakemake's try (refused before that)
    which = previous.attempt if previous.attempt is not None else previous.snakemake_try
    line = (
        f"retry {attempt} not started: attempt {which} ended with {previous.line}, which a "
        "retry would repeat; fix it, then rerun"
    )
    raise (InputError if previous.exit_status == 2 else StageFailed)(line)

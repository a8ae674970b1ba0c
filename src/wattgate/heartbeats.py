"""Heartbeats: each training rank's latest step and phase (`heartbeat/rank-<r>.json`, rewritten atomically
every step) and its phase changes (`rank-<r>.events.jsonl`), with their readers beside the writer (the watcher,
triage and the report read them). Formats: docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from wattgate.artifacts import SPARE_BYTES, reserve_spare, write_bytes_atomic, write_bytes_or_spare
from wattgate.errors import InputError, first_line
from wattgate.records.base import Where
from wattgate.records.heartbeat import Beat, PhaseEvent, RankError, RankExit

if TYPE_CHECKING:
    import pandas as pd

HEARTBEAT_DIR = "heartbeat"  # train: rank-<r>.json (state), rank-<r>.events.jsonl (phase changes)
# the heartbeat events table's columns (read_heartbeat_events; a line is records/heartbeat.py PhaseEvent)
EVENT_TIME, EVENT_RANK, EVENT_STEP, EVENT_EPOCH, EVENT_PHASE = "time", "rank", "step", "epoch", "phase"
HEARTBEAT_EVENT_COLUMNS = [EVENT_TIME, EVENT_RANK, EVENT_STEP, EVENT_EPOCH, EVENT_PHASE]


def heartbeat_path(run: str | os.PathLike, rank: int) -> Path:
    return Path(run) / HEARTBEAT_DIR / f"rank-{rank}.json"


def heartbeat_events_path(run: str | os.PathLike, rank: int) -> Path:
    return Path(run) / HEARTBEAT_DIR / f"rank-{rank}.events.jsonl"


def read_heartbeats(
    run: str | os.PathLike, since: float = 0.0, on_bad: Callable[[str], object] | None = None
) -> dict[int, Beat]:
    """rank -> its latest heartbeat written at or after `since` (older ones belong to an earlier attempt).

    A rank without a file (not started, or its file cleared by a relaunch while listing) is absent. A file that
    is not a heartbeat is an InputError, or with `on_bad` (readers that show what they can: triage, report) a
    one-line note passed to it, and that rank is absent.
    """
    beats = {}
    for path in sorted((Path(run) / HEARTBEAT_DIR).glob("rank-*.json")):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError) as exc:
            _bad(on_bad, f"{path}: cannot read heartbeat ({first_line(exc)})", "that rank's placement is not shown")
            continue
        try:
            beat = Beat.from_json(json.loads(text), "the heartbeat")
        except (ValueError, RecursionError, InputError) as exc:
            _bad(on_bad, f"{path}: not a heartbeat ({first_line(exc)})", "that rank's placement is not shown")
            continue
        if beat.time >= since:
            beats[beat.rank] = beat
    return beats


def _bad(on_bad: Callable[[str], object] | None, problem: str, consequence: str) -> None:
    """A damaged heartbeat record: an InputError without `on_bad`, else `on_bad(note)` and the reader goes on."""
    if on_bad is None:
        raise InputError(f"{problem}; rerun train")
    on_bad(f"{problem}: {consequence}")


def _heartbeat_event(line: str) -> tuple:
    e = PhaseEvent.from_json(json.loads(line), "the event")
    return e.time, e.rank, e.step, e.epoch, e.phase


def read_heartbeat_events(run: str | os.PathLike, on_bad: Callable[[str], object] | None = None) -> pd.DataFrame:
    """Every rank's phase changes (HEARTBEAT_EVENT_COLUMNS), sorted by rank and time; empty without any.

    A bad line is an InputError naming file:line; with `on_bad`, a file's bad lines among good ones are skipped
    and counted in one note passed to it (a file with no readable line is still an error: another file).
    """
    events = []
    for path in sorted((Path(run) / HEARTBEAT_DIR).glob("rank-*.events.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError) as exc:
            problem = f"{path}: cannot read heartbeat events ({first_line(exc)})"
            _bad(on_bad, problem, "that rank's phases are not shown")
            continue
        bad, good = [], []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                good.append(_heartbeat_event(line))
            except (ValueError, InputError, RecursionError) as exc:
                bad.append((lineno, first_line(exc)))
        if bad and (on_bad is None or not good):  # nothing in it is a heartbeat event: not damage but another file
            raise InputError(f"{path}:{bad[0][0]}: not a heartbeat event ({bad[0][1]}); rerun train")
        events += good
        if bad:
            assert on_bad is not None  # bad lines without on_bad raised above
            more = f" and {len(bad) - 1} more line(s)" if len(bad) > 1 else ""
            on_bad(
                f"{path}:{bad[0][0]}: not a heartbeat event ({bad[0][1]}){more}: skipped, the phases there come "
                "from power and metrics alone"
            )
    import pandas as pd  # not at import: the training ranks write heartbeats and never read them

    frame = pd.DataFrame(events, columns=HEARTBEAT_EVENT_COLUMNS)
    return frame.sort_values([EVENT_RANK, EVENT_TIME], kind="stable", ignore_index=True)


# what a rank is doing, in order (heartbeats; not the power phases of triage_tables.py)
HEARTBEAT_PHASES = ("init", "train", "eval", "checkpoint", "export", "done")


class Heartbeat:
    """`heartbeat/rank-<r>.json`: the rank's latest step and phase, rewritten atomically every step.

    Phase changes are also appended to `rank-<r>.events.jsonl` (a few lines per
    checkpoint, not per step) so triage can place checkpoints in time after the run.
    """

    def __init__(self, out: Path, rank: int, local_rank: int = 0, gpu: str | None = None):
        self.path = heartbeat_path(out, rank)
        self.events = heartbeat_events_path(out, rank)
        self.rank = rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.base = {
            "rank": rank,
            "local_rank": local_rank,
            "gpu": gpu,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.phase = None
        self.plan: dict = {}

    def set_plan(self, total_steps: int, epoch_ends: list[int]) -> None:
        """This rank's planned schedule: total steps and the global step that ends each epoch."""
        self.plan = {"total_steps": total_steps, "epoch_ends": epoch_ends}

    def beat(self, step: int, epoch: int, phase: str, **extra) -> None:
        assert phase in HEARTBEAT_PHASES, phase
        now = time.time()
        record = dict(self.base, step=step, epoch=epoch, phase=phase, time=now, **self.plan, **extra)
        write_bytes_atomic(self.path, (json.dumps(record) + "\n").encode())
        if phase != self.phase:
            self.phase = phase
            event = PhaseEvent(time=now, rank=self.rank, step=step, epoch=epoch, phase=phase)
            with open(self.events, "a") as f:
                f.write(json.dumps(event.to_json()) + "\n")


# ---------------------------------------------------------------- why a rank ended (docs/architecture.md)
# `error-rank-<r>.json`: written by the rank's own CLI when it exits with an error (its one line, its exit status, and
# the step and phase of its last heartbeat); `exit-rank-<r>.json`: written by its node's torchrun agent
# (train/torchrun.py) from the rank's wait status, the only record of a rank killed by a signal (SIGKILL from the OOM
# killer leaves the rank no chance to write). Both go beside the heartbeats, so every node writes its own ranks'
# records into the shared run folder and the watcher (first node only) and launch read them all. Not named
# `rank-*.json`: those are heartbeats.


def rank_error_path(run: str | os.PathLike, rank: int) -> Path:
    return Path(run) / HEARTBEAT_DIR / f"error-rank-{rank}.json"


def rank_exit_path(run: str | os.PathLike, rank: int) -> Path:
    return Path(run) / HEARTBEAT_DIR / f"exit-rank-{rank}.json"


def _last_beat(run: str | os.PathLike, rank: int) -> Beat | None:
    path = heartbeat_path(run, rank)
    try:
        return Beat.from_json(json.loads(path.read_text()), Where(str(path)))
    except (OSError, ValueError, InputError):
        return None


def _write_record(path: Path, record: dict) -> bool:
    """Best effort: a failure record must never replace the error it reports. On a full disk it goes into the room
    its rank set aside at start (`reserve_rank_error`), cut to fit."""
    data = (json.dumps(record) + "\n").encode()
    if len(data) > SPARE_BYTES:
        short = dict(record, error=str(record.get("error", ""))[: SPARE_BYTES // 2] + " [...]")
        data = (json.dumps(short) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_or_spare(path, data)
    except OSError:
        return False
    return True


def reserve_rank_error(run: str | os.PathLike, rank: int) -> bool:
    """Room for this rank's failure record, set aside while the disk has some (a checkpoint that fills the disk
    must still leave the line that names it)."""
    path = rank_error_path(run, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return reserve_spare(path)


def write_rank_error(run: str | os.PathLike, rank: int, error: str, exit_code: int) -> bool:
    """This rank's failure record (its CLI's one line and exit status, where its last heartbeat placed it)."""
    beat = _last_beat(run, rank)
    record = RankError(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        exit_code=exit_code,
        error=error,
        step=beat.step if beat else None,
        epoch=beat.epoch if beat else None,
        phase=beat.phase if beat else None,
        time=time.time(),
    )
    return _write_record(rank_error_path(run, rank), record.to_json())


def write_rank_exit(run: str | os.PathLike, rank: int, local_rank: int, pid: int, exitcode: int) -> bool:
    """A failed rank's wait status as its torchrun agent saw it: `exitcode` < 0 is the signal that killed it."""
    record = RankExit(
        rank=rank,
        local_rank=local_rank,
        host=socket.gethostname(),
        pid=pid,
        exitcode=exitcode,
        agent_pid=os.getpid(),
        time=time.time(),
    )
    return _write_record(rank_exit_path(run, rank), record.to_json())


@dataclass(frozen=True)
class RankRecords:
    """What a failed rank left: its own error, its agent's exit, its last heartbeat (each None when absent)."""

    error: RankError | None = None
    exit: RankExit | None = None
    beat: Beat | None = None


def read_rank_failures(run: str | os.PathLike, since: float = 0.0) -> dict[int, RankRecords]:
    """rank -> its own error record, its agent's exit record and its last heartbeat (each None when absent), for
    the ranks with a record written at or after `since` (older ones belong to an earlier attempt). A record
    that cannot be read is skipped: these explain a failure, they never cause one."""
    found: dict[int, RankRecords] = {}
    for kind, record_type in (("error", RankError), ("exit", RankExit)):
        for path in sorted((Path(run) / HEARTBEAT_DIR).glob(f"{kind}-rank-*.json")):
            try:
                record = record_type.from_json(json.loads(path.read_text()), Where(str(path)))
            except (OSError, ValueError, RecursionError, InputError):
                continue
            if record.time >= since:
                entry = found.get(record.rank, RankRecords())
                found[record.rank] = (
                    replace(entry, error=record) if isinstance(record, RankError) else replace(entry, exit=record)
                )
    return {rank: replace(entry, beat=_last_beat(run, rank)) for rank, entry in found.items()}


def clear_rank_failures(run: str | os.PathLike) -> None:
    """Remove an earlier attempt's failure records (launch, before it starts the job)."""
    for pattern in ("error-rank-*.json", "exit-rank-*.json"):
        for path in (Path(run) / HEARTBEAT_DIR).glob(pattern):
            path.unlink(missing_ok=True)

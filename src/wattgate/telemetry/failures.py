"""A job's end, named: which rank failed first and why, for watcher.json's final verdict and launch's one line.

The evidence is each failed rank's records beside its heartbeat (wattgate/heartbeats.py): its own CLI's line and
exit status (`error-rank-<r>.json`), and its torchrun agent's view of its wait status (`exit-rank-<r>.json`, the
only record of a rank killed by a signal). Every node writes its own ranks' records into the shared run folder, so
this works on any number of nodes from the first one. When one rank dies the others fail after it (a collective
with a dead peer: "Connection closed by peer"), so the root cause is chosen, not the first file found: a rank killed
by a signal before it said anything, then a rank's own error that is not the loss of a peer, then the rest; earliest
first within each.
"""

from __future__ import annotations

import signal
import time

from wattgate.heartbeats import RankRecords, read_rank_failures
from wattgate.records.attempt import Stopped
from wattgate.records.watcher import JobEnd, RankFailure, WatcherRecord

SIGNAL_HINTS = {
    "SIGKILL": "the OOM killer or a kill -9 (an OOM kill is in the kernel log: dmesg)",
    "SIGSEGV": "a crash in native code (segmentation fault)",
    "SIGBUS": "a bus error: a file truncated under a memory map, or /dev/shm full",
    "SIGABRT": "an abort in native code (a failed assertion, an uncaught C++ exception)",
    "SIGFPE": "an arithmetic fault in native code",
    "SIGILL": "an illegal instruction (a binary built for another CPU)",
    "SIGTERM": "a stop signal that was not waited for",
}
# A rank's error that says another rank went away: a consequence of the root cause, not the cause
PEER_LOSS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
    "ncclremoteerror",
    "socket timeout",
)


def position(step: int | None, phase: str | None) -> str:
    """' in step 13' / ' writing the checkpoint of step 30' from a heartbeat's (or an error record's) step and phase."""
    if not isinstance(step, int):
        return ""
    return {
        "train": f" in step {step + 1}",
        "eval": f" in the validation pass after step {step}",
        "checkpoint": f" writing the checkpoint of step {step}",
        "export": f" exporting after step {step}",
        "init": " while starting up",
        "done": f" after its last step ({step})",
    }.get(phase or "", f" at step {step}")


def signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _candidate(rank: int, entry: RankRecords) -> tuple[tuple, RankFailure]:
    error, exit_, beat = entry.error, entry.exit, entry.beat
    where = position(beat.step, beat.phase) if beat is not None else ""
    if exit_ is not None and exit_.exitcode is not None and exit_.exitcode < 0 and error is None:
        code = exit_.exitcode
        name = signal_name(code)
        cause = f"killed by {name} (signal {-code})"
        who = f"rank {rank} (pid {exit_.pid} on {exit_.host})"
        hint = SIGNAL_HINTS.get(name)
        line = f"{who} died: {cause}{where}" + (f": {hint}" if hint else "")
        return (0, exit_.time, rank), RankFailure(rank=rank, cause=cause, line=line, exit_status=1)
    if error is not None:
        code = error.exit_code or 1
        text = error.error or "an error"
        cause = f"{text} (exit {code})"
        line = f"rank {rank}{position(error.step, error.phase)}: {cause}"
        peer = any(p in text.lower() for p in PEER_LOSS)
        failure = RankFailure(rank=rank, cause=cause, line=line, exit_status=2 if code == 2 else 1, retriable=peer)
        return (2 if peer else 1, error.time, rank), failure
    assert exit_ is not None  # read_rank_failures lists a rank only with its error or its exit record
    code = exit_.exitcode if exit_.exitcode is not None else 1
    cause = f"exit status {code} with no error line (its traceback, if any, is in train.log)"
    line = f"rank {rank} (pid {exit_.pid} on {exit_.host}) failed: {cause}{where}"
    return (3, exit_.time, rank), RankFailure(rank=rank, cause=cause, line=line, exit_status=1)


def name_failure(run, since: float = 0.0) -> RankFailure | None:
    """The root cause among the failure records written at or after `since` (this attempt); None without any."""
    ranked = sorted(_candidate(rank, entry) for rank, entry in read_rank_failures(run, since).items())
    if not ranked:
        return None
    first = ranked[0][1]
    others = tuple(sorted(f.rank for _, f in ranked[1:]))
    if not others:
        return first
    after = f"; rank(s) {', '.join(map(str, others))} failed after it"
    return first.replace(line=first.line + after, others=others)


def status_text(returncode: int) -> str:
    """'status 1', 'status 137 (128 + 9: SIGKILL)', 'killed by SIGKILL (signal 9)' for a job's exit status."""
    if returncode < 0:
        return f"killed by {signal_name(returncode)} (signal {-returncode})"
    if returncode > 128 and 0 < returncode - 128 < signal.NSIG:
        return f"status {returncode} (128 + {returncode - 128}: {signal_name(128 - returncode)})"
    return f"status {returncode}"


def finish_record(
    record: WatcherRecord,
    returncode: int,
    failure: RankFailure | None,
    stopped: Stopped | None,
    now: float | None = None,
    hard_stop: str | None = None,
) -> WatcherRecord:
    """watcher.json once the job has ended. A verdict the watcher reached (a deadlock, a stall, missing ranks)
    stands; otherwise the verdict becomes `stopped` (a graceful stop: STOPPED was written), `failed` (naming the
    first failed rank and its cause, the job's exit status when no rank left a record, or a second signal that
    stopped it at once), or `healthy` only when the job exited 0. `job_end` records all of it either way."""
    end = JobEnd(
        returncode=returncode,
        time=now if now is not None else time.time(),
        failure=failure,
        stopped=stopped,
        hard_stop=hard_stop,
    )
    out = record.replace(job_end=end, ended=record.ended if record.ended is not None else end.time)
    if not record.quiet:
        return out
    if stopped is not None:
        return out.replace(verdict="stopped", reason=stopped_line(stopped))
    if hard_stop is not None:
        status = status_text(returncode)
        reason = f"stopped at once by a second {hard_stop} to wattgate launch (no stop checkpoint); job {status}"
        return out.replace(verdict="failed", reason=reason, failed_rank=None, cause=f"a second {hard_stop}")
    if failure is not None:
        return out.replace(verdict="failed", reason=failure.line, failed_rank=failure.rank, cause=failure.cause)
    if returncode != 0:
        reason = f"training exited with {status_text(returncode)} and no rank left a failure record"
        return out.replace(verdict="failed", reason=reason, failed_rank=None, cause=status_text(returncode))
    return out.replace(verdict="healthy")


def stopped_line(stopped: Stopped) -> str:
    """'stopped at step 30 (SIGTERM); checkpoint <path>; rerun to resume' from STOPPED."""
    return f"stopped at step {stopped.step} ({stopped.reason}); checkpoint {stopped.checkpoint}; rerun to resume"

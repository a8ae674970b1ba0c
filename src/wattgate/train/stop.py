"""Graceful stop: a request (SIGTERM, SIGUSR1, SIGINT, or a STOP_REQUESTED file in the run folder) that every rank
acts on at the same point.

A rank never stops on its own: it only notes the request. The loop exchanges every rank's note in the step's
figures gather (train/loop.py `Trainer.run_step`), and inside a long validation pass every
`EVAL_STOP_CHECK_MICROS` micro-batches (every rank has the same count there by construction), so all ranks see
the same answer at the same collective and take the stop path together: finish the step, publish a
checkpoint, write STOPPED, exit 0. A flag checked by one rank alone would leave its peers in a collective.

The file is how a request reaches ranks on other nodes when only the launcher got the signal (the launcher
writes it), and how a person asks for a stop without a signal: `touch <run>/STOP_REQUESTED`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from wattgate.artifacts import write_json_atomic
from wattgate.errors import InputError
from wattgate.run_files import ABORT_REQUEST, STOP_REQUEST, STOPPED
from wattgate.records.attempt import StopRequestRecord, Stopped
from wattgate.train.stop_signals import STOP_SIGNALS, insists

EVAL_STOP_CHECK_MICROS = 8  # validation micro-batches between stop checks: a collective each, every rank alike

_signalled: list[str] = []  # the signals this process received (a handler may only note, never act)
_first_at: list[float] = []  # when the first of them came (monotonic)
_grace_s: list[float] = [0.0]


def _note(signum, _frame) -> None:
    now = time.monotonic()
    if insists(signum, _first_at[0] if _first_at else None, now, _grace_s[0]):
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if not _first_at:
        _first_at.append(now)
    _signalled.append(signal.Signals(signum).name)


def install_stop_signals(grace_s: float) -> None:
    """SIGTERM, SIGUSR1 and SIGINT become stop requests for this rank (the train stage's entry point calls this;
    the collective proof, which runs in the gate's process, does not); the same signal again after `grace_s`
    (cluster.slurm.train.stop_margin_s) ends the rank at once. wattgate's torchrun (train/torchrun.py) starts its
    ranks with these signals blocked, so one sent while the rank was starting waits here instead of killing it."""
    _grace_s[0] = float(grace_s)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@dataclass
class StopRequest:
    """Whether this rank has been asked to stop: a signal it received, or the run folder's request file."""

    run_dir: Path

    def reason(self) -> str | None:
        if _signalled:
            return _signalled[0]
        path = self.run_dir / STOP_REQUEST
        if path.exists():
            return f"{STOP_REQUEST}: {file_reason(path)}" if file_reason(path) else STOP_REQUEST
        return None


def file_reason(path: Path) -> str | None:
    """The `reason` launch wrote into a request file (a signal it got, the Slurm time limit), if it is readable."""
    import json

    try:
        reason = StopRequestRecord.from_json(json.loads(path.read_text()), str(path)).reason
    except (OSError, ValueError, InputError):
        return None
    return reason or None


ABORT_POLL_S = 1.0  # one stat a second per rank: cheap, even on a shared filesystem's metadata server


@dataclass(frozen=True)
class AbortWatch:
    """The watch start_abort_watch started: the event that ends it and the thread that polls."""

    done: threading.Event
    thread: threading.Thread


def start_abort_watch(run_dir: Path, poll_s: float = ABORT_POLL_S) -> AbortWatch:
    """A daemon thread that ends this rank at once when ABORT_REQUESTED appears in the run folder (the watcher's
    kill of a hung job). It runs while the main thread is blocked in a collective (gloo and NCCL waits release
    the GIL), where no signal handler can; every rank on every node sees the file on the shared filesystem.
    End it with stop_abort_watch once the rank's collectives are over, so that no thread is left polling while the
    interpreter shuts down (a daemon thread woken then can abort the process)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if (run_dir / ABORT_REQUEST).exists():
                print(f"train: rank aborted: {run_dir / ABORT_REQUEST} (the watcher stopped a hung job)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: the process is hung in a collective

    thread = threading.Thread(target=watch, name="wattgate-abort-watch", daemon=True)
    thread.start()
    return AbortWatch(done, thread)


def stop_abort_watch(watch: AbortWatch) -> None:
    """End the watch started by start_abort_watch and wait for its thread (at most one poll)."""
    watch.done.set()
    watch.thread.join()


def write_stopped(run_dir: Path, step: int, checkpoint: Path, reason: str) -> None:
    """STOPPED (rank 0, once the stop checkpoint is published): what `wattgate launch` reads to exit
    EXIT_STOPPED ("stopped, resume me") instead of 0 or a failure."""
    record = Stopped(step=step, checkpoint=str(checkpoint), reason=reason, time=time.time())
    write_json_atomic(run_dir / STOPPED, record.to_json())

"""The launcher's side of a graceful stop: signals to `wattgate launch` and the Slurm time limit become a stop request.

The ranks stop on STOP_REQUESTED in the run folder (train/stop.py: every rank polls it at step boundaries, they
agree, checkpoint, rank 0 writes STOPPED and every rank exits 0). The launcher writes that file:
- on its first SIGTERM, SIGUSR1 or SIGINT (Ctrl-C). The job runs in sessions of its own, so a signal to the
  launcher reaches no rank by itself; the file reaches every node. The same signal again within the grace
  (`cluster.slurm.train.stop_margin_s`) is the same request: scancel, preemption and a time limit signal every
  process of the job, some twice. A SIGTERM or SIGINT after the grace stops the job at once: ABORT_REQUESTED (every
  rank's abort watch ends it, on every node) and SIGTERM to the job's process group. A file that cannot be
  written (a full disk) falls back to forwarding SIGTERM: torchrun's grace.
- ahead of the Slurm job's end (`cluster.slurm.train.stop_margin_s`), from the end time squeue reports, read again
  every few minutes (`scontrol update TimeLimit=` moves it). Not `sbatch --signal`: docs/slurm.md says why.

The job's processes start with SIGUSR1 ignored (an ignored disposition survives exec; the ranks install their own
handler): torchrun and the samplers have none, and a USR1 sent to the whole process tree would kill them by default
and their ranks with them.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from wattgate.artifacts import write_json_atomic
from wattgate.run_files import STOP_REQUEST
from wattgate.records.attempt import StopRequestRecord
from wattgate.records.run_config import RunConfig
from wattgate.train.stop_signals import insists

GRACEFUL = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
RECHECK_S = 300.0  # the timer reads the job's end time again this often (a changed time limit moves the stop)


def ignore_usr1() -> None:
    """Popen's preexec_fn for the job and the watcher: start with SIGUSR1 ignored (inherited across exec)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def write_stop_request(run: Path, signal_name: str | None, reason: str) -> None:
    write_json_atomic(
        run / STOP_REQUEST, StopRequestRecord(signal=signal_name, reason=reason, time=time.time()).to_json()
    )


class StopControl:
    """The launcher's signal handlers and Slurm timer. `forward(signum)` hard-stops the job (the caller's)."""

    def __init__(self, run: Path, forward, grace_s: float):
        self.run = run
        self.forward = forward
        self.grace_s = grace_s  # a repeated signal within this of the request is the same request
        self.requested: str | None = None  # why a stop was requested (first signal, or the timer)
        self.requested_at: float | None = None  # when (monotonic)
        self.hard_stop: str | None = None  # the signal that stopped the job at once
        self._told_again = False
        self._lock = threading.Lock()
        self.done = threading.Event()  # the job ended: the timer stops

    def install(self) -> None:
        for sig in GRACEFUL:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.request(name, f"{name} to wattgate launch")
            return
        if self.hard_stop is not None:
            return
        if not insists(signum, self.requested_at, time.monotonic(), self.grace_s):
            if not self._told_again:  # scancel and preemption signal every process, some of them more than once
                self._told_again = True
                print(
                    f"launch: {name} again: the stop already requested goes on (a SIGTERM or SIGINT more than "
                    f"{self.grace_s:.0f} s after the request, cluster.slurm.train.stop_margin_s, stops at once)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self.hard_stop = name
        print(f"launch: {name} again: stopping the job at once (no stop checkpoint)", file=sys.stderr, flush=True)
        self.forward(signum)

    def request(self, signal_name: str | None, reason: str) -> None:
        with self._lock:
            if self.requested is not None:
                return
            self.requested, self.requested_at = reason, time.monotonic()
        try:
            write_stop_request(self.run, signal_name, reason)
        except OSError as exc:
            print(
                f"launch: cannot write {self.run / STOP_REQUEST} ({exc.strerror}): {reason}: passing SIGTERM to the "
                "job instead (torchrun gives its ranks ~30 s)",
                file=sys.stderr,
                flush=True,
            )
            self.forward(signal.SIGTERM)
            return
        again = f" (a SIGTERM or Ctrl-C more than {self.grace_s:.0f} s from now stops at once)" if signal_name else ""
        print(
            f"launch: stop requested ({reason}): the ranks checkpoint at the next step boundary and exit{again}",
            file=sys.stderr,
            flush=True,
        )

    def start_slurm_timer(self, job_id: str, margin_s: float) -> threading.Thread:
        thread = threading.Thread(target=self._timer, args=(job_id, margin_s), name="slurm-stop-timer", daemon=True)
        thread.start()
        return thread

    def _timer(self, job_id: str, margin_s: float) -> None:
        first = True
        while not self.done.is_set() and self.requested is None:
            end, why = slurm_end_time(job_id)
            now = time.time()
            if end is None or end == math.inf:
                if first:
                    print(f"launch: no timed stop: {why}", file=sys.stderr, flush=True)
                if end == math.inf:
                    return
                first = False
                self.done.wait(RECHECK_S)
                continue
            if first and end - now < margin_s:  # a job that starts inside its margin would stop before its first step
                print(
                    f"launch: no timed stop: the job ends in {end - now:.0f} s, less than "
                    f"cluster.slurm.train.stop_margin_s ({margin_s:.0f} s); at the limit Slurm's SIGTERM leaves "
                    "only its KillWait",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if end - margin_s <= now:
                self.request(None, f"the Slurm job's time limit in {end - now:.0f} s (stop_margin_s {margin_s:.0f})")
                return
            if first:
                stop_at = _clock(end - margin_s)
                print(f"launch: Slurm job {job_id} ends at {_clock(end)}; a stop is requested at {stop_at}", flush=True)
            first = False
            self.done.wait(min(end - margin_s - now, RECHECK_S))


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def slurm_end_time(job_id: str, timeout_s: float = 30.0) -> tuple[float | None, str]:
    """(the job's end time as unix seconds, '') from `squeue -h -j JOB -o %e`, which prints local time
    (`2025-01-02T03:04:05`); (inf, why) for a job without a limit (N/A, Unknown, NONE); (None, why) when squeue
    cannot say (asked again later)."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"cannot run squeue ({exc}); a stop comes only from a signal"
    text = out.stdout.strip().splitlines()[0].strip() if out.stdout.strip() else ""
    if out.returncode != 0 or not text:
        return None, f"squeue -j {job_id} printed no end time ({out.stderr.strip() or 'rc ' + str(out.returncode)})"
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp(), ""
    except ValueError:
        return math.inf, f"the job has no time limit (squeue end time {text!r})"


def stop_margin_s(config: RunConfig) -> float:
    return float(config.cluster.slurm.train.stop_margin_s)

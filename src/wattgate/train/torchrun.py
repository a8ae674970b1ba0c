"""torchrun, recording why each rank failed and turning stop signals into the run's stop request:
`python -m wattgate.train.torchrun --run-dir DIR --stop-grace-s S <torchrun args>`.

`wattgate launch` starts every node's agent through this module instead of `python -m torch.distributed.run`. It is
torchrun itself (the same `main`, in the same process, so the ranks' parent is unchanged), with two additions. When
ranks fail, the agent knows each one's wait status, and torchrun only prints it
in a failure table. Here each failed rank's status goes to `heartbeat/exit-rank-<r>.json` in the run folder (the
exit code, or the signal that killed it: a SIGKILL from the OOM killer leaves the rank no chance to write anything),
on every node, for the watcher's verdict and launch's line, and the table becomes one line per rank. Parsing the
printed table instead would tie wattgate to its format and to one node's output.

Stop signals: torchrun's own handler takes its first SIGTERM or SIGINT as "end the job": it passes SIGTERM to its
ranks and kills them ~30 s later. A rank that got the same signal from Slurm a moment before (scancel, preemption
and a time limit signal every process of the job) took the second as "die now", so a broadcast stopped gracefully
1 time in 3. Here SIGTERM, SIGINT and SIGUSR1 are blocked before torchrun starts, so they are never delivered to
its handler: one thread waits for them (`sigwait`) and writes STOP_REQUESTED, which every rank on every node polls
at its step boundaries, like launch's own request. The same signal again after the grace
(cluster.slurm.train.stop_margin_s) is passed to torchrun's handler: the old hard stop. The ranks inherit the
blocked signals, so one sent while a rank starts waits until the rank's own handler is installed
(train/stop.py `install_stop_signals`).
"""

from __future__ import annotations

import _thread
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from wattgate.train.stop_signals import STOP_SIGNALS, insists

# wattgate's other modules are imported where they are used: main() blocks the stop signals before any of them


def signal_text(exitcode: int) -> str:
    """'killed by SIGKILL (signal 9)' for a negative wait status, else 'exit status N'."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-exitcode})"
    return f"exit status {exitcode}"


def record_failures(run: Path, failures: dict) -> list[str]:
    """Write each failed rank's record (torch's ProcessFailure by global rank); one line per rank to print."""
    from wattgate.heartbeats import write_rank_exit

    lines = []
    for rank, f in sorted(failures.items()):
        write_rank_exit(run, int(rank), int(f.local_rank), int(f.pid), int(f.exitcode))
        lines.append(
            f"torchrun: rank {rank} (local rank {f.local_rank}, pid {f.pid}) failed: {signal_text(f.exitcode)}"
        )
    return lines


class SignalRelay:
    """Stop signals to the agent become the run folder's stop request; after the grace, torchrun's own handler."""

    def __init__(self, run: Path, grace_s: float):
        self.run, self.grace_s = run, grace_s
        self.first_at: float | None = None

    def start(self) -> None:
        threading.Thread(target=self._wait, name="wattgate-signal-relay", daemon=True).start()

    def _wait(self) -> None:
        while True:
            self.on_signal(signal.sigwait(STOP_SIGNALS), time.monotonic())

    def on_signal(self, signum: int, now: float) -> None:
        name = signal.Signals(signum).name
        if insists(signum, self.first_at, now, self.grace_s):
            assert self.first_at is not None  # insists only after a first request
            print(
                f"torchrun: {name} again {now - self.first_at:.0f} s after the stop request: ending its ranks now",
                file=sys.stderr,
                flush=True,
            )
            # torchrun's handler: SIGTERM to its ranks, SIGKILL after its timeout
            _thread.interrupt_main(signal.Signals(signum))
            return
        if self.first_at is not None:
            return  # the same request again
        self.first_at = now
        self.request(name)

    def request(self, name: str) -> None:
        from wattgate.run_files import STOP_REQUEST
        from wattgate.train.launch_stop import write_stop_request

        if (self.run / STOP_REQUEST).exists():
            return  # launch (or a person) asked first: its reason stands
        try:
            write_stop_request(self.run, name, f"{name} to torchrun on {socket.gethostname()}")
        except OSError as exc:
            print(
                f"torchrun: {name}: cannot write {self.run / STOP_REQUEST} ({exc.strerror}): passing {name} to its "
                "ranks instead (they stop at the next step boundary, or are killed after torchrun's timeout)",
                file=sys.stderr,
                flush=True,
            )
            _thread.interrupt_main(signal.SIGTERM if name == "SIGUSR1" else getattr(signal, name))
            return
        print(
            f"torchrun: {name}: stop requested; the ranks checkpoint at the next step boundary",
            file=sys.stderr,
            flush=True,
        )


def hold_stop_signals() -> None:
    """Block the stop signals in this thread before any other thread or process starts: all inherit the mask."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--run-dir" or argv[2] != "--stop-grace-s":
        print(
            "usage: python -m wattgate.train.torchrun --run-dir DIR --stop-grace-s S <torchrun arguments>",
            file=sys.stderr,
        )
        return 2
    try:
        grace_s = float(argv[3])
    except ValueError:
        print(f"torchrun: --stop-grace-s {argv[3]!r} is not a number of seconds", file=sys.stderr)
        return 2
    run, args = Path(argv[1]), argv[4:]
    hold_stop_signals()
    SignalRelay(run, grace_s).start()
    from wattgate.errors import first_line
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    except ChildFailedError as exc:
        for line in record_failures(run, exc.failures):
            print(line, file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        # torchrun gave its ranks the signal and ~30 s to exit, then SIGKILL: the ranks' own lines say how they ended
        name = signal.Signals(exc.sigval).name
        print(f"torchrun: stopped by {name}; its ranks were sent {name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except Exception as exc:  # e.g. the rendezvous store lost with the node that hosted it: that node's line says why
        print(f"torchrun: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The run folder's logs, written by `wattgate launch` itself once it holds the run folder: `train.log` (this
attempt: the launcher, every node's torchrun and ranks, the watcher) and `train.attempts.log` (every attempt,
appended).

They were the train rule's log, which Snakemake deletes before it starts the job again: a second launch into a
running run folder (after `snakemake --unlock`) is refused, but only after Snakemake had deleted the first trainer's
log, whose tee then wrote on into a deleted file. Launch opens them only after it holds `launch.lock`, so a refused
launch never touches them.

How: this process's stdout and stderr go through a `tee` each (to where they went before, and into both files),
which everything it starts inherits. The tees ignore the stop signals (scancel signals every process; a dead tee
would break every rank's output) and keep writing the files when the terminal goes (`tee -p`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from wattgate.run_files import ATTEMPTS_LOG, TRAIN_LOG


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def start_run_logs(out: Path) -> None:
    """From here on this process's output and its children's also go into out/train.log (started anew) and
    out/train.attempts.log (appended). A log that cannot be started is a warning: the output still reaches the
    terminal and Snakemake's log."""
    try:
        (out / TRAIN_LOG).write_bytes(b"")
    except OSError as exc:
        print(f"launch: WARNING: {out / TRAIN_LOG}: cannot write ({exc.strerror})", file=sys.stderr, flush=True)
        return
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        try:
            tee = subprocess.Popen(
                ["tee", "-p", "-a", str(out / TRAIN_LOG), str(out / ATTEMPTS_LOG)],
                stdin=subprocess.PIPE,
                stdout=fd,
                start_new_session=True,
                preexec_fn=_ignore_stop_signals,
            )
        except OSError as exc:
            print(f"launch: WARNING: cannot start tee for {out / TRAIN_LOG} ({exc.strerror})", file=sys.stderr)
            return
        assert tee.stdin is not None  # stdin=PIPE
        os.dup2(tee.stdin.fileno(), fd)
        tee.stdin.close()

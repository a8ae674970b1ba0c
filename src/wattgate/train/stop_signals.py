"""Which signals ask a process of the train job for a graceful stop, and when a repeat of one insists on ending
it at once. Its own module, importing nothing but `signal`: wattgate's torchrun (train/torchrun.py) blocks these
before its heavier imports."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INSISTENT = (signal.SIGTERM, signal.SIGINT)  # repeated after the grace, these end the rank at once


def insists(signum: int, first_at: float | None, now: float, grace_s: float) -> bool:
    """Whether a signal ends the process at once rather than asking for a stop: a SIGTERM or SIGINT that comes
    more than `grace_s` after the first request (someone insists: a hung rank never reaches the next agreed
    point). Within the grace a repeat is the same request again: scancel, preemption and a time limit signal
    every process of the job, torchrun passes its own SIGTERM on to its ranks, and a person presses Ctrl-C twice."""
    return signum in INSISTENT and first_at is not None and now - first_at > grace_s

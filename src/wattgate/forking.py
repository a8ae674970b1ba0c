"""When a stage may fork worker processes, and how many cores they may use (the proof's dry runs, pretokenize's
chat encoding).

A fork copies the forking process's memory, loaded modules included, so a worker starts at once; it also copies
every lock another thread holds at that moment, which no one will release in the child. So a worker is forked
only while the main thread is the process's only Python thread, and only where the fork start method exists.
"""

from __future__ import annotations

import multiprocessing
import os
import threading

MAX_WORKERS = 8


def usable_cores() -> int:
    """Cores this process may run on (a Slurm job's cpuset, not the node's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def no_other_python_threads() -> bool:
    """Whether the main thread is this process's only Python thread."""
    return threading.active_count() == 1


def fork_allowed() -> bool:
    """Whether workers may be forked now: the fork start method exists, this process is no pool's daemon worker
    (those may not have children), and no other Python thread runs."""
    return (
        "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon
        and no_other_python_threads()
    )

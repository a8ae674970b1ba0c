"""The proof's dry runs spread over the gate host's cores: each one is a single-threaded Python loop (FakeTensor
dispatch), so N ranks on C cores take about N / C of the time (the default's gate within 5 s).

Workers are forked (multiprocessing's fork context) once torch, transformers and the model's modules are
imported and before any dry run starts, so a worker starts at once and shares them. A fork copies the locks
other threads hold: no worker is forked while another Python thread runs (it may hold any lock), and a worker
runs torch ops on one thread, as an OpenMP pool the forking process has used hangs a child that enters it for
good (libgomp is not fork-safe). The native pools numpy, Arrow and torch start at import are idle then, and
handle a fork themselves. Each task is one
`dry_run_rank` on its own fake process group, its RankRecord sent back pickled. The gate's own process takes
every C-th task, the first (rank 0) first: the other ranks take what rank 0 sends (proof/relay.py), and wait
for it when they are ahead. A worker that does not answer long after the gate's own share is done is ended and the proof
fails naming it, instead of the gate waiting on it: a fork can inherit a lock held by a thread that is gone.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import time
from multiprocessing.context import TimeoutError as PoolTimeout

from wattgate.forking import MAX_WORKERS, fork_allowed, usable_cores

WAIT_FACTOR, WAIT_MIN_S = 4.0, 120.0  # a worker's share may take this much longer than the gate's own


def run_tasks(fn, tasks: list[tuple], processes: int | None = None) -> list:
    """[fn(*task) for task in tasks], over up to `processes` processes (default: the usable cores), in order."""
    processes = min(len(tasks), processes or usable_cores(), MAX_WORKERS)
    if processes < 2 or not fork_allowed():
        # one core, no fork, inside a pool worker (no children allowed), or another Python thread running (a fork
        # copies the locks it holds)
        return [fn(*task) for task in tasks]
    before = set(multiprocessing.active_children())
    pool = multiprocessing.get_context("fork").Pool(processes - 1, initializer=_default_signals)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    try:
        pending = {i: pool.apply_async(fn, task) for i, task in enumerate(tasks) if i % processes}
        t0 = time.perf_counter()
        results = {i: fn(*task) for i, task in enumerate(tasks) if i % processes == 0}
        own_s = time.perf_counter() - t0
        deadline = time.perf_counter() + max(WAIT_MIN_S, WAIT_FACTOR * own_s)
        for i, result in pending.items():
            try:
                results[i] = result.get(timeout=max(0.0, deadline - time.perf_counter()))
            except PoolTimeout:
                raise RuntimeError(
                    f"a dry-run worker (task {i + 1} of {len(tasks)}) did not finish within "
                    f"{max(WAIT_MIN_S, WAIT_FACTOR * own_s):.0f} s of the gate's own share ({own_s:.1f} s); "
                    "rerun the gate"
                ) from None
        pool.close()
        return [results[i] for i in range(len(tasks))]
    finally:
        pool.terminate()
        for worker in workers:  # a worker stuck on an inherited lock ignores SIGTERM's Python handler: SIGKILL it
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
        pool.join()


@contextlib.contextmanager
def frozen_heap():
    """The garbage collector leaves what exists now alone until the block ends (gc.freeze, then unfreeze): the
    dry runs allocate enough to trigger many full collections, each of which would otherwise walk the millions of
    objects torch and transformers import (0.3 s of the default's 5 s gate on 2 cores), and a forked worker
    inherits the frozen heap."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _default_signals() -> None:
    """A worker takes SIGTERM's default action (the gate's pool.terminate must end it, whatever handler the forking
    process had installed), and runs torch ops on one thread: a one-thread op never enters the OpenMP pool it
    inherited."""
    import signal

    import torch

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)

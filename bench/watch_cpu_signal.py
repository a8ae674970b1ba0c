"""Is a rank's CPU time a hang signal without power data? Measured, not assumed.

Two gloo ranks: rank 0 enters an all_reduce at once and waits there; rank 1 multiplies matrices for
`--compute-s` seconds and then joins. The parent reads both ranks' utime+stime from /proc/<pid>/stat
(what the watcher reads) over the same wall interval and prints each rank's share of one core.

Run: `.venv/bin/python bench/watch_cpu_signal.py` (about 10 s). Measured on the 2-core dev VM under
load from other work: the waiting rank 0.00-0.02 of a core, the computing rank 0.7-1.0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wattgate.telemetry.watch_inputs import cpu_seconds


def rank_main(rank: int, world: int, port: int, compute_s: float, ready) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ready.put((rank, os.getpid()))
    if rank == 1:
        a = torch.randn(256, 256)
        end = time.monotonic() + compute_s
        while time.monotonic() < end:
            a = torch.tanh(a @ a)
    dist.all_reduce(torch.ones(4))  # rank 0 waits here for rank 1's whole compute
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compute-s", type=float, default=6.0)
    p.add_argument("--port", type=int, default=29533)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, a.port, a.compute_s, ready)) for r in range(2)]
    for proc in procs:
        proc.start()
    pids = dict(ready.get(timeout=120) for _ in procs)
    time.sleep(1.0)  # both ranks past init: rank 0 in the all_reduce, rank 1 computing
    before, t0 = {r: cpu_seconds(pid) for r, pid in pids.items()}, time.monotonic()
    time.sleep(min(3.0, a.compute_s - 2.0))
    after, dt = {r: cpu_seconds(pid) for r, pid in pids.items()}, time.monotonic() - t0
    for r in sorted(pids):
        role = "waiting in all_reduce" if r == 0 else "computing"
        print(f"rank {r} ({role}): {(after[r] - before[r]) / dt:.3f} of a core over {dt:.2f} s")
    for proc in procs:
        proc.join(timeout=60)
    sys.exit(max(proc.exitcode or 0 for proc in procs))


if __name__ == "__main__":
    main()

"""Is a rank's CPU time a hang signal without power data? Measured, not assumed.

Two gloo ranks: rank 0 enters an all_reduce at once and waits there; rank 1 multiplies matrices for
`--compute-s` seconds and then joins. The parent reads both ranks' utime+stime from /proc/<pid>/stat
(what the watcher reads) over the same wall interval and prints each rank's share of one core.

Run: `.venv/bin/python bench/watch_cpu_signal.py` (about 10 s; `--smoke`: 3 s of compute, 1 s measured).
Measured on the 2-core dev VM under load from other work: the waiting rank 0.00-0.02 of a core, the computing
rank 0.7-1.0.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchlib import Parser, figure, positive_float, positive_int
from wattgate.telemetry.watch_inputs import cpu_seconds

SMOKE_COMPUTE_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    p = Parser(description=__doc__.splitlines()[0], smoke=f"{SMOKE_COMPUTE_S:g} s of compute")
    p.add_argument("--compute-s", type=positive_float, default=None, help="rank 1's compute (default 6 s, > 2.5)")
    p.add_argument("--port", type=positive_int, default=None, help="the ranks' TCP port (default: a free one)")
    a = p.parse_args()
    a.compute_s = a.compute_s or (SMOKE_COMPUTE_S if a.smoke else 6.0)
    if a.compute_s <= 2.5:
        p.error("argument --compute-s: more than 2.5 s (1 s of start-up, at least half a second measured)")
    port = a.port or free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, a.compute_s, ready)) for r in range(2)]
    for proc in procs:
        proc.start()
    pids = dict(ready.get(timeout=120) for _ in procs)
    time.sleep(1.0)  # both ranks past init: rank 0 in the all_reduce, rank 1 computing
    before, t0 = {r: cpu_seconds(pid) for r, pid in pids.items()}, time.monotonic()
    time.sleep(min(3.0, a.compute_s - 2.0))
    after, dt = {r: cpu_seconds(pid) for r, pid in pids.items()}, time.monotonic() - t0
    share = {r: (after[r] - before[r]) / dt for r in pids}
    for r in sorted(pids):
        role = "waiting in all_reduce" if r == 0 else "computing"
        print(f"rank {r} ({role}): {share[r]:.3f} of a core over {dt:.2f} s")
    figure(
        "watch_cpu_signal",
        f"CPU share of a rank waiting in a gloo all_reduce, over {dt:.2f} s",
        f"{share[0]:.3f} of a core",
        f"the computing rank beside it {share[1]:.3f} of a core",
    )
    for proc in procs:
        proc.join(timeout=60)
    sys.exit(max(proc.exitcode or 0 for proc in procs))


if __name__ == "__main__":
    main()

"""`python bench/dry_run/cuda_cli.py calibrate ...`: the wattgate CLI with CUDA stood in by the CPU, for
`bench/gpu_checks.sh --dry-run` only (with bench/dry_run/ first on PYTHONPATH: NVML is pynvml.py beside this).

calibrate needs a CUDA GPU; here its phases run on the CPU at tiny shapes (every tensor dimension cut to 128:
the matmuls stand in for calibrate's 8192 x 8192 ones, and the matmul rate it reports counts those; a 1 MiB
"checkpoint"; a spin kernel that busy-waits) and each sets the stand-in GPU's power and utilization to a level
like the phase's on an H200, so the whole stage runs: the CLI, the background sampler on NVML, the phase
statistics, the derived table and the samples trace. The figures it writes are the stand-in's, not a GPU's.
"""

from __future__ import annotations

import functools
import sys
import time

import pynvml  # the stand-in beside this file
import torch

from wattgate.cli import main
from wattgate.power import calibrate as cal

TINY = 128  # the largest tensor dimension the stand-in allocates
CPU = torch.device("cpu")
SETTLE_S = 0.2  # calibrate discards each phase's first seconds (3 s on a GPU)
# (power W, utilization %) the stand-in GPU reads while each phase runs
LOAD = {
    "idle": (75.0, 0),
    "compute": (650.0, 100),
    "data_starvation": (320.0, 45),
    "checkpoint": (90.0, 2),
    "communication": (260.0, 100),
    "deadlock": (125.0, 100),
}


class CudaStandIn:
    """torch.cuda as calibrate's phases call it."""

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def _sleep(cycles: int) -> None:  # a spin kernel of `cycles` at a 1 GHz clock: a busy wait
        end = time.perf_counter() + cycles / 1e9
        while time.perf_counter() < end:
            pass

    @staticmethod
    def device_count() -> int:
        return 1


class TinyTorch:
    """The `torch` calibrate's phases are given: CPU tensors of at most TINY per dimension."""

    cuda = CudaStandIn()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def randn(*shape, device=None, dtype=None):
        return torch.randn(*(min(s, TINY) for s in shape), dtype=dtype)

    @staticmethod
    def empty(n, dtype=None, device=None):
        return torch.empty(min(n, TINY * TINY), dtype=dtype)


def phase(name: str, runner, **sizes):
    """calibrate's runner for `name`, on the CPU at tiny sizes, with the stand-in GPU at the phase's load."""

    @functools.wraps(runner)
    def run(_torch, *args, **kwargs):
        pynvml.set_load(*LOAD[name])
        args = tuple(CPU if isinstance(a, torch.device) else a for a in args)
        return runner(TinyTorch(), *args, **{**kwargs, **sizes})

    return run


def install() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = CudaStandIn.device_count
    torch.cuda.synchronize = CudaStandIn.synchronize
    ones = torch.ones
    torch.ones = lambda *shape, device=None, **kw: ones(*shape, **kw)  # calibrate's "context" tensor, on the CPU
    cal.run_idle = phase("idle", cal.run_idle)
    cal.run_compute = phase("compute", cal.run_compute)
    cal.run_data_starvation = phase("data_starvation", cal.run_data_starvation)
    cal.run_checkpoint = phase("checkpoint", cal.run_checkpoint, gib=1 / 1024)
    cal.run_deadlock = phase("deadlock", cal.run_deadlock)
    cal.calibrate = functools.partial(cal.calibrate, settle_s=SETTLE_S)


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))

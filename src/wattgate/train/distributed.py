"""Process group, device, and the process settings every rank needs before it builds a model."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def die_with_parent() -> None:
    """Linux: SIGKILL this rank when its torchrun agent dies.

    torchrun starts every worker in a session of its own, so killing the launcher's process
    group (a watcher, scancel, kill -9) would otherwise leave orphan ranks running, holding
    GPUs and racing a restarted job over the same checkpoints.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    import signal

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(1)


# glibc mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """Linux/glibc: keep freed activation buffers in the heap instead of returning them to the OS.

    With glibc's adaptive defaults the CPU path unmapped and re-faulted its large per-step
    buffers every step: 30-80% more minor page faults and ~15% slower steps than a bare loop
    (bench/train_overhead.py). Fixed thresholds keep the memory mapped between steps.
    """
    # an allocator set in the environment (wattgate launch sets one for CPU ranks) is the choice: keep it
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 256 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def init_distributed(timeout_s: float, out: Path) -> tuple[int, int, torch.device]:
    """Ranks come from torchrun's environment (c10d hands out ranks in join order, not --node_rank)."""
    if "RANK" not in os.environ:  # run by hand: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        # NCCL flight recorder: on a timeout every rank dumps its last collectives, naming the one missing
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        (out / "nccl-trace").mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(out / "nccl-trace" / "rank_"))
        # expandable segments: fewer fragmentation OOMs when packed micro-batches vary in shape
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def setup_rank(timeout_s: float, out: Path) -> tuple[int, int, torch.device]:
    """Everything a rank does before touching data or a model: die with the agent, allocator, group."""
    die_with_parent()
    keep_freed_memory()
    return init_distributed(timeout_s, out)


def device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID as NVML reports it, so triage can match a rank to its trace rows."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def equal_across_ranks(values: list[int], device: torch.device) -> bool:
    """Whether every rank holds the same `values` (two small all-reduces, the same answer on every rank)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return torch.equal(lo, hi)

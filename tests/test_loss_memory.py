"""Steady-state memory on CPU ranks (issue 23, item 5): launch sets glibc's mmap threshold for CPU ranks, the
rank keeps it (no fixed 256 MiB threshold on top), TRAINED can say which allocator ran, and the gate counts
no optimizer state for SGD."""

from __future__ import annotations

import subprocess
import sys

from conftest import QWEN3_32B, QWEN3_SETTINGS

from wattgate.config import run_config
from wattgate.gate import memory as M
from wattgate.model_spec import ModelSpec
from wattgate.records.run_config import RunConfig
from wattgate.train.launch import CPU_ALLOCATOR_ENV, allocator_record, launch_env, resolve_launch

CPU = {"cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_model": "cpu", "launcher": "local", "cpus_per_node": 4}}
CPU["cluster"].update(rendezvous_host=None)


def config(gpu_model: str) -> RunConfig:
    return run_config({"cluster": dict(CPU["cluster"], gpu_model=gpu_model)})


def test_launch_sets_the_mmap_threshold_for_cpu_ranks_only_and_keeps_a_users_value():
    cpu = launch_env(resolve_launch(config("cpu"), environ={}), base={})
    assert cpu["MALLOC_MMAP_THRESHOLD_"] == CPU_ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    gpu = launch_env(resolve_launch(config("h100"), environ={}), base={})
    assert "MALLOC_MMAP_THRESHOLD_" not in gpu
    mine = launch_env(resolve_launch(config("cpu"), environ={}), base={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert mine["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_allocator_record_names_where_the_setting_came_from():
    assert allocator_record({"MALLOC_MMAP_THRESHOLD_": "1048576", "PATH": "/bin"}) == {
        "source": "environment",
        "MALLOC_MMAP_THRESHOLD_": "1048576",
    }
    assert allocator_record({}) == {"source": "keep_freed_memory"}


def block_placement_after_setup(env: dict) -> str:
    """Where a fresh process's 4 MiB malloc goes after keep_freed_memory(): 'mmap' (below the threshold: mapped
    on its own, unmapped when freed) or 'heap'. glibc marks a mapped chunk with bit 0x2 of its size word."""
    probe = (
        "import ctypes;"
        "from wattgate.train.distributed import keep_freed_memory;"
        "keep_freed_memory();"
        "libc = ctypes.CDLL('libc.so.6');"
        "libc.malloc.restype = ctypes.c_void_p;"
        "p = libc.malloc(4 << 20);"
        "size = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value;"
        "print('mmap' if size & 2 else 'heap')"
    )
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout


def test_a_rank_keeps_the_launchers_allocator():
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    # keep_freed_memory alone: a 4 MiB block stays in the heap (threshold 256 MiB)
    assert block_placement_after_setup(base).strip() == "heap"
    # launch's environment: the same block is mapped on its own and given back when freed
    assert block_placement_after_setup(dict(base, **CPU_ALLOCATOR_ENV)).strip() == "mmap"


def test_the_gate_counts_optimizer_state_only_for_adamw():
    spec = ModelSpec.from_hf_config(QWEN3_32B, "t")
    adamw = M.estimate_memory(spec, M.FitSettings(**QWEN3_SETTINGS))
    sgd = M.estimate_memory(spec, M.FitSettings(**QWEN3_SETTINGS, optimizer="sgd"))
    assert adamw["sharded_adam_state_fp32"] == spec.num_params * 8 // 16
    assert "sharded_adam_state_fp32" not in sgd and sum(adamw.values()) - sum(sgd.values()) == spec.num_params // 2

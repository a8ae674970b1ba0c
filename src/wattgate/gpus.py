"""The one table of GPU facts and the one GPU-name normalisation; every stage reads GPUs from here.

One row per model: the datasheet's dense bf16 peak (MFU, the analytic
forecast), usable device memory (the gate; a model sold with several sizes
lists each, the default first), the power cap and idle draw (those of its
shipped triage table, triage_tables/<table>.yaml, which stays the triage
table proper) and the name of that table. `cpu` has no row.

Names are matched by `model_key`: without case, without a leading "NVIDIA"
and without what follows the model ("A100-80GB", "NVIDIA H100 80GB HBM3" and
"h100" are an a100, an h100, an h100). A memory size in the name ("40GB")
picks that size of the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str  # as the datasheet writes it
    peak_bf16_tflops: float  # dense, datasheet
    memory_gib: tuple[int, ...]  # usable device memory of each size sold; the first when the name gives none
    power_cap_w: float  # the shipped triage table's tdp_w
    idle_w: float  # the shipped triage table's idle_w
    triage_table: str | None  # triage_tables/<triage_table>.yaml; None: none ships


GPUS = {
    "a100": GPU("A100", 312, (80, 40), power_cap_w=400, idle_w=60, triage_table="a100"),
    "h100": GPU("H100", 989, (80,), power_cap_w=700, idle_w=70, triage_table="h100"),
    "h200": GPU("H200", 989, (141,), power_cap_w=700, idle_w=118.9, triage_table="h200"),
    "b200": GPU("B200", 2250, (180,), power_cap_w=1000, idle_w=165, triage_table="b200"),
    "b300": GPU("B300", 2250, (288,), power_cap_w=1100, idle_w=160, triage_table="b300"),
}

# The triage tables that ship with the package (triage_tables/<name>.yaml).
SHIPPED = tuple(g.triage_table for g in GPUS.values() if g.triage_table)

_SIZE = re.compile(r"(\d+)gi?b?")


def model_key(gpu_model: str) -> str:
    """'A100-80GB' -> 'a100', 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu', '' -> ''."""
    words = _words(gpu_model)
    return words[0] if words else ""


def _words(gpu_model: str) -> list[str]:
    return gpu_model.lower().replace("nvidia", "").replace("-", " ").split()


def is_cpu(gpu_model: str) -> bool:
    """cluster.gpu_model names a CPU run (no GPU row)."""
    return model_key(gpu_model) == "cpu"


def gpu(gpu_model: str) -> GPU | None:
    """The model's row, or None for a model not in the table (and cpu)."""
    return GPUS.get(model_key(gpu_model))


def peak_bf16_flops(gpu_model: str) -> float | None:
    """Datasheet dense bf16 FLOP/s of one GPU, or None for a model not in the table (and cpu)."""
    row = gpu(gpu_model)
    return row.peak_bf16_tflops * 1e12 if row else None


def memory_gib(gpu_model: str) -> tuple[int, str] | None:
    """Usable device memory (GiB) and the table entry it came from ('A100-40GB', 'H100'); None for a
    model not in the table, cpu, or a size the model is not sold with ('H100-94GB')."""
    row = gpu(gpu_model)
    if row is None:
        return None
    sizes = [int(m.group(1)) for w in _words(gpu_model)[1:] if (m := _SIZE.fullmatch(w))]
    if not sizes:
        return row.memory_gib[0], row.name
    if sizes[0] not in row.memory_gib:
        return None
    return sizes[0], f"{row.name}-{sizes[0]}GB"


def memory_names() -> list[str]:
    """The names the memory table knows, for error messages: 'A100-80GB', 'A100-40GB', 'A100', 'H100', ..."""
    out = []
    for row in GPUS.values():
        if len(row.memory_gib) > 1:
            out += [f"{row.name}-{size}GB" for size in sorted(row.memory_gib)]
        out.append(row.name)
    return out


def triage_table_name(gpu_model: str) -> str | None:
    """The shipped triage table for the model ('A100-80GB' -> 'a100'), or None when none ships (and cpu)."""
    row = gpu(gpu_model)
    return row.triage_table if row else None

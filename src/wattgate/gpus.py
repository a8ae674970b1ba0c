"""Facts about GPU models that several stages need: the datasheet's dense bf16 peak.

Names are matched without case and without a memory suffix ("A100-80GB" is an a100).
"""

from __future__ import annotations

# Dense bf16 peak per GPU (TFLOP/s, datasheet), for MFU and the analytic forecast; unknown models have none.
PEAK_BF16_TFLOPS = {"a100": 312, "h100": 989, "h200": 989, "b200": 2250, "b300": 2250}


def model_key(gpu_model: str) -> str:
    """'A100-80GB' -> 'a100', 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
    words = gpu_model.lower().replace("nvidia", "").replace("-", " ").split()
    return words[0] if words else ""


def peak_bf16_flops(gpu_model: str) -> float | None:
    """Datasheet dense bf16 FLOP/s of one GPU, or None for a model not in the table (and cpu)."""
    peak = PEAK_BF16_TFLOPS.get(model_key(gpu_model))
    return peak * 1e12 if peak else None

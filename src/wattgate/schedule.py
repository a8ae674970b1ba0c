"""The learning-rate schedule, per global optimizer step (no torch: the gate checks it too)."""

from __future__ import annotations

import math


def learning_rate(step: int, total: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to lr, then cosine down to lr * min_lr_ratio at the last step."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

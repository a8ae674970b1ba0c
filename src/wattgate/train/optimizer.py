"""The optimizer and its learning rate at each step, both from the config's `train` section."""

from __future__ import annotations

import torch

from wattgate.records.run_config import TrainConfig
from wattgate.schedule import learning_rate


def build_optimizer(model, train: TrainConfig) -> torch.optim.Optimizer:
    """train.optimizer over the model's parameters: SGD, or AdamW (torch's foreach kernel)."""
    if train.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    beta1, beta2 = train.betas  # two (the config schema's minItems and maxItems)
    return torch.optim.AdamW(
        model.parameters(), lr=train.lr, betas=(beta1, beta2), weight_decay=train.weight_decay, foreach=True
    )


def lr_at(step: int, train: TrainConfig, total: int) -> float:
    """Linear warmup to lr, then cosine down to lr * min_lr_ratio at the last step (wattgate/schedule.py)."""
    return learning_rate(step, total, train.lr, train.warmup_steps, train.min_lr_ratio)

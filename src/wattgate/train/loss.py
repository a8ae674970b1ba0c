"""Packed-sequence loss: summed token losses, normalized by the global batch's loss-token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wattgate.train.data import IGNORE, Batch


def to_tensors(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.from_numpy(batch.input_ids).to(device, non_blocking=True),
        "labels": torch.from_numpy(batch.labels).to(device, non_blocking=True),
        "position_ids": torch.from_numpy(batch.position_ids).to(device, non_blocking=True),
    }


def forward_logits(model, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    # No attention_mask and no cache: that is how transformers recognizes packed rows from
    # position_ids and keeps attention inside each document. With a cache (use_cache defaults
    # to True) documents silently attend to each other.
    return model(input_ids=tensors["input_ids"], position_ids=tensors["position_ids"], use_cache=False).logits


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over loss-bearing positions (fp32)."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
    )

"""Packed-sequence loss: summed token losses, normalized by the global batch's loss-token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wattgate.train.attention import packed_model_inputs
from wattgate.train.data import IGNORE, Batch


def to_tensors(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.from_numpy(batch.input_ids).to(device, non_blocking=True),
        "labels": torch.from_numpy(batch.labels).to(device, non_blocking=True),
        "position_ids": torch.from_numpy(batch.position_ids).to(device, non_blocking=True),
    }


def forward_logits(model, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [micro_batch_size, seq_len, vocab] with attention kept inside each packed document.

    No attention_mask and no cache: that is how transformers recognizes packed rows from
    position_ids. With a cache (use_cache defaults to True) documents silently attend to each
    other. Flash kernels need the micro-batch as one row (train/attention.py); logits are
    reshaped back so loss_sum still shifts within each row.
    """
    inputs = packed_model_inputs(tensors["input_ids"], tensors["position_ids"], model.config._attn_implementation)
    logits = model(**inputs, use_cache=False).logits
    return logits.view(*tensors["input_ids"].shape, logits.shape[-1])


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over loss-bearing positions (fp32)."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
    )

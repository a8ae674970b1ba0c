"""Packed-sequence loss: summed next-token losses over loss-bearing positions (the caller normalizes
by the global batch's loss-token count).

Two kinds (train.loss):
- chunked (default): the decoder runs through its final norm and torch's F.linear_cross_entropy
  takes the last hidden state against lm_head's weight `loss_chunk_tokens` rows at a time, so at
  most chunk x vocab logits exist at once, never [micro_batch, seq_len, vocab]. With a graph it
  uses reduction "sum", which computes the hidden state's and the head's gradients in the forward
  (one pass over the chunks, no recompute in backward); torch accumulates that sum in the input
  dtype, so under bf16 the reported training loss is within ~1e-3 relative of the fp32 sum (7e-4
  measured on 8192 tokens; the gradients do not depend on it). Without a graph (validation) the
  per-token losses are summed in fp32 instead (1e-5). Under FSDP2 it runs as a forward method of
  the root (register_fsdp_forward_method): the head weight (embed_tokens' when tied) is
  all-gathered exactly there, as for the root's own forward, and reduce-scattered after backward.
- full: the [B, S, V] logits (forward_logits) and their fp32 cross-entropy (loss_sum): the
  reference the chunked kind is tested against, and the baseline of bench/loss.py.

Both shift within each packed row: position t predicts label t+1 of the same row, and the
labels (train/data.py) are IGNORE at each document's first token, so no document predicts the next.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wattgate.errors import InputError
from wattgate.train.attention import packed_model_inputs
from wattgate.train.data import IGNORE, Batch, host_tensors

LOSS_KINDS = ("chunked", "full")
# 1024 rows x 151,936 vocab is 0.62 GB of fp32 logits per chunk: small next to a step's activations,
# and large enough that each chunk's matmuls keep a GPU busy (see the schema's description)
DEFAULT_CHUNK_TOKENS = 1024
ROOT_LOSS_METHOD = "wattgate_chunked_loss"


@dataclass(frozen=True)
class LossSettings:
    kind: str = "chunked"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @classmethod
    def from_train(cls, train_cfg: dict) -> LossSettings:
        """train.loss and train.loss_chunk_tokens (schema defaults when absent)."""
        kind = train_cfg.get("loss", "chunked")
        chunk = train_cfg.get("loss_chunk_tokens", DEFAULT_CHUNK_TOKENS)
        if kind not in LOSS_KINDS:
            raise InputError(f"train.loss: {kind!r} is not one of {', '.join(LOSS_KINDS)}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise InputError(f"train.loss_chunk_tokens: {chunk!r} must be a positive integer (tokens per chunk)")
        return cls(kind, chunk)


def to_tensors(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (train/data.py host_tensors, then a copy)."""
    return {k: v.to(device, non_blocking=True) for k, v in host_tensors(batch, pin=False).items()}


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


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: the label each position predicts (the next one in its row), IGNORE at each row's end.

    Shifting the targets rather than slicing the hidden state keeps hidden [B*S, H] a view (no copy).
    """
    out = torch.full_like(labels, IGNORE, dtype=torch.int64)
    out[:, :-1] = labels[:, 1:]
    return out


def final_hidden(model, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder's output after its final norm, [B, S, H], with the same packed inputs as forward_logits."""
    inputs = packed_model_inputs(tensors["input_ids"], tensors["position_ids"], model.config._attn_implementation)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    return hidden.view(*tensors["input_ids"].shape, hidden.shape[-1])


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 sum over targets != IGNORE of cross_entropy(hidden @ weight.T + bias), chunk_tokens rows at a time."""
    flat, target = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None)
    kwargs = dict(linear_bias=bias, ignore_index=IGNORE, options=options)
    wants_grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
    if wants_grad:
        return F.linear_cross_entropy(flat, weight, target, reduction="sum", **kwargs).float()
    # no graph (validation): torch accumulates a "sum" in the input dtype (bf16 under mixed precision);
    # per-token losses summed here in fp32 keep the figure exact to fp32 at no extra matmul
    return F.linear_cross_entropy(flat, weight, target, reduction="none", **kwargs).float().sum()


def _root_chunked_loss(model, tensors: dict[str, torch.Tensor], chunk_tokens: int) -> torch.Tensor:
    """The chunked loss from the model's own modules; under FSDP2 the body of the root's forward method."""
    head = model.get_output_embeddings()
    hidden = final_hidden(model, tensors)
    return chunked_cross_entropy_sum(
        hidden, head.weight, shifted_targets(tensors["labels"]), chunk_tokens, getattr(head, "bias", None)
    )


def root_loss_method(model):
    """model's bound chunked-loss method, made once; on an FSDP2 root it is registered as a forward method
    (all-gather before, the root's resharding and backward hooks after), elsewhere it is a plain call."""
    method = model.__dict__.get(ROOT_LOSS_METHOD)
    if method is None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        object.__setattr__(model, ROOT_LOSS_METHOD, types.MethodType(_root_chunked_loss, model))
        register_fsdp_forward_method(model, ROOT_LOSS_METHOD)  # a no-op when model is not an FSDPModule
        method = model.__dict__[ROOT_LOSS_METHOD]
    return method


def summed_token_loss(model, tensors: dict[str, torch.Tensor], settings: LossSettings) -> torch.Tensor:
    """fp32 scalar: the sum of next-token cross-entropy over loss-bearing positions (labels != IGNORE).

    Works with a plain model and an FSDP2-sharded one, with and without a graph (the training step
    and the validation forward under torch.no_grad()).
    """
    if settings.kind == "full":
        return loss_sum(forward_logits(model, tensors), tensors["labels"])
    return root_loss_method(model)(tensors, settings.chunk_tokens)

"""Context parallelism (parallel.context: C): the tokens of each packed row split over C ranks that share the row.

Each rank of a context group holds 1/C of every row's tokens and runs the whole model on them. Everything but
attention is per token, so only attention crosses ranks: each rank all-gathers the group's keys and values (with
autograd: backward reduce-scatters their gradients) and its queries attend to every earlier key of their own
document, none of another's. That is the same attention as one rank holding the row, so the loss is too.

Balance: every rank holds the same number of each row's tokens, in chunks (context_layout.py): head-tail, or per
row the deal of chunks that evens out the causal within-document pairs, the work of a kernel that skips masked pairs.
The gate (context_balance) works out the same split from the plan and holds its cost to the bound.

Kernels: on CUDA, flex attention with a block mask from the same document rule (compiled; whole blocks that no query
attends are skipped); on CPU, sdpa with a boolean mask (flex attention has no backward on CPU). Both compute the same
attention: tests compare their forwards on CPU, bench/gpu_checks.sh trains with flex.

Loss: positions are not contiguous on a rank, so targets are shifted on the whole row before it is split (position t
predicts label t+1 of the row, as loss.shifted_targets does): no target is lost at a chunk boundary, and the C shards'
summed losses add up to the row's.

The attention runs through transformers' attention interface under CONTEXT_ATTENTION for any dense family, with no
model code of our own: the per-micro-batch context (group, query indices, document ids) travels as a keyword
argument of model(...), which transformers 5 hands down through the decoder layers to the attention function. The
mask function registered under the same name returns None, so transformers builds no mask from the rank's local
position_ids (its packed-sequence mask of the local slice would be wrong across chunks); the mask is built here from
global indices. Rotary needs nothing: each token's position_ids already hold its position within its document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from wattgate.context_layout import document_lengths, planned_context_kernel, split_rows
from wattgate.errors import InputError
from wattgate.train.attention import document_starts, flex_attention_trainable
from wattgate.train.data import IGNORE
from wattgate.train.loss import shifted_targets

CONTEXT_ATTENTION = "wattgate_context"  # the attn_implementation name in transformers' registries
CONTEXT_KWARG = "wattgate_context"  # the keyword of model(...) that carries a ContextAttention
# attention features of transformers' interface this function does not implement: refused, never ignored
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def check_context_split(seq_len: int, context: int) -> None:
    """One-line InputError unless seq_len splits into 2 * context equal chunks (context_layout.chunk_count)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise InputError(f"parallel.context: {context!r} must be a positive integer (ranks per row)")
    if seq_len % (2 * context):
        raise InputError(
            f"parallel.context: {context} needs train.seq_len divisible by {2 * context} (2 chunks per rank), "
            f"got {seq_len}"
        )


def context_kernel(requested: str, device_type: str) -> str:
    """The kernel context attention runs for train.attn_implementation `requested` on `device_type`: the one the
    gate planned for (context_layout.planned_context_kernel), but sdpa where flex attention cannot train under
    auto (no triton; sdpa is balanced by construction). Config validation refuses flash_attention_2 under
    parallel.context > 1."""
    if planned_context_kernel(requested, device_type == "cuda") == "sdpa":
        return "sdpa"
    if flex_attention_trainable(device_type):
        return "flex"
    if requested == "flex_attention":
        raise InputError(
            "train.attn_implementation: flex_attention has no backward here (it needs CUDA with triton); set it to "
            "auto or sdpa"
        )
    return "sdpa"


def row_positions(tensors: dict[str, torch.Tensor], context: int) -> torch.Tensor:
    """int64 [B, C, S/C] on the host: the split of rows given as tensors (whole rows, real tensors) by their
    position_ids, as the trainer makes it from the plan's document lengths (context_layout.split_rows)."""
    position_ids = tensors["position_ids"].cpu().numpy()
    check_context_split(position_ids.shape[-1], context)
    return torch.from_numpy(split_rows(document_lengths(position_ids), position_ids.shape[-1], context))


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: each token's document number within its row (padding is a document of its own), counted
    from where position_ids restart at 0, as the packer lays rows out (train/data.py build_batch)."""
    return document_starts(position_ids).long().cumsum(-1)


def shard_rows(tensors: dict[str, torch.Tensor], context: int, rank: int) -> dict[str, torch.Tensor]:
    """Context rank `rank`'s share of a micro-batch's full rows {"input_ids", "labels", "position_ids"} [B, S] and
    their split {"context_positions"} [B, C, S/C] (the trainer's, from the plan; absent: made from position_ids).

    Returns input_ids, position_ids and targets [B, S/C] (targets already shifted on the full row: the label each
    local position predicts, IGNORE where none), query_index [B, S/C] (their row positions), key_index [B, S] (the
    row positions of the group's all-gathered tokens, rank after rank) and doc_ids [B, S] (every row token's
    document).
    """
    split = tensors.get("context_positions")
    if split is None:
        split = row_positions(tensors, context)
    if split.shape[1] != context or not 0 <= rank < context:
        raise ValueError(f"context rank {rank} of {context} with a split for {split.shape[1]} ranks")
    split = split.to(tensors["input_ids"].device)
    local = split[:, rank]
    return {
        "input_ids": tensors["input_ids"].gather(1, local),
        "position_ids": tensors["position_ids"].gather(1, local),
        "targets": shifted_targets(tensors["labels"]).gather(1, local),
        "query_index": local,
        "key_index": split.flatten(1),
        "doc_ids": document_ids(tensors["position_ids"]),
    }


@dataclass
class ContextAttention:
    """One micro-batch's context for the attention function: the group its keys and values are gathered over
    (None: a group of one), the global layout of queries and keys, and the kernel. Masks are built on first use and
    shared by every layer with the same sliding window (one per micro-batch, not one per layer)."""

    group: dist.ProcessGroup | None
    query_index: torch.Tensor  # [B, s]
    key_index: torch.Tensor  # [B, S]
    doc_ids: torch.Tensor  # [B, S]
    kernel: str = "sdpa"
    masks: dict[int | None, torch.Tensor | BlockMask] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor | BlockMask:
        """The kernel's mask: sdpa's bool [B, 1, s, S] (document_causal_mask), flex's BlockMask of the same rule."""
        if sliding_window not in self.masks:
            lower = lowest_keys(self.query_index, self.doc_ids, sliding_window)
            if self.kernel == "flex":
                self.masks[sliding_window] = document_block_mask(self.query_index, self.key_index, lower)
            else:
                self.masks[sliding_window] = document_causal_mask(self.query_index, self.key_index, lower)
        return self.masks[sliding_window]


def lowest_keys(query_index: torch.Tensor, doc_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """int64 [B, s]: the lowest row position each query sees: its document's first position, and under a sliding
    window fewer than `sliding_window` positions back (as transformers' sliding_window_overlay counts). Within a
    document row positions differ as positions do, so the window is the model's own."""
    lower = document_first_positions(doc_ids).gather(1, query_index)
    if sliding_window is not None:
        lower = torch.maximum(lower, query_index - sliding_window + 1)
    return lower


def document_causal_mask(query_index: torch.Tensor, key_index: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, s, S]: query i (row position query_index[b, i]) sees key j (row position key_index[b, j]) when
    lower[b, i] <= key <= query: the same document (a document is a contiguous span of its row), not later.

    Two comparisons of index vectors straight into bool, 2 bytes per (query, key) pair at the peak instead of an
    int64 distance matrix beside two bool ones (11 bytes: most of a 16k row's memory at C = 1,
    bench/context_memory.py)."""
    keys = key_index.unsqueeze(1)
    mask = keys >= lower.unsqueeze(-1)
    mask &= keys <= query_index.unsqueeze(-1)
    return mask.unsqueeze(1)


def document_block_mask(query_index: torch.Tensor, key_index: torch.Tensor, lower: torch.Tensor) -> BlockMask:
    """flex attention's BlockMask of document_causal_mask's rule: blocks of (query, key) pairs that no query attends
    are skipped, so a rank pays for its documents' causal pairs, not its whole seq_len/C x seq_len block."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_not_later(b, h, q, kv):
        key = key_index[b, kv]
        return (key >= lower[b, q]) & (key <= query_index[b, q])

    rows, s = query_index.shape
    # compiled on CUDA: the mask is then made block by block, never as an s x S tensor
    compiled = {"_compile": True} if query_index.is_cuda else {}
    return create_block_mask(
        same_document_not_later, rows, None, s, key_index.shape[1], device=query_index.device, **compiled
    )


def document_first_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: the row position where each token's document starts."""
    positions = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(starts, positions, 0).cummax(dim=-1).values


def gather_sequence(states: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, H, s, D] -> [B, H, C*s, D]: every context rank's tokens in rank order, with autograd (the functional
    all-gather's backward reduce-scatters the gradient back to the rank that owns each token). The tokens stay in
    gather order, not row order: attention does not depend on the keys' order when the mask follows it (key_index),
    so no reordering copy is made."""
    if group is None or dist.get_world_size(group) == 1:
        return states
    from torch.distributed._functional_collectives import all_gather_single, wait_tensor

    gathered = all_gather_single(states.movedim(2, 0).contiguous(), 0, group)  # gathers along dim 0 only
    return wait_tensor(gathered).movedim(0, 2)


def context_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query [B, Hq, s, D], key/value [B, Hkv, s, D] of this rank's
    tokens (rotary applied) -> output [B, s, Hq, Dv], exact attention over the whole row's documents. A sliding
    layer's window comes as the `sliding_window` keyword (None or absent: full attention)."""
    ctx = kwargs.get(CONTEXT_KWARG)
    name = type(module).__name__
    if not isinstance(ctx, ContextAttention):
        raise InputError(
            f"parallel.context: {name} runs {CONTEXT_ATTENTION} without its context; call the model through "
            "context_loss_sum (or pass wattgate_context=ContextAttention(...))"
        )
    used = [k for k in UNSUPPORTED if kwargs.get(k) is not None]
    if used or attention_mask is not None:
        what = ", ".join(used) or "an attention mask of its own"
        raise InputError(f"parallel.context: {name} attention uses {what}, which context parallelism does not support")
    # keys and values in one collective: half the latency of two, and the same bytes
    kv = gather_sequence(torch.cat([key, value], dim=-1), ctx.group)
    key, value = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
    mask = ctx.mask(kwargs.get("sliding_window"))
    if isinstance(mask, BlockMask):  # the flex kernel
        if dropout:
            raise InputError(f"parallel.context: {name} attention uses dropout {dropout}, which flex attention lacks")
        gqa = key.shape[1] != query.shape[1]
        out = flex_kernel(query.device.type)(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    groups = query.shape[1] // key.shape[1]  # query heads per key/value head (GQA)
    if groups > 1:  # repeated, as transformers' sdpa path does when a mask is given (GQA kernels want none)
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_FLEX: dict[str, Callable] = {}  # the flex attention function per device type, compiled once per process on CUDA


def flex_kernel(device_type: str) -> Callable:
    """torch's flex_attention, compiled for CUDA (uncompiled it materializes every score); eager elsewhere, where
    only its forward runs (on CPU the tests compare it with sdpa's)."""
    if device_type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[device_type] = torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention
    return _FLEX[device_type]


def no_mask(*args, **kwargs) -> None:
    """The mask function registered for CONTEXT_ATTENTION: no mask from transformers (it only sees this rank's
    slice of the row); context_attention builds the row's own."""
    return None


def register_context_attention() -> None:
    """Register the attention and mask functions under CONTEXT_ATTENTION (idempotent; class-wide registries)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(CONTEXT_ATTENTION, context_attention)
    AttentionMaskInterface.register(CONTEXT_ATTENTION, no_mask)


def use_context_attention(model) -> None:
    """Switch `model` (a transformers PreTrainedModel) to context-parallel attention."""
    register_context_attention()
    model.set_attn_implementation(CONTEXT_ATTENTION)


def context_loss_sum(
    model, shard: dict[str, torch.Tensor], group: dist.ProcessGroup | None, kernel: str = "sdpa"
) -> torch.Tensor:
    """fp32 scalar: the summed next-token cross-entropy of one context shard (shard_rows) through the model's own
    forward and logits; the sum over the group's ranks is the rows' loss_sum."""
    if model.config._attn_implementation != CONTEXT_ATTENTION:
        raise InputError(
            f"parallel.context: the model runs {model.config._attn_implementation!r} attention, which would keep each "
            f"rank's tokens to themselves; switch it with use_context_attention"
        )
    ctx = ContextAttention(group, shard["query_index"], shard["key_index"], shard["doc_ids"], kernel)
    logits = model(
        input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False, **{CONTEXT_KWARG: ctx}
    ).logits
    return F.cross_entropy(
        logits.flatten(0, 1).float(), shard["targets"].flatten(), ignore_index=IGNORE, reduction="sum"
    )

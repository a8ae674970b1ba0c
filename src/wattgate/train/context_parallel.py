"""Context parallelism (parallel.context: C): the tokens of each packed row split over C ranks that share the row.

Each rank of a context group holds 1/C of every row's tokens and runs the whole model on them. Everything but
attention is per token, so only attention crosses ranks: each rank all-gathers the group's keys and values (with
autograd: backward reduce-scatters their gradients) and its queries attend to every earlier key of their own
document, none of another's. That is the same attention as one rank holding the row, so the loss is too.

Balance: causal attention costs a query in proportion to its index, so giving rank r the r-th contiguous slice would
load the last rank C times more than the first on a row-long document. Head-tail splits the row into 2C equal chunks
and gives rank r chunks r and 2C-1-r: every rank then holds the same number of (query, key) pairs.

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

from dataclasses import dataclass, field


import torch
import torch.distributed as dist
import torch.nn.functional as F

from wattgate.errors import InputError
from wattgate.train.attention import document_starts
from wattgate.train.data import IGNORE
from wattgate.train.loss import shifted_targets

# Whether the context kernel skips the (query, key) pairs its mask removes. It does not: torch's
# scaled_dot_product_attention with a boolean mask computes every pair of a rank's S/C x S block, so every context
# rank does the same attention work whatever its documents (the gate's context_balance check reads this)
SKIPS_MASKED_PAIRS = False
CONTEXT_ATTENTION = "wattgate_context_sdpa"  # the attn_implementation name in transformers' registries
CONTEXT_KWARG = "wattgate_context"  # the keyword of model(...) that carries a ContextAttention
# attention features of transformers' interface this function does not implement: refused, never ignored
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def check_context_split(seq_len: int, context: int) -> None:
    """One-line InputError unless seq_len splits into 2 * context equal head-tail chunks."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise InputError(f"parallel.context: {context!r} must be a positive integer (ranks per row)")
    if seq_len % (2 * context):
        raise InputError(
            f"parallel.context: {context} needs train.seq_len divisible by {2 * context} (2 chunks per rank), "
            f"got {seq_len}"
        )


def head_tail_indices(seq_len: int, context: int, rank: int) -> torch.Tensor:
    """int64 [seq_len // context]: the row positions context rank `rank` holds, chunk r then chunk 2C-1-r of 2C."""
    check_context_split(seq_len, context)
    if not 0 <= rank < context:
        raise ValueError(f"context rank {rank} is outside 0..{context - 1}")
    chunk = seq_len // (2 * context)
    head, tail = rank * chunk, (2 * context - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


def gathered_indices(seq_len: int, context: int) -> torch.Tensor:
    """int64 [seq_len]: the row position of each token of an all-gather over the group (rank order)."""
    return torch.cat([head_tail_indices(seq_len, context, r) for r in range(context)])


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: each token's document number within its row (padding is a document of its own), counted
    from where position_ids restart at 0, as the packer lays rows out (train/data.py build_batch)."""
    return document_starts(position_ids).long().cumsum(-1)


def shard_rows(tensors: dict[str, torch.Tensor], context: int, rank: int) -> dict[str, torch.Tensor]:
    """Context rank `rank`'s share of a micro-batch's full rows {"input_ids", "labels", "position_ids"} [B, S].

    Returns input_ids, position_ids and targets [B, S/C] (targets already shifted on the full row: the label each
    local position predicts, IGNORE where none), query_index [S/C] (their row positions), key_index [S] (the row
    positions of the group's all-gathered tokens) and doc_ids [B, S] (every row token's document).
    """
    seq_len = tensors["input_ids"].shape[-1]
    device = tensors["input_ids"].device
    local = head_tail_indices(seq_len, context, rank).to(device)
    return {
        "input_ids": tensors["input_ids"][:, local],
        "position_ids": tensors["position_ids"][:, local],
        "targets": shifted_targets(tensors["labels"])[:, local],
        "query_index": local,
        "key_index": gathered_indices(seq_len, context).to(device),
        "doc_ids": document_ids(tensors["position_ids"]),
    }


@dataclass
class ContextAttention:
    """One micro-batch's context for the attention function: the group its keys and values are gathered over
    (None: a group of one) and the global layout of queries and keys. Masks are built on first use and shared by
    every layer with the same sliding window (one per micro-batch, not one per layer)."""

    group: dist.ProcessGroup | None
    query_index: torch.Tensor  # [s]
    key_index: torch.Tensor  # [S]
    doc_ids: torch.Tensor  # [B, S]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """bool [B, 1, s, S], True where a query attends a key: same document, key not later, and (sliding layers)
        fewer than `sliding_window` positions back, as transformers' sliding_window_overlay counts."""
        if sliding_window not in self.masks:
            self.masks[sliding_window] = document_causal_mask(
                self.query_index, self.key_index, self.doc_ids, sliding_window
            )
        return self.masks[sliding_window]


def document_causal_mask(
    query_index: torch.Tensor, key_index: torch.Tensor, doc_ids: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    """bool [B, 1, len(query_index), len(key_index)]: query at row position q sees key at k when both are in the
    same document and k <= q (and q - k < sliding_window when given). Within a document row positions differ as
    positions do, so the window is the model's own.

    A document is a contiguous span of its row, so "same document and k <= q" is "the document's first position
    <= k <= q": two comparisons of index vectors straight into bool, 2 bytes per (query, key) pair at the peak
    instead of an int64 distance matrix beside two bool ones (11 bytes: most of a 16k row's memory at C = 1,
    bench/context_memory.py)."""
    lower = document_first_positions(doc_ids)[:, query_index]  # [B, s]
    if sliding_window is not None:
        lower = torch.maximum(lower, query_index - sliding_window + 1)
    keys = key_index.view(1, 1, -1)
    mask = keys >= lower.unsqueeze(-1)
    mask &= keys <= query_index.view(1, -1, 1)
    return mask.unsqueeze(1)


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


def context_sdpa_attention(
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
    groups = query.shape[1] // key.shape[1]  # query heads per key/value head (GQA)
    if groups > 1:  # repeated, as transformers' sdpa path does when a mask is given (GQA kernels want none)
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=ctx.mask(kwargs.get("sliding_window")), dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs) -> None:
    """The mask function registered for CONTEXT_ATTENTION: no mask from transformers (it only sees this rank's
    slice of the row); context_sdpa_attention builds the row's own."""
    return None


def register_context_attention() -> None:
    """Register the attention and mask functions under CONTEXT_ATTENTION (idempotent; class-wide registries)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(CONTEXT_ATTENTION, context_sdpa_attention)
    AttentionMaskInterface.register(CONTEXT_ATTENTION, no_mask)


def use_context_attention(model) -> None:
    """Switch `model` (a transformers PreTrainedModel) to context-parallel attention."""
    register_context_attention()
    model.set_attn_implementation(CONTEXT_ATTENTION)


def context_loss_sum(model, shard: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """fp32 scalar: the summed next-token cross-entropy of one context shard (shard_rows) through the model's own
    forward and logits; the sum over the group's ranks is the rows' loss_sum."""
    if model.config._attn_implementation != CONTEXT_ATTENTION:
        raise InputError(
            f"parallel.context: the model runs {model.config._attn_implementation!r} attention, which would keep each "
            f"rank's tokens to themselves; switch it with use_context_attention"
        )
    ctx = ContextAttention(group, shard["query_index"], shard["key_index"], shard["doc_ids"])
    logits = model(
        input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False, **{CONTEXT_KWARG: ctx}
    ).logits
    return F.cross_entropy(
        logits.flatten(0, 1).float(), shard["targets"].flatten(), ignore_index=IGNORE, reduction="sum"
    )

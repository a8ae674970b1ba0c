"""The validation pass: every held-out document exactly once, the same micro-batch count on every rank.

A validation pass is a forward pass only, but under FSDP2 every micro-batch still all-gathers every
layer, so ranks with different counts hang exactly as in training. The held-out documents are packed
by the same best-fit-decreasing packer and made a multiple of world_size x eval_micro_batch_size by the
same `rebin`; where there are too few documents to split (fewer documents than packs needed, e.g. fewer
than ranks), the missing packs are empty: padding rows that carry no loss token, so the loss, a sum over
tokens divided by the all-reduced token count, is exact and independent of the world size. Nothing is
duplicated (the DistributedSampler answer, which skews the metric) or dropped (equalize-to-minimum).

eval_packs.parquet has packs.parquet's columns: epoch 0, step 0, `micro` the micro-batch index within
the pass. The same pass runs at every evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wattgate.errors import InputError
from wattgate.pack.assign import Layout, Placement, assign_ranks, pack_costs, rank_cost_ratios
from wattgate.pack.bfd import pack_bfd
from wattgate.pack.remainder import Packs, one_per_pack, pad_with_empty, rebin
from wattgate.records.plan import ValidationPass
from wattgate.run_files import EVAL_PACKS


@dataclass(frozen=True)
class ValidationPlan:
    packs: Packs  # doc ids are the manifest's; empty packs are padding
    placement: Placement
    tokens: np.ndarray  # per pack
    stats: ValidationPass  # plan.json's `validation` (packs_sha256 set on publish)


def balanced_packs(
    held_out: np.ndarray, lengths: np.ndarray, seq_len: int, multiple: int, one_document_rows: bool = False
) -> tuple[Packs, str]:
    """The held-out documents in a multiple of `multiple` packs: rebin when they can be split, else padding
    (always with `one_document_rows`).

    Packed over the held-out documents' own lengths (indices 0..k-1, mapped back to doc ids at the end), so
    the cost follows the split's size, not the corpus's."""
    local = lengths[held_out]
    if one_document_rows:
        single = one_per_pack(len(held_out))
        packs = pad_with_empty(single, (-len(single)) % multiple)
        return Packs(docs=held_out[packs.docs], offsets=packs.offsets), "one document per pack+empty packs"
    packs = Packs.from_assignment(pack_bfd(local, seq_len))
    need = (-len(packs)) % multiple
    strategy = "bfd"
    if need and len(held_out) >= len(packs) + need:
        try:
            packs, strategy = rebin(packs, local, multiple), "bfd+rebin"
        except InputError:  # too few packs with more than one document to split: pad instead
            need = -1
    if need and strategy == "bfd":
        # scarce documents: one pack each (the most ranks do real work), the rest padding
        single = one_per_pack(len(held_out))
        packs, strategy = pad_with_empty(single, (-len(single)) % multiple), "one document per pack+empty packs"
    return Packs(docs=held_out[packs.docs], offsets=packs.offsets), strategy


def plan_validation(
    held_out: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    attn_weight: float,
    one_document_rows: bool = False,
) -> ValidationPlan:
    """Pack and place the validation pass (one 'epoch', one 'step', micro = the micro-batch index)."""
    layout = Layout(world_size, micro_batch_size, 1, one_document_rows)
    packs, strategy = balanced_packs(held_out, lengths, seq_len, layout.packs_per_micro, layout.one_document_rows)
    doc_len = lengths[packs.docs].astype(np.float64)  # the held-out documents' only: not the corpus's
    tokens = np.rint(np.bincount(packs.pack_of_doc(), weights=doc_len, minlength=len(packs))).astype(np.int64)
    sum_sq = np.bincount(packs.pack_of_doc(), weights=doc_len**2, minlength=len(packs))
    costs = pack_costs(tokens, sum_sq, attn_weight)
    placed = assign_ranks(costs, layout, 1, seed)
    # one pass = one step: assign_ranks numbers micro-batches as steps when grad_accum is 1
    placement = Placement(placed.pack, placed.epoch, np.zeros_like(placed.step), placed.step, placed.rank, placed.slot)
    empty = int((packs.sizes == 0).sum())
    per_rank_tokens = np.bincount(placement.rank, weights=tokens[placement.pack], minlength=world_size)
    stats = ValidationPass(
        packs=EVAL_PACKS,
        packs_sha256=None,
        num_docs=len(held_out),
        num_tokens=int(tokens.sum()),
        num_packs=len(packs),
        empty_packs=empty,
        strategy=strategy,
        micro_batch_size=micro_batch_size,
        micro_batches_per_rank=len(packs) // layout.packs_per_micro,
        per_rank_tokens=tuple(per_rank_tokens.astype(np.int64).tolist()),
        efficiency=float(tokens.sum() / max(1, len(packs) * seq_len)),
        # in `placed` each micro-batch is its own step: its per-step ratio is the per-micro-batch one
        max_rank_cost_ratio_micro=rank_cost_ratios(placed, costs, world_size).max_step,
    )
    return ValidationPlan(packs, placement, tokens, stats)

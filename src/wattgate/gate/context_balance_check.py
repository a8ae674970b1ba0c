"""The context_balance check (parallel.context C > 1): how evenly the plan's rows load the ranks of a context
group with attention.

A context group runs each micro-batch together (every attention layer all-gathers its keys and values), so each
micro-batch takes as long as its busiest context rank. Everything but attention is per token, and every rank holds
seq_len / C of each row, so attention decides. What a rank's attention costs depends on the kernel:
- sdpa with a boolean mask (the context kernel on CPU) computes its whole block, seq_len / C x seq_len pairs per row
  on every rank: balanced by construction;
- flex attention (the kernel on GPUs, context_layout.planned_context_kernel) skips masked blocks, so it pays the
  causal within-document pairs its queries attend: for a query at position p of a document starting at o, the
  p - o + 1 keys of the same document up to it, summed over the positions the rank holds. Each row is split so as to
  even these out (context_layout.py: head-tail, or per row the deal of its chunks that lowers the busiest rank's
  pairs); the padding at a row's end is a document of its own, as the trainer's mask has it.
The check holds the running kernel's cost to the bound and names the other figure, so a plan that flex would load
unevenly is seen on a CPU run too.

The figure is the plan's sum over micro-batches of the busiest context rank's cost over the sum of the mean
rank's: the time the groups' attention takes over what a perfect split of the same pairs would take.
"""

from __future__ import annotations

import numpy as np

from wattgate import context_layout as layout
from wattgate.gate.checks import Check
from wattgate.run_files import PackRows


def context_rank_costs(packs: PackRows, seq_len: int, context: int) -> np.ndarray:
    """int64 [rows, C]: each row's causal within-document attention pairs on each context rank, under the split the
    trainer makes of it (context_layout.py)."""
    costs, chunks = layout.split_costs(packs.doc_lengths, packs.length_offsets, seq_len, context)
    return layout.rank_loads(costs, chunks)


def cost_ratio(packs: PackRows, costs: np.ndarray, context: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(the plan's sum over micro-batches of the busiest context rank's cost over the mean rank's, each micro-batch's
    ratio, the micro-batches' keys [epoch, step, rank, micro]) of per-row per-context-rank `costs`."""
    keys = np.stack([packs.epoch, packs.step, packs.rank, packs.micro], axis=1)
    micro_keys, micro_of_row = np.unique(keys, axis=0, return_inverse=True)
    per_micro = np.zeros((len(micro_keys), context), dtype=np.float64)
    np.add.at(per_micro, micro_of_row.reshape(-1), costs)
    busiest, mean = per_micro.max(axis=1), per_micro.mean(axis=1)
    return float(busiest.sum() / max(mean.sum(), 1e-9)), busiest / np.maximum(mean, 1e-9), micro_keys


def check_context_balance(
    packs: PackRows, seq_len: int, context: int, max_ratio: float, skips_masked_pairs: bool
) -> Check:
    """The busiest context rank's attention cost over the mean's, for the kernel that runs (`skips_masked_pairs`:
    flex, which skips the pairs its mask removes), within gate.max_context_cost_ratio; the detail names the
    document-aware figure and its worst micro-batch either way."""
    name = "context_balance"
    if len(packs) == 0:
        return Check(name, False, "no packs (see equal_steps)")
    aware, each, micro_keys = cost_ratio(packs, context_rank_costs(packs, seq_len, context), context)
    w = int(np.argmax(each))
    e, s, r, m = (int(x) for x in micro_keys[w])
    n = layout.chunk_count(seq_len, context)
    split = f"C = {context}, each row in {n} chunks of {seq_len // n} tokens, split per row (context_layout.py)"
    skipping = f"{aware:.3f}, worst micro-batch {each[w]:.3f} (epoch {e} step {s} data rank {r} micro {m})"
    limit = f"limit {max_ratio:.3f} (gate.max_context_cost_ratio)"
    if skips_masked_pairs:
        detail = f"max/mean context-rank attention cost over the plan's micro-batches: {skipping} ({split}); {limit}"
        return Check(name, aware <= max_ratio, detail)
    dense = np.full((len(packs), context), seq_len // context * seq_len, dtype=np.int64)  # every pair of the block
    ratio, _, _ = cost_ratio(packs, dense, context)
    detail = (
        f"max/mean context-rank attention cost over the plan's micro-batches: {ratio:.3f} ({split}; the sdpa "
        f"context kernel computes every (query, key) pair of each rank's seq_len/C x seq_len block); flex attention, "
        f"skipping masked pairs, would see {skipping}; {limit}"
    )
    return Check(name, ratio <= max_ratio, detail)

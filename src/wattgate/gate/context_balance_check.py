"""The context_balance check (parallel.context C > 1): how evenly the plan's rows load the ranks of a context
group with attention.

A context group runs each micro-batch together (every attention layer all-gathers its keys and values), so each
micro-batch takes as long as its busiest context rank. Everything but attention is per token, and every rank holds
seq_len / C of each row, so attention decides. What a rank's attention costs depends on the kernel:
- a kernel that computes its whole block (torch's scaled_dot_product_attention with a boolean mask, the context
  kernel today: train/context_parallel.py SKIPS_MASKED_PAIRS) pays seq_len / C x seq_len pairs per row on every
  rank: balanced by construction;
- a kernel that skips masked pairs (a block-sparse flex or a varlen flash kernel) pays the causal within-document
  pairs its queries attend: for a query at position p of a document starting at o, the p - o + 1 keys of the same
  document up to it, summed over the positions the rank holds (head-tail: chunks c and 2C-1-c of 2C). Head-tail
  balances a row-long document exactly; rows of shorter documents are balanced by how the documents fall on the
  chunks. Padding attends nothing here (its loss and cost are no one's).
The check holds the running kernel's cost to the bound and names the other, so a plan that a document-skipping
kernel would load unevenly is seen before such a kernel runs it.

The figure is the plan's sum over micro-batches of the busiest context rank's cost over the sum of the mean
rank's: the time the groups' attention takes over what a perfect split of the same pairs would take.
"""

from __future__ import annotations

import numpy as np

from wattgate.gate.checks import Check
from wattgate.run_files import PackRows


def chunk_pairs(starts: np.ndarray, lengths: np.ndarray, a: int, b: int) -> np.ndarray:
    """Per document [start, start + length) of a row: the causal within-document pairs of its queries in [a, b)."""
    lo = np.maximum(starts, a)
    n = np.maximum(np.minimum(starts + lengths, b) - lo, 0)
    return n * (lo - starts + 1) + n * (n - 1) // 2


def context_rank_costs(packs: PackRows, seq_len: int, context: int) -> np.ndarray:
    """int64 [rows, C]: each row's attention pairs on each context rank (module docstring)."""
    lengths = packs.doc_lengths.astype(np.int64)
    row = packs.row_of_doc()
    ends = np.cumsum(lengths)
    row_base = np.concatenate([[0], ends])[packs.length_offsets[:-1]]  # tokens before each row's first document
    starts = ends - lengths - row_base[row]
    chunk = seq_len // (2 * context)
    out = np.zeros((len(packs), context), dtype=np.int64)
    for c in range(context):
        for j in (c, 2 * context - 1 - c):
            pairs = chunk_pairs(starts, lengths, j * chunk, (j + 1) * chunk)
            out[:, c] += np.bincount(row, weights=pairs, minlength=len(packs)).astype(np.int64)
    return out


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
    whether it skips the pairs its mask removes), within gate.max_context_cost_ratio; the detail names the
    document-aware figure and its worst micro-batch either way."""
    name = "context_balance"
    if len(packs) == 0:
        return Check(name, False, "no packs (see equal_steps)")
    aware, each, micro_keys = cost_ratio(packs, context_rank_costs(packs, seq_len, context), context)
    w = int(np.argmax(each))
    e, s, r, m = (int(x) for x in micro_keys[w])
    split = f"C = {context}, head-tail chunks of {seq_len // (2 * context)} tokens"
    skipping = f"{aware:.3f}, worst micro-batch {each[w]:.3f} (epoch {e} step {s} data rank {r} micro {m})"
    limit = f"limit {max_ratio:.3f} (gate.max_context_cost_ratio)"
    if skips_masked_pairs:
        detail = f"max/mean context-rank attention cost over the plan's micro-batches: {skipping} ({split}); {limit}"
        return Check(name, aware <= max_ratio, detail)
    dense = np.full((len(packs), context), seq_len // context * seq_len, dtype=np.int64)  # every pair of the block
    ratio, _, _ = cost_ratio(packs, dense, context)
    detail = (
        f"max/mean context-rank attention cost over the plan's micro-batches: {ratio:.3f} ({split}; the context "
        f"kernel computes every (query, key) pair of each rank's seq_len/C x seq_len block); a kernel skipping "
        f"masked pairs would see {skipping}; {limit}"
    )
    return Check(name, ratio <= max_ratio, detail)

"""The context_balance check (parallel.context C > 1): how evenly the plan's rows load the ranks of a context
group with attention.

A context group runs each micro-batch together (every attention layer all-gathers its keys and values), so each
micro-batch takes as long as its busiest context rank. A rank's attention cost is the (query, key) pairs its
queries attend: for a query at position p of a document starting at o, the p - o + 1 keys of the same document up
to it (train/context_parallel.py), summed over the positions it holds (head-tail: chunks c and 2C-1-c of 2C).
Head-tail balances a row-long document exactly; rows of shorter documents are balanced by how the documents fall
on the chunks, which this measures. Padding attends nothing here (its loss and cost are no one's).

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


def check_context_balance(packs: PackRows, seq_len: int, context: int, max_ratio: float) -> Check:
    """The plan's busiest-context-rank attention cost over the mean's, within gate.max_context_cost_ratio."""
    name = "context_balance"
    if len(packs) == 0:
        return Check(name, False, "no packs (see equal_steps)")
    keys = np.stack([packs.epoch, packs.step, packs.rank, packs.micro], axis=1)
    micro_keys, micro_of_row = np.unique(keys, axis=0, return_inverse=True)
    per_micro = np.zeros((len(micro_keys), context), dtype=np.float64)
    np.add.at(per_micro, micro_of_row.reshape(-1), context_rank_costs(packs, seq_len, context))
    busiest, mean = per_micro.max(axis=1), per_micro.mean(axis=1)
    ratio = float(busiest.sum() / max(mean.sum(), 1e-9))
    each = busiest / np.maximum(mean, 1e-9)
    w = int(np.argmax(each))
    e, s, r, m = (int(x) for x in micro_keys[w])
    detail = (
        f"max/mean context-rank attention cost over the plan's micro-batches: {ratio:.3f} (C = {context}, "
        f"head-tail chunks of {seq_len // (2 * context)} tokens); worst micro-batch {each[w]:.3f} (epoch {e} step "
        f"{s} data rank {r} micro {m}); limit {max_ratio:.3f} (gate.max_context_cost_ratio)"
    )
    return Check(name, ratio <= max_ratio, detail)

"""Which row positions each rank of a context group holds (parallel.context C): one split per packed row, made from
the row's document lengths alone, so the gate (context_balance) and the trainer work out the same one from the plan.

A row of seq_len tokens is cut into n equal chunks (n = 2C x m, m the most of 4, 2, 1 that leaves chunks of at least
MIN_CHUNK_TOKENS) and every rank holds n / C of them: the same number of tokens, so the same per-token work (MLP,
norms, the loss) and the same tensor shapes on every rank.

Attention is what differs. A kernel that skips the pairs its mask removes (block-sparse flex attention) pays, for a
query at position p of a document starting at o, the p - o + 1 keys of its document up to it. Head-tail (rank r holds
chunks r and 2C-1-r of each run of 2C) gives every rank the same pairs on a row-long document, but a row of several
documents can load one rank more than another. So each row's chunks are also dealt out largest first, each to the
least loaded rank with room left, and that deal replaces head-tail on the rows where it lowers the busiest rank's
pairs. Padding at the row's end is a document of its own, as the trainer's mask treats it (train/data.py).

Positions are returned in row order within each rank: chunk after chunk, ascending.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_CHUNK_TOKENS = 128  # a flex attention block: smaller chunks split its blocks between ranks
CHUNKS_PER_HALF = (4, 2, 1)  # m, most first: chunks per rank are 2m


def chunk_count(seq_len: int, context: int) -> int:
    """n: the chunks a row is cut into (2C x m, seq_len divisible by it; config validation holds seq_len % 2C)."""
    for m in CHUNKS_PER_HALF:
        n = 2 * context * m
        if seq_len % n == 0 and (seq_len // n >= MIN_CHUNK_TOKENS or m == 1):
            return n
    return 2 * context


def row_documents(lengths: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start in its row, length, row) of every document of rows whose document lengths are lengths[offsets[i] :
    offsets[i + 1]], with each row's padding (seq_len minus its tokens, when > 0) as one more document at its end."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    rows = len(offsets) - 1
    row = np.repeat(np.arange(rows), np.diff(offsets))
    ends = np.cumsum(lengths)
    before = np.concatenate([[0], ends])[offsets[:-1]]  # tokens before each row's first document
    starts = ends - lengths - before[row]
    used = np.concatenate([[0], ends])[offsets[1:]] - before
    pad = np.flatnonzero(used < seq_len)
    return (
        np.concatenate([starts, used[pad]]),
        np.concatenate([lengths, seq_len - used[pad]]),
        np.concatenate([row, pad]),
    )


def chunk_pairs(starts: np.ndarray, lengths: np.ndarray, a: int, b: int) -> np.ndarray:
    """Per document [start, start + length) of a row: the causal within-document pairs of its queries in [a, b)."""
    lo = np.maximum(starts, a)
    n = np.maximum(np.minimum(starts + lengths, b) - lo, 0)
    return n * (lo - starts + 1) + n * (n - 1) // 2


def chunk_costs(documents: tuple[np.ndarray, np.ndarray, np.ndarray], rows: int, seq_len: int, n: int) -> np.ndarray:
    """int64 [rows, n]: the causal within-document (query, key) pairs of each chunk's queries."""
    starts, lengths, row = documents
    size = seq_len // n
    out = np.zeros((rows, n), dtype=np.int64)
    for j in range(n):
        pairs = chunk_pairs(starts, lengths, j * size, (j + 1) * size)
        # float64 sums of integers are exact below 2^53: a 1M-token row has 5e11 pairs
        out[:, j] = np.bincount(row, weights=pairs, minlength=rows).astype(np.int64)
    return out


def head_tail(rows: int, context: int, n: int) -> np.ndarray:
    """int64 [rows, C, n/C]: rank r holds chunks r and 2C-1-r of each run of 2C chunks."""
    runs = np.arange(0, n, 2 * context)
    ranks = np.arange(context)[:, None]
    held = np.concatenate([ranks + runs, 2 * context - 1 - ranks + runs], axis=1)
    return np.broadcast_to(np.sort(held, axis=1), (rows, context, n // context)).copy()


def dealt(costs: np.ndarray, context: int) -> np.ndarray:
    """int64 [rows, C, n/C]: each row's chunks largest first, each to the least loaded rank with room (the lower
    rank on a tie), each rank's chunks ascending."""
    rows, n = costs.shape
    per_rank = n // context
    order = np.argsort(-costs, axis=1, kind="stable")
    loads = np.zeros((rows, context), dtype=np.int64)
    held = np.zeros((rows, context), dtype=np.int64)
    out = np.zeros((rows, context, per_rank), dtype=np.int64)
    at = np.arange(rows)
    for i in range(n):
        chunk = order[:, i]
        room = np.where(held < per_rank, loads, np.iinfo(np.int64).max)
        rank = np.argmin(room, axis=1)
        out[at, rank, held[at, rank]] = chunk
        loads[at, rank] += costs[at, chunk]
        held[at, rank] += 1
    return np.sort(out, axis=2)


def rank_loads(costs: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """int64 [rows, C]: each rank's pairs under the split `chunks` [rows, C, n/C]."""
    return np.take_along_axis(costs, chunks.reshape(len(costs), -1), axis=1).reshape(chunks.shape).sum(axis=2)


def split_chunks(costs: np.ndarray, context: int) -> np.ndarray:
    """int64 [rows, C, n/C]: per row the deal where it lowers the busiest rank's pairs, else head-tail."""
    rows, n = costs.shape
    base = head_tail(rows, context, n)
    if context == 1:
        return base
    deal = dealt(costs, context)
    better = rank_loads(costs, deal).max(axis=1) < rank_loads(costs, base).max(axis=1)
    base[better] = deal[better]
    return base


def positions_of(chunks: np.ndarray, seq_len: int) -> np.ndarray:
    """int64 [rows, C, seq_len/C]: the row positions of the chunks each rank holds, ascending."""
    size = seq_len // (chunks.shape[1] * chunks.shape[2])
    return (chunks[..., None] * size + np.arange(size)).reshape(*chunks.shape[:2], -1)


def split_costs(lengths: np.ndarray, offsets: np.ndarray, seq_len: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(each chunk's pairs [rows, n], the split [rows, C, n/C]) of rows whose document lengths are
    lengths[offsets[i] : offsets[i + 1]] (padding not included): what the gate and the trainer both work out."""
    n = chunk_count(seq_len, context)
    costs = chunk_costs(row_documents(lengths, offsets, seq_len), len(offsets) - 1, seq_len, n)
    return costs, split_chunks(costs, context)


def split_rows(lengths: Sequence, seq_len: int, context: int) -> np.ndarray:
    """int64 [rows, C, seq_len/C]: the positions each context rank holds of rows whose documents have `lengths`
    (one sequence of document lengths per row, padding not included)."""
    sizes = [np.asarray(x, dtype=np.int64) for x in lengths]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in sizes])]).astype(np.int64)
    flat = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    return positions_of(split_costs(flat, offsets, seq_len, context)[1], seq_len)


def document_lengths(position_ids: np.ndarray) -> list[np.ndarray]:
    """Per row, the lengths of its documents and padding block, from position_ids that restart at 0 at each."""
    out = []
    for row in np.asarray(position_ids):
        starts = np.flatnonzero(row == 0)
        starts = starts if len(starts) and starts[0] == 0 else np.r_[0, starts]
        out.append(np.diff(np.r_[starts, len(row)]))
    return out


def planned_context_kernel(attn_implementation: str, on_gpu: bool) -> str:
    """The kernel a run's context attention will use, from its config alone (the gate's view): flex attention,
    which skips whole blocks of masked pairs, when train.attn_implementation asks for it or is auto on GPUs; else
    sdpa, which computes every pair of a rank's block. The trainer falls back to sdpa where flex cannot train (no
    triton): that kernel is balanced by construction, so the gate holding flex's figure is the stricter check."""
    return "flex" if attn_implementation == "flex_attention" or (on_gpu and attn_implementation == "auto") else "sdpa"

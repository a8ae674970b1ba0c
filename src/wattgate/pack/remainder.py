"""Remainder policies: make the pack count a multiple of world_size * micro_batch_size * grad_accum.

- `rebin` moves documents into new packs until the count divides evenly; no
  document is lost. New packs are filled towards the mean pack size from the
  smallest movable document of many different packs, so no pack becomes a
  light outlier that would leave its rank idle at the next collective.
- `drop` is the documented PyTorch baseline (equalize to the minimum): the
  lightest packs beyond the last full global batch are dropped and listed.
- `none` packs each rank's share of documents separately, leaving ranks with
  different numbers of micro-batches: the negative control for the gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from wattgate.errors import InputError
from wattgate.pack.bfd import group_by_pack, pack_bfd


@dataclass
class Packs:
    """Packs as lists of document indices (into the manifest's doc order)."""

    docs: list[np.ndarray]
    dropped_docs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # only for `none`: the rank that owns each pack
    rank_of_pack: np.ndarray | None = None


def packs_from_assignment(pack_of_doc: np.ndarray) -> list[np.ndarray]:
    docs, offsets = group_by_pack(pack_of_doc)
    return [docs[offsets[p] : offsets[p + 1]] for p in range(len(offsets) - 1)]


def rebin(packs: list[np.ndarray], lengths: np.ndarray, multiple: int) -> list[np.ndarray]:
    """Add packs, made of documents moved out of existing ones, until len(packs) % multiple == 0.

    The new packs, and any pack left light by packing (BFD's last bins), are
    topped up towards the mean pack size with the smallest document of many
    different full packs; a move is made only if the donor stays at least as
    heavy as the receiver, so every move narrows the spread.
    """
    need = (-len(packs)) % multiple
    n_docs = sum(len(p) for p in packs)
    if n_docs < len(packs) + need:
        raise InputError(
            f"pack: {n_docs} documents cannot fill {len(packs) + need} packs (a multiple of "
            f"world_size x micro_batch_size x grad_accum = {multiple}); use a smaller world or batch, "
            "more data, or pack.remainder: drop"
        )
    docs = [list(map(int, p)) for p in packs] + [[] for _ in range(need)]
    tokens = [int(lengths[p].sum()) for p in packs] + [0] * need
    target = sum(tokens) / len(docs)
    receivers = [i for i, t in enumerate(tokens) if t < target]
    is_receiver = set(receivers)
    donors = [i for i in range(len(docs)) if i not in is_receiver]
    while receivers:
        empty = any(not docs[j] for j in receivers)
        offers = []
        for i in donors:
            if len(docs[i]) > 1:
                k = min(range(len(docs[i])), key=lambda k: (lengths[docs[i][k]], k))
                offers.append((int(lengths[docs[i][k]]), i, k))
        offers.sort()
        moved = False
        for length, i, k in offers:
            j = min(receivers, key=lambda j: (tokens[j], j))
            if docs[j] and tokens[j] + length > target:
                break  # offers ascend: none of the rest fits the lightest receiver either
            if docs[j] and tokens[i] - length < tokens[j] + length:
                continue  # the move would leave the donor lighter than the receiver
            docs[j].append(docs[i].pop(k))
            tokens[j] += length
            tokens[i] -= length
            moved = True
        if not moved or (not empty and min(tokens[j] for j in receivers) >= target):
            break
    if any(not docs[j] for j in receivers):
        raise InputError(
            f"pack: could not move a document into each of {need} new packs (every pack holds one "
            "document); use pack.remainder: drop or a smaller world or batch"
        )
    return [np.asarray(sorted(p) if i >= len(packs) else p, dtype=np.int64) for i, p in enumerate(docs)]


def drop_remainder(packs: list[np.ndarray], lengths: np.ndarray, multiple: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Keep the largest multiple of `multiple` packs; drop the lightest ones. Returns (kept, dropped docs)."""
    excess = len(packs) % multiple
    if len(packs) < multiple:
        raise InputError(
            f"pack: only {len(packs)} packs, fewer than one global batch of {multiple}; "
            "pack.remainder: drop would drop everything (use rebin)"
        )
    if excess == 0:
        return packs, np.zeros(0, dtype=np.int64)
    tokens = np.array([int(lengths[p].sum()) for p in packs])
    lightest = set(np.argsort(tokens, kind="stable")[:excess].tolist())
    kept = [p for i, p in enumerate(packs) if i not in lightest]
    dropped = np.sort(np.concatenate([packs[i] for i in sorted(lightest)]))
    return kept, dropped


def pack_per_rank(lengths: np.ndarray, seq_len: int, world_size: int) -> Packs:
    """Naive baseline: documents dealt round-robin to ranks, each rank packs its own (uneven counts)."""
    docs: list[np.ndarray] = []
    owners: list[int] = []
    for rank in range(world_size):
        mine = np.arange(rank, len(lengths), world_size)
        if len(mine) == 0:
            continue
        for p in packs_from_assignment(pack_bfd(lengths[mine], seq_len)):
            docs.append(mine[p])
            owners.append(rank)
    return Packs(docs=docs, rank_of_pack=np.asarray(owners, dtype=np.int64))


def apply_remainder(lengths: np.ndarray, seq_len: int, policy: str, world_size: int, multiple: int) -> Packs:
    if policy == "none":
        return pack_per_rank(lengths, seq_len, world_size)
    packs = packs_from_assignment(pack_bfd(lengths, seq_len))
    if policy == "rebin":
        return Packs(docs=rebin(packs, lengths, multiple))
    kept, dropped = drop_remainder(packs, lengths, multiple)
    return Packs(docs=kept, dropped_docs=dropped)

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

import heapq
from dataclasses import dataclass, field

import numpy as np

from wattgate.errors import InputError
from wattgate.pack.bfd import group_by_pack, pack_bfd

# The reasons a plan may list in stats.dropped, and the policies that may drop at all: only `drop`,
# and only the lightest packs beyond the last full global batch (fewer than one global batch of packs,
# each no heavier than any kept pack). `rebin` and `none` keep every document. The gate enforces this.
DROP_REASON_REMAINDER = "remainder"
DROP_REASONS = frozenset({DROP_REASON_REMAINDER})
DROPPING_POLICIES = frozenset({"drop"})


@dataclass
class Packs:
    """Packs in CSR form: pack p holds the documents docs[offsets[p]:offsets[p + 1]] (manifest doc ids)."""

    docs: np.ndarray
    offsets: np.ndarray
    dropped_docs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # only for `none`: the rank that owns each pack
    rank_of_pack: np.ndarray | None = None

    @classmethod
    def from_assignment(cls, pack_of_doc: np.ndarray, doc_ids: np.ndarray | None = None) -> Packs:
        order, offsets = group_by_pack(pack_of_doc)
        return cls(docs=order if doc_ids is None else doc_ids[order], offsets=offsets)

    @classmethod
    def from_pack_ids(cls, pack_of_doc: np.ndarray, docs: np.ndarray, n_packs: int) -> Packs:
        order = np.argsort(pack_of_doc, kind="stable")
        offsets = np.zeros(n_packs + 1, dtype=np.int64)
        np.cumsum(np.bincount(pack_of_doc, minlength=n_packs), out=offsets[1:])
        return cls(docs=docs[order].astype(np.int64), offsets=offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def members(self, p: int) -> np.ndarray:
        return self.docs[self.offsets[p] : self.offsets[p + 1]]

    def pack_of_doc(self) -> np.ndarray:
        """The pack of each entry of `docs`."""
        return np.repeat(np.arange(len(self)), self.sizes)

    def sum_per_pack(self, per_doc: np.ndarray) -> np.ndarray:
        """Sum of a per-document quantity (e.g. lengths) over each pack."""
        sums = np.bincount(self.pack_of_doc(), weights=per_doc[self.docs], minlength=len(self))
        return np.rint(sums).astype(np.int64)


# Relative floors a donor pack may be lowered to, tried in turn until every
# receiver is filled: most corpora settle at the first (packs within 2%).
DONOR_FLOORS = (0.98, 0.95, 0.90, 0.75, 0.5, 0.0)


def rebin(packs: Packs, lengths: np.ndarray, multiple: int, at_least: int = 0) -> Packs:
    """Add packs, made of documents moved out of existing ones, until len(packs) % multiple == 0.

    The new packs, and any pack left light by packing (BFD's last bins), are
    topped up towards the mean pack size with the smallest documents of full
    packs. A donor gives only while it stays above a floor near the mean (and
    at least as heavy as the receiver), so no pack ends up a light outlier
    whose rank would idle at the next collective; the floor is lowered only if
    the receivers cannot otherwise be filled. Offers and receivers sit in
    heaps: O(moves x log packs).
    """
    n_packs = len(packs)
    # `at_least` (a multiple of `multiple`): a mixture's epochs all get the same pack count (pack/plan.py)
    need = max((-n_packs) % multiple, at_least - n_packs)
    if len(packs.docs) < n_packs + need:
        raise InputError(
            f"pack: {len(packs.docs)} documents cannot fill {n_packs + need} packs (a multiple of "
            f"world_size x micro_batch_size x grad_accum = {multiple}); use a smaller world or batch, "
            "more data, or pack.remainder: drop"
        )
    pack_of = packs.pack_of_doc()
    order = np.lexsort((packs.docs, lengths[packs.docs], pack_of))  # per pack, smallest document first
    docs, pack_of = packs.docs[order], pack_of[order]
    state = _Donors(docs.tolist(), packs.offsets.tolist(), lengths.tolist(), need)
    tokens = packs.sum_per_pack(lengths).tolist() + [0] * need
    target = sum(tokens) / len(tokens)
    received: dict[int, list[int]] = {j: [] for j in range(len(tokens)) if tokens[j] < target}
    for floor in (f * target for f in DONOR_FLOORS if received):
        _fill_receivers(state, tokens, received, target, floor)
        if all(received[j] or j < n_packs for j in received) and min(tokens[j] for j in received) >= floor:
            break
    kept = np.ones(len(docs), dtype=bool)
    for i, g in enumerate(state.given):
        if g:
            kept[state.starts[i] : state.starts[i] + g] = False
    moved = [(j, d) for j, ds in received.items() for d in ds]
    to_pack = np.concatenate([pack_of[kept], np.array([j for j, _ in moved], dtype=np.int64)])
    to_doc = np.concatenate([docs[kept], np.array([d for _, d in moved], dtype=np.int64)])
    _fill_empty(to_pack, to_doc, lengths, n_packs + need)
    out = Packs.from_pack_ids(to_pack, to_doc, n_packs + need)
    if (out.sizes == 0).any():
        raise InputError(
            f"pack: could not move a document into each of {need} new packs (too few packs hold more "
            "than one document); use pack.remainder: drop or a smaller world or batch"
        )
    return out


def _fill_empty(to_pack: np.ndarray, to_doc: np.ndarray, lengths: np.ndarray, n: int) -> None:
    """In place: a pack the balancing left empty (documents were scarce: light packs took them first) gets the
    smallest document of the pack holding the most, so every pack holds one while there are enough."""
    counts = np.bincount(to_pack, minlength=n)
    for j in np.flatnonzero(counts == 0):
        donor = int(np.argmax(counts))
        if counts[donor] < 2:
            return  # fewer documents than packs: the caller says so
        entries = np.flatnonzero(to_pack == donor)
        k = entries[np.argmin(lengths[to_doc[entries]])]
        to_pack[k] = j
        counts[donor] -= 1
        counts[j] = 1


class _Donors:
    """Each existing pack's documents, smallest first, and how many it has given away."""

    def __init__(self, docs: list[int], offsets: list[int], size: list[int], extra: int):
        self.docs, self.size = docs, size
        self.starts = offsets[:-1] + [offsets[-1]] * extra
        self.ends = offsets[1:] + [offsets[-1]] * extra
        self.given = [0] * len(self.starts)


def _fill_receivers(donors: _Donors, tokens: list[int], received: dict, target: float, floor: float) -> None:
    """One pass of moves, smallest offered document first, to the lightest receiver. (The donors' lists are
    read inline: this loop is most of a small plan's time.)"""
    size, docs, starts, ends, given = donors.size, donors.docs, donors.starts, donors.ends, donors.given
    receivers = [(tokens[j], j) for j in received]
    # a donor offers its smallest document while it keeps another and stays at or above the floor without it
    offers = [
        (length, i)
        for i in range(len(tokens))
        if ends[i] - starts[i] - given[i] > 1
        and tokens[i] - (length := size[docs[starts[i] + given[i]]]) >= floor
        and i not in received
    ]
    heapq.heapify(receivers)
    heapq.heapify(offers)
    while offers:
        length, i = heapq.heappop(offers)
        fill, j = receivers[0]
        holds = fill > 0 or bool(received[j])  # an empty new pack takes any document
        if holds and fill + length > target:
            return  # offers ascend: none of the rest fits the lightest receiver either
        if holds and tokens[i] - length < fill + length:
            continue  # this donor's later offers are larger still: it is done giving
        at = starts[i] + given[i]
        received[j].append(docs[at])
        given[i] += 1
        tokens[i] -= length
        tokens[j] = fill + length
        heapq.heapreplace(receivers, (tokens[j], j))
        if ends[i] - at > 2 and tokens[i] - size[docs[at + 1]] >= floor:  # it offers its next
            heapq.heappush(offers, (size[docs[at + 1]], i))


def pad_with_empty(packs: Packs, count: int) -> Packs:
    """`count` more packs that hold no document (padding rows, no loss tokens)."""
    offsets = np.concatenate([packs.offsets, np.full(count, packs.offsets[-1], dtype=np.int64)])
    return Packs(docs=packs.docs, offsets=offsets, dropped_docs=packs.dropped_docs)


def one_per_pack(count: int) -> Packs:
    """Documents 0..count-1, each in a pack of its own."""
    return Packs.from_assignment(np.arange(count, dtype=np.int64))


def drop_remainder(packs: Packs, lengths: np.ndarray, multiple: int) -> Packs:
    """Keep the largest multiple of `multiple` packs; drop the lightest ones (listed in dropped_docs)."""
    if len(packs) < multiple:
        raise InputError(
            f"pack: only {len(packs)} packs, fewer than one global batch of {multiple}; "
            "pack.remainder: drop would drop everything (use rebin)"
        )
    excess = len(packs) % multiple
    keep = np.ones(len(packs), dtype=bool)
    keep[np.argsort(packs.sum_per_pack(lengths), kind="stable")[:excess]] = False
    pack_of = packs.pack_of_doc()
    kept_doc = keep[pack_of]
    renumber = np.cumsum(keep) - 1
    out = Packs.from_pack_ids(renumber[pack_of[kept_doc]], packs.docs[kept_doc], int(keep.sum()))
    out.dropped_docs = np.sort(packs.docs[~kept_doc])
    return out


def pack_per_rank(lengths: np.ndarray, seq_len: int, world_size: int, one_document_rows: bool = False) -> Packs:
    """Naive baseline: documents dealt round-robin to ranks, each rank packs its own (uneven counts)."""
    pack_ids, docs, owners, n_packs = [], [], [], 0
    for rank in range(world_size):
        mine = np.arange(rank, len(lengths), world_size)
        if len(mine) == 0:
            continue
        local = np.arange(len(mine), dtype=np.int64) if one_document_rows else pack_bfd(lengths[mine], seq_len)
        pack_ids.append(local + n_packs)
        docs.append(mine)
        count = int(local.max()) + 1
        owners.append(np.full(count, rank))
        n_packs += count
    out = Packs.from_pack_ids(np.concatenate(pack_ids), np.concatenate(docs), n_packs)
    out.rank_of_pack = np.concatenate(owners).astype(np.int64)
    return out


def apply_remainder(
    lengths: np.ndarray, seq_len: int, policy: str, world_size: int, multiple: int, one_document_rows: bool = False
) -> Packs:
    """The documents in packs, their count a multiple of `multiple` as `policy` makes it. `one_document_rows`: each
    pack one document; `rebin` cannot split such packs, so padding packs (no document) make up the count."""
    if policy == "none":
        return pack_per_rank(lengths, seq_len, world_size, one_document_rows)
    if one_document_rows:
        single = one_per_pack(len(lengths))
        if policy == "rebin":
            return pad_with_empty(single, (-len(single)) % multiple)
        return drop_remainder(single, lengths, multiple)
    packs = Packs.from_assignment(pack_bfd(lengths, seq_len))
    if policy == "rebin":
        return rebin(packs, lengths, multiple)
    return drop_remainder(packs, lengths, multiple)

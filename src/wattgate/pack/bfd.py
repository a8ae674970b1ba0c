"""Exact best-fit-decreasing bin packing over integer lengths, vectorized by length class.

Classic BFD places each item, largest first, into the open bin with the least
remaining room that still fits it, opening a new bin when none does. Done one
item at a time in Python that is ~10 us per document. Here all items of one
length L are placed together: the candidate bins are those with remaining room
r >= L, visited in increasing r (best fit first). A bin at r takes r // L items
in a row — after each it is still the best fit, since nothing lies in [L, r) —
and drops to r % L < L, out of this class's reach. So one class costs one scan
of the room histogram plus one step per bucket it uses, and the result is the
same packing item-by-item BFD gives (ties broken by bin age).
"""

from __future__ import annotations

import bisect

import numpy as np


def pack_bfd(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Pack id of every document (ids dense from 0, in the order packs were opened)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if lengths.min() < 1 or lengths.max() > capacity:
        raise ValueError(f"document lengths must lie in [1, {capacity}], got [{lengths.min()}, {lengths.max()}]")

    order = np.argsort(-lengths, kind="stable")
    sorted_len = lengths[order]
    bounds = np.flatnonzero(np.diff(sorted_len)) + 1
    starts = np.concatenate(([0], bounds)).tolist()
    ends = np.concatenate((bounds, [n])).tolist()

    # bin ids by remaining room, only for the rooms some bin has: memory follows the bins, not the capacity
    # (a seq_len of 1e9 must not allocate a list per possible room)
    bins_at: dict[int, list[int]] = {}
    # the distinct rooms that hold a bin, ascending: a class visits rooms >= its size from here, so its cost
    # is the rooms it uses, not a scan of every possible room (a few thousand documents pack in ms)
    rooms: list[int] = []
    placed = np.empty(n, dtype=np.int64)  # bin of each document, in sorted order
    next_bin = 0

    def move(ids: list[int], room: int) -> None:
        if not ids:
            return
        if room not in bins_at:
            bisect.insort(rooms, room)
            bins_at[room] = []
        bins_at[room].extend(ids)

    def set_room(room: int, ids: list[int]) -> None:
        if ids:
            bins_at[room] = ids
        else:
            del bins_at[room]
            del rooms[bisect.bisect_left(rooms, room)]

    for start, end in zip(starts, ends):
        size = int(sorted_len[start])
        pos, left = start, end - start
        for room in rooms[bisect.bisect_left(rooms, size) :]:
            per_bin = room // size
            bucket = bins_at[room]
            if left >= len(bucket) * per_bin:  # every bin here fills up with this class
                take = len(bucket) * per_bin
                placed[pos : pos + take] = np.repeat(bucket, per_bin)
                set_room(room, [])
                move(bucket, room % size)
                pos, left = pos + take, left - take
                if left == 0:
                    break
                continue
            full, rest = divmod(left, per_bin)
            placed[pos : pos + full * per_bin] = np.repeat(bucket[:full], per_bin)
            placed[pos + full * per_bin : pos + left] = bucket[full] if rest else 0
            done = full + (1 if rest else 0)
            set_room(room, bucket[done:])
            move(bucket[:full], room % size)
            if rest:
                move([bucket[full]], room - rest * size)
            left = 0
            break
        if left:  # no open bin fits: open new ones, each taking capacity // size items
            per_bin = capacity // size
            full, rest = divmod(left, per_bin)
            count = full + (1 if rest else 0)
            ids = np.arange(next_bin, next_bin + count)
            placed[pos : pos + left] = np.repeat(ids, per_bin)[:left]
            move(ids[:full].tolist(), capacity % size)
            if rest:
                move([int(ids[full])], capacity - rest * size)
            next_bin += count

    out = np.empty(n, dtype=np.int64)
    out[order] = placed
    return out


def group_by_pack(pack_of_doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Documents ordered by pack (stable) and CSR offsets: pack p holds docs[offsets[p]:offsets[p+1]]."""
    docs = np.argsort(pack_of_doc, kind="stable")
    counts = np.bincount(pack_of_doc, minlength=int(pack_of_doc.max()) + 1 if len(pack_of_doc) else 0)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return docs, offsets

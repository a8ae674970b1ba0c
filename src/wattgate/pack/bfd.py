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
    sorted_len = sorted_len.tolist()
    starts = np.concatenate(([0], bounds)).tolist()
    ends = np.concatenate((bounds, [n])).tolist()

    # bin ids by remaining room, only for the rooms some bin has: memory follows the bins, not the capacity
    # (a seq_len of 1e9 must not allocate a list per possible room)
    bins_at: dict[int, list[int]] = {}
    # the distinct rooms that hold a bin, ascending: a class visits rooms >= its size from here, so its cost
    # is the rooms it uses, not a scan of every possible room (a few thousand documents pack in ms)
    rooms: list[int] = []
    # bin of each document, in sorted order: classes are placed in that order, so this list only grows (Python
    # lists here, since most classes place a few documents: a numpy call per bucket cost more than the work)
    placed: list[int] = []
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

    def place(ids, per_bin: int) -> None:
        """Each bin of `ids` takes `per_bin` documents in a row."""
        placed.extend(ids if per_bin == 1 else [b for b in ids for _ in range(per_bin)])

    for start, end in zip(starts, ends):
        size = sorted_len[start]
        left = end - start
        k = bisect.bisect_left(rooms, size)
        while k < len(rooms):
            room = rooms[k]
            per_bin = room // size
            bucket = bins_at[room]
            if left >= len(bucket) * per_bin:  # every bin here fills up with this class
                place(bucket, per_bin)
                set_room(room, [])
                move(bucket, room % size)
                left -= len(bucket) * per_bin
                if left == 0:
                    break
                # the next room up: what this step added is below `size`, so none of it is visited again
                k = bisect.bisect_right(rooms, room)
                continue
            full, rest = divmod(left, per_bin)
            place(bucket[:full], per_bin)
            if rest:
                placed.extend([bucket[full]] * rest)
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
            ids = range(next_bin, next_bin + count)
            place(ids[:full], per_bin)
            if rest:
                placed.extend([ids[full]] * rest)
            move(list(ids[:full]), capacity % size)
            if rest:
                move([ids[full]], capacity - rest * size)
            next_bin += count

    out = np.empty(n, dtype=np.int64)
    out[order] = np.array(placed, dtype=np.int64)
    return out


def group_by_pack(pack_of_doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Documents ordered by pack (stable) and CSR offsets: pack p holds docs[offsets[p]:offsets[p+1]]."""
    docs = np.argsort(pack_of_doc, kind="stable")
    counts = np.bincount(pack_of_doc, minlength=int(pack_of_doc.max()) + 1 if len(pack_of_doc) else 0)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return docs, offsets

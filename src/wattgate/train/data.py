"""Each rank's planned micro-batches, built from its own rows of packs.parquet.

A rank reads only the plan rows with its rank and, per micro-batch, only the
documents those rows name: shard files are memory-mapped and decoded one row
group at a time (a small LRU), never copied whole per rank. Packs become
input_ids, labels (-100 off the loss mask and at each document's first
position) and position_ids that restart at every document, which is what
lets the model keep attention inside each document.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from wattgate.errors import InputError
from wattgate.run_files import PACKS, arrow_numpy, read_manifest, read_rank_packs

IGNORE = -100


@dataclass(frozen=True)
class MicroBatchPlan:
    """One rank's micro-batch: the documents of each of its packs (slot order)."""

    epoch: int
    step: int
    micro: int
    packs: list[np.ndarray]  # doc ids per slot (PlannedPack: each also carries the plan's doc_lengths)


class PlannedPack(np.ndarray):
    """A pack's doc ids (int64) that also carry the plan's `doc_lengths` for the same documents.

    build_batch checks every document it reads against these lengths, so a shard that changed
    after the plan was made is an InputError, never an overlong pack or a wrong document.
    """

    lengths: np.ndarray | None

    def __new__(cls, doc_ids: np.ndarray, lengths: np.ndarray | None) -> PlannedPack:
        obj = np.asarray(doc_ids).view(cls)
        obj.lengths = lengths
        return obj

    def __array_finalize__(self, obj) -> None:
        same_shape = obj is not None and obj.shape == getattr(self, "shape", None)
        self.lengths = getattr(obj, "lengths", None) if same_shape else None


@dataclass
class Batch:
    input_ids: np.ndarray  # [micro_batch_size, seq_len] int64
    labels: np.ndarray
    position_ids: np.ndarray
    num_loss_tokens: int
    num_tokens: int


def read_rank_plan(plan_dir: Path, rank: int, name: str = PACKS) -> list[MicroBatchPlan]:
    """This rank's micro-batches in execution order (epoch, step, micro), packs in slot order; `name` the
    validation pass's eval_packs.parquet for its micro-batches."""
    table = read_rank_packs(plan_dir, rank, ["epoch", "step", "micro", "slot", "doc_ids", "doc_lengths"], name)
    epoch, step, micro, slot = (arrow_numpy(table.column(c)) for c in ("epoch", "step", "micro", "slot"))
    ids = table.column("doc_ids").combine_chunks()
    offsets = arrow_numpy(ids.offsets)
    offsets = offsets - offsets[0]
    flat = arrow_numpy(pc.list_flatten(ids))
    lengths = table.column("doc_lengths").combine_chunks()
    length_offsets = arrow_numpy(lengths.offsets)
    if not np.array_equal(length_offsets - length_offsets[0], offsets):
        raise InputError(f"{Path(plan_dir) / PACKS}: doc_ids and doc_lengths differ in length; rerun pack and gate")
    flat_lengths = arrow_numpy(pc.list_flatten(lengths)).astype(np.int64)
    order = np.lexsort((slot, micro, step, epoch))
    out: list[MicroBatchPlan] = []
    for r in order.tolist():
        key = (int(epoch[r]), int(step[r]), int(micro[r]))
        docs = PlannedPack(flat[offsets[r] : offsets[r + 1]], flat_lengths[offsets[r] : offsets[r + 1]])
        if out and (out[-1].epoch, out[-1].step, out[-1].micro) == key:
            out[-1].packs.append(docs)
        else:
            out.append(MicroBatchPlan(*key, packs=[docs]))
    return out


class DocStore:
    """Documents by doc_id from the pretokenized shards, decoded one row group at a time.

    Documents are found through the shards' `doc_id` column (a doc_id -> (row group, row) map built
    once from that column alone), never by row position: what the gate indexed is what is read.
    """

    def __init__(self, pretokenized: Path, cache_row_groups: int = 32):
        manifest, _ = read_manifest(pretokenized)
        self.names = list(manifest.shards)
        self.files = [pq.ParquetFile(pretokenized / name, memory_map=True) for name in self.names]
        self.group_index: list[tuple[int, int]] = []
        group_of, row_of, ids_of = [], [], []
        for f_i, f in enumerate(self.files):
            ids = arrow_numpy(f.read(columns=["doc_id"]).column("doc_id")).astype(np.int64)
            start = 0
            for g in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(g).num_rows
                group_of.append(np.full(n, len(self.group_index), dtype=np.int64))
                row_of.append(np.arange(n, dtype=np.int64))
                self.group_index.append((f_i, g))
                start += n
            ids_of.append(ids)
            if start != len(ids):
                raise InputError(
                    f"{pretokenized / self.names[f_i]}: row groups hold {start} rows, doc_id column "
                    f"{len(ids)}; rerun pretokenize/pack/gate"
                )
        ids = np.concatenate(ids_of) if ids_of else np.zeros(0, dtype=np.int64)
        self.num_docs = int(ids.max()) + 1 if len(ids) else 0
        if len(ids) and (ids.min() < 0 or np.bincount(ids, minlength=self.num_docs).max() > 1):
            raise InputError(f"{pretokenized}: shards hold negative or repeated doc_ids; rerun pretokenize/pack/gate")
        # -1: no shard holds this doc_id
        self.group_of_doc = np.full(self.num_docs, -1, dtype=np.int64)
        self.row_of_doc = np.full(self.num_docs, -1, dtype=np.int64)
        if len(ids):
            self.group_of_doc[ids] = np.concatenate(group_of)
            self.row_of_doc[ids] = np.concatenate(row_of)
        self.cache: OrderedDict[int, tuple] = OrderedDict()
        self.cache_row_groups = cache_row_groups
        self.kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # documents held decoded (`keep`)

    def shard_of(self, doc_id: int) -> str:
        """The shard file that holds doc_id (for messages)."""
        gi = int(self.group_of_doc[doc_id]) if 0 <= doc_id < self.num_docs else -1
        return self.names[self.group_index[gi][0]] if gi >= 0 else "no shard"

    def keep(self, doc_ids) -> None:
        """Hold these documents decoded, reading each row group they are in once: a validation set is scattered
        over the shards (its carve goes by content hash), so reading it document by document decodes a whole row
        group per document, every pass (69 s a pass for 5,000 held-out documents of a 1M-document corpus)."""
        wanted = np.unique(np.asarray(list(doc_ids), dtype=np.int64))
        wanted = wanted[(wanted >= 0) & (wanted < self.num_docs)]
        wanted = np.array([d for d in wanted.tolist() if d not in self.kept], dtype=np.int64)
        groups = self.group_of_doc[wanted] if len(wanted) else wanted
        for gi in np.unique(groups[groups >= 0]).tolist():
            offsets, ids, mask = self._read_group(gi)
            for d in wanted[groups == gi].tolist():
                row = int(self.row_of_doc[d])
                a, b = offsets[row], offsets[row + 1]
                self.kept[d] = (ids[a:b].copy(), mask[a:b].copy())  # copies: the group itself is not held

    def _read_group(self, gi: int):
        f_i, g = self.group_index[gi]
        t = self.files[f_i].read_row_group(g, columns=["input_ids", "loss_mask"])
        ids, mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
        offsets = arrow_numpy(ids.offsets)
        return offsets - offsets[0], arrow_numpy(pc.list_flatten(ids)), arrow_numpy(pc.list_flatten(mask))

    def _group(self, gi: int):
        if gi in self.cache:
            self.cache.move_to_end(gi)
            return self.cache[gi]
        entry = self._read_group(gi)
        self.cache[gi] = entry
        if len(self.cache) > self.cache_row_groups:
            self.cache.popitem(last=False)
        return entry

    def get(self, doc_id: int) -> tuple[np.ndarray, np.ndarray]:
        kept = self.kept.get(doc_id)
        if kept is not None:
            return kept
        gi = int(self.group_of_doc[doc_id]) if 0 <= doc_id < self.num_docs else -1
        if gi < 0:
            raise InputError(f"plan names doc_id {doc_id}, which no shard holds; rerun pretokenize/pack/gate")
        offsets, ids, mask = self._group(gi)
        row = int(self.row_of_doc[doc_id])
        return ids[offsets[row] : offsets[row + 1]], mask[offsets[row] : offsets[row + 1]]


def build_batch(
    store: DocStore, packs: list[np.ndarray], seq_len: int, pad_id: int = 0, lengths: list[np.ndarray] | None = None
) -> Batch:
    """Packed rows of seq_len tokens; padding is a separate position block with no loss.

    Each document's length is checked against the plan's doc_lengths: `lengths` per pack, or those a
    PlannedPack (read_rank_plan) carries.
    """
    n = len(packs)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int64)
    position_ids = np.zeros((n, seq_len), dtype=np.int64)
    tokens = 0
    for row, docs in enumerate(packs):
        pos = 0
        planned = lengths[row] if lengths is not None else getattr(docs, "lengths", None)
        planned = None if planned is None else np.asarray(planned).tolist()
        for i, doc_id in enumerate(np.asarray(docs).tolist()):
            ids, mask = store.get(doc_id)
            if planned is not None and len(ids) != planned[i]:
                raise InputError(
                    f"{store.shard_of(doc_id)}: doc_id {doc_id} has {len(ids)} tokens, the plan's "
                    f"doc_lengths say {planned[i]}; rerun pretokenize/pack/gate"
                )
            end = pos + len(ids)
            if end > seq_len:
                raise InputError(f"pack holding doc_id {doc_id} exceeds seq_len {seq_len}; rerun pack and gate")
            input_ids[row, pos:end] = ids
            labels[row, pos:end] = np.where(mask.astype(bool), ids, IGNORE)
            labels[row, pos] = IGNORE  # nothing precedes a document's first token
            position_ids[row, pos:end] = np.arange(len(ids))
            pos = end
        position_ids[row, pos:] = np.arange(seq_len - pos)
        tokens += pos
    return Batch(input_ids, labels, position_ids, int((labels != IGNORE).sum()), tokens)


def host_tensors(batch: Batch, pin: bool) -> dict[str, torch.Tensor]:
    """The batch as CPU tensors, in pinned (page-locked) memory when `pin`, so the copy to the GPU can be
    asynchronous (non_blocking) and overlap the previous micro-batch's compute."""
    out = {
        "input_ids": torch.from_numpy(batch.input_ids),
        "labels": torch.from_numpy(batch.labels),
        "position_ids": torch.from_numpy(batch.position_ids),
    }
    return {k: v.pin_memory() for k, v in out.items()} if pin else out


class StepPrefetcher:
    """Builds the next optimizer step's batches on one background thread while the current step computes.

    A bounded queue of one step: `get(g)` returns step g's batches (waiting only if they are not built yet:
    that wait is the step's data wait) and starts building step g + 1. Errors in the builder (an InputError
    for a changed shard) surface in `get`, on the training thread.
    """

    def __init__(self, build: Callable[[int], list], last: int):
        self.build, self.last = build, last
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wattgate-batches")
        self.pending: dict[int, Future] = {}

    def _submit(self, g: int) -> None:
        if g < self.last and g not in self.pending:
            self.pending[g] = self.pool.submit(self.build, g)

    def get(self, g: int) -> list:
        self._submit(g)
        future = self.pending.pop(g)
        self._submit(g + 1)
        return future.result()

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)

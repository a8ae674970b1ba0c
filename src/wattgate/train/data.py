"""Each rank's planned micro-batches, built from its own rows of packs.parquet.

A rank reads only the plan rows with its rank and, per micro-batch, only the
documents those rows name: shard files are memory-mapped and decoded one row
group at a time (a small LRU), never copied whole per rank. Packs become
input_ids, labels (-100 off the loss mask and at each document's first
position) and position_ids that restart at every document, which is what
lets the model keep attention inside each document.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.errors import InputError

IGNORE = -100


@dataclass(frozen=True)
class MicroBatchPlan:
    """One rank's micro-batch: the documents of each of its packs (slot order)."""

    epoch: int
    step: int
    micro: int
    packs: list[np.ndarray]  # doc ids per slot


@dataclass
class Batch:
    input_ids: np.ndarray  # [micro_batch_size, seq_len] int64
    labels: np.ndarray
    position_ids: np.ndarray
    num_loss_tokens: int
    num_tokens: int


def read_rank_plan(plan_dir: Path, rank: int) -> list[MicroBatchPlan]:
    """This rank's micro-batches in execution order (epoch, step, micro), packs in slot order."""
    table = pq.read_table(plan_dir / "packs.parquet", filters=[("rank", "=", rank)],
                          columns=["epoch", "step", "micro", "slot", "doc_ids"])
    cols = {c: table.column(c).to_numpy() for c in ("epoch", "step", "micro", "slot")}
    ids = table.column("doc_ids").combine_chunks()
    offsets = ids.offsets.to_numpy()
    offsets = offsets - offsets[0]
    flat = pc.list_flatten(ids).to_numpy()
    order = np.lexsort((cols["slot"], cols["micro"], cols["step"], cols["epoch"]))
    out: list[MicroBatchPlan] = []
    for r in order.tolist():
        key = (int(cols["epoch"][r]), int(cols["step"][r]), int(cols["micro"][r]))
        docs = flat[offsets[r]: offsets[r + 1]]
        if out and (out[-1].epoch, out[-1].step, out[-1].micro) == key:
            out[-1].packs.append(docs)
        else:
            out.append(MicroBatchPlan(*key, packs=[docs]))
    return out


class DocStore:
    """Documents by doc_id from the pretokenized shards, decoded one row group at a time."""

    def __init__(self, pretokenized: Path, cache_row_groups: int = 8):
        manifest = json.loads((pretokenized / "manifest.json").read_text())
        self.files = [pq.ParquetFile(pretokenized / name, memory_map=True) for name in manifest["shards"]]
        # global row index of each row group's first row; doc ids are dense and in shard order
        self.group_starts: list[int] = []
        self.group_index: list[tuple[int, int]] = []
        start = 0
        for f_i, f in enumerate(self.files):
            for g in range(f.metadata.num_row_groups):
                self.group_starts.append(start)
                self.group_index.append((f_i, g))
                start += f.metadata.row_group(g).num_rows
        self.num_docs = start
        self.cache: OrderedDict[int, tuple] = OrderedDict()
        self.cache_row_groups = cache_row_groups

    def _group(self, gi: int):
        if gi in self.cache:
            self.cache.move_to_end(gi)
            return self.cache[gi]
        f_i, g = self.group_index[gi]
        t = self.files[f_i].read_row_group(g, columns=["input_ids", "loss_mask"])
        ids, mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
        offsets = ids.offsets.to_numpy()
        entry = (offsets - offsets[0], pc.list_flatten(ids).to_numpy(), pc.list_flatten(mask).to_numpy())
        self.cache[gi] = entry
        if len(self.cache) > self.cache_row_groups:
            self.cache.popitem(last=False)
        return entry

    def get(self, doc_id: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= doc_id < self.num_docs:
            raise InputError(f"plan names doc_id {doc_id}, shards hold 0..{self.num_docs - 1}; rerun pack and gate")
        gi = bisect.bisect_right(self.group_starts, doc_id) - 1
        offsets, ids, mask = self._group(gi)
        row = doc_id - self.group_starts[gi]
        return ids[offsets[row]: offsets[row + 1]], mask[offsets[row]: offsets[row + 1]]


def build_batch(store: DocStore, packs: list[np.ndarray], seq_len: int, pad_id: int = 0) -> Batch:
    """Packed rows of seq_len tokens; padding is a separate position block with no loss."""
    n = len(packs)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int64)
    position_ids = np.zeros((n, seq_len), dtype=np.int64)
    tokens = 0
    for row, docs in enumerate(packs):
        pos = 0
        for doc_id in docs.tolist():
            ids, mask = store.get(doc_id)
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

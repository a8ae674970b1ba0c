"""The validation pass's loss per source: which held-out documents belong to which data.inputs source,
and each micro-batch's token losses summed per source.

The sources are read from the shards' `source` column for the held-out documents (validation.parquet): those
with at least one held-out loss token, in the order of their first held-out doc_id (data.inputs order, then
data.validation.inputs). Every rank reads the same files, so every rank has the same list without a collective;
with fewer than two there is no breakdown, and the pass is exactly the single-source one.

The pass's totals are one fp64 vector, [loss sum, loss tokens, per-source loss sums..., per-source loss
tokens...], all-reduced once per pass whatever sources this rank's micro-batches hold (a source a rank never
sees adds zeros): the same collective on every rank, sized by the list alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from wattgate.data.split import read_validation_ids
from wattgate.errors import InputError
from wattgate.train.data import IGNORE
from wattgate.run_files import arrow_numpy, read_manifest
from wattgate.run_tables import source_loss_column, source_tokens_column


@dataclass(frozen=True)
class EvalSources:
    """The held-out sources and each doc_id's index among them (-1: not held out, or a source not scored)."""

    names: tuple[str, ...]
    code_of_doc: np.ndarray  # int32 per doc_id

    def __bool__(self) -> bool:
        return bool(self.names)

    @property
    def size(self) -> int:
        """Entries of the pass's totals vector: the whole (sum, tokens) and each source's."""
        return 2 + 2 * len(self.names)

    def positions(self, packs: list[np.ndarray], seq_len: int) -> np.ndarray:
        """int64 [len(packs) * seq_len]: the source index of the document at each packed position (the scratch
        index len(names) for padding: its loss is 0). A position's target is the next token of its own document
        (train/data.py puts IGNORE at every document's first token), so this is the target's source too."""
        n = len(self.names)
        out = np.full((len(packs), seq_len), n, dtype=np.int64)
        for row, docs in enumerate(packs):
            ids = np.asarray(docs, dtype=np.int64)
            lengths = getattr(docs, "lengths", None)
            if lengths is None or len(lengths) != len(ids):
                raise InputError("a validation pack without the plan's doc_lengths; rerun pack and gate")
            codes = self.code_of_doc[ids]
            codes = np.where(codes < 0, n, codes)
            filled = np.repeat(codes, np.asarray(lengths, dtype=np.int64))
            out[row, : len(filled)] = filled
        return out.reshape(-1)

    def add(self, totals: torch.Tensor, losses: torch.Tensor, labels: np.ndarray, positions: np.ndarray) -> None:
        """Add one micro-batch to the pass's totals: `losses` token_losses' per-position fp32 losses, `labels` the
        batch's labels and `positions` self.positions of its packs."""
        # loss tokens: label t + 1 is position t's target, and both lie in the same document
        targets = np.zeros(labels.shape, dtype=bool)
        targets[:, :-1] = labels[:, 1:] != IGNORE
        self.add_targets(totals, losses, targets.reshape(-1), positions)

    def add_targets(
        self, totals: torch.Tensor, losses: torch.Tensor, targets: np.ndarray, positions: np.ndarray
    ) -> None:
        """`add` with each position's having a target given (bool, flat like `positions`): a context rank's shard
        of the rows (parallel.context) passes its own positions and targets."""
        n = len(self.names)
        losses = losses.reshape(-1).double()  # fp32 token losses summed in fp64: the whole and every source alike
        totals[0] += losses.sum()
        index = torch.from_numpy(positions).to(losses.device)
        per_source = torch.zeros(n + 1, dtype=torch.float64, device=losses.device)
        per_source.index_add_(0, index, losses)
        totals[2 : 2 + n] += per_source[:n]
        counts = np.bincount(positions[targets], minlength=n + 1)[:n]
        totals[2 + n :] += torch.from_numpy(counts.astype(np.float64)).to(totals.device)

    def row(self, totals: torch.Tensor) -> dict[str, float | int | None]:
        """eval.parquet's per-source columns from the all-reduced totals (none without a breakdown)."""
        n = len(self.names)
        if not n:
            return {}
        values = [float(v) for v in totals]
        out: dict[str, float | int | None] = {}
        for i, name in enumerate(self.names):
            tokens = values[2 + n + i]
            out[source_loss_column(name)] = values[2 + i] / tokens if tokens > 0 else None
            out[source_tokens_column(name)] = int(tokens)
        return out


NO_SOURCES = EvalSources((), np.zeros(0, dtype=np.int32))


def read_eval_sources(pretokenized: Path) -> EvalSources:
    """The held-out documents' sources (NO_SOURCES: no split, or one source)."""
    manifest, _ = read_manifest(pretokenized)
    held = read_validation_ids(pretokenized, manifest)
    ranges, split = manifest.source_docs, manifest.validation
    if not len(held) or (ranges is not None and len(ranges) + len(split.inputs if split is not None else ()) < 2):
        return NO_SOURCES  # one source at most: no shard needs reading
    num_docs = manifest.num_docs
    source_of = np.full(num_docs, -1, dtype=np.int64)  # index into `names`, by doc_id
    loss_tokens = np.zeros(num_docs, dtype=np.int64)
    names: dict[str, int] = {}  # every source in the shards -> its index, by first appearance
    columns = ["doc_id", "source", "num_loss_tokens"]
    for shard in manifest.shards:
        path = Path(pretokenized) / shard
        try:
            if missing := [c for c in columns if c not in pq.read_schema(path).names]:
                raise InputError(f"{path}: missing column(s) {', '.join(missing)}; rerun pretokenize")
            with pq.ParquetFile(path) as f:  # not pq.read_table: it imports pyarrow.dataset and pandas
                t = f.read(columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"{path}: cannot read the documents' sources ({exc}); rerun pretokenize") from None
        ids = arrow_numpy(t.column("doc_id")).astype(np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= num_docs):
            raise InputError(f"{path}: doc_ids outside manifest.json's num_docs {num_docs}; rerun pretokenize")
        encoded = pc.dictionary_encode(t.column("source")).combine_chunks()
        if encoded.null_count:
            raise InputError(f"{path}: null values in the `source` column; rerun pretokenize")
        local = [str(x) for x in encoded.dictionary.to_pylist()]
        for name in local:
            names.setdefault(name, len(names))
        mapping = np.array([names[name] for name in local], dtype=np.int64)
        source_of[ids] = mapping[arrow_numpy(encoded.indices).astype(np.int64)]
        loss_tokens[ids] = arrow_numpy(t.column("num_loss_tokens")).astype(np.int64)
    held_source = source_of[held]
    if (held_source < 0).any():
        raise InputError(f"{Path(pretokenized)}: a held-out doc_id that no shard holds; rerun pretokenize")
    scored = np.bincount(held_source, weights=loss_tokens[held], minlength=len(names)) > 0
    first = np.full(len(names), np.iinfo(np.int64).max)
    np.minimum.at(first, held_source, held)
    order = [i for i in np.argsort(first, kind="stable").tolist() if scored[i]]
    if len(order) < 2:
        return NO_SOURCES
    code_of_doc = np.full(num_docs, -1, dtype=np.int32)
    new_index = np.full(len(names), -1, dtype=np.int32)
    new_index[order] = np.arange(len(order), dtype=np.int32)
    code_of_doc[held] = new_index[held_source]
    return EvalSources(tuple(list(names)[i] for i in order), code_of_doc)

"""Random pretokenized data in the stage's exact on-disk format, for benchmarks and smoke tests.

Token ids are uniform below `vocab`; about 60% of tokens carry loss, never
the first token of a document and always its last (so every document has one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wattgate.run_files import write_manifest
from wattgate.records.manifest import Manifest
from wattgate.records.run_config import DataValidationConfig
from wattgate.data.pretokenize import held_out_mask, source_docs, validation_record
from wattgate.data.shards import ShardWriter
from wattgate.data.mixture import Source
from wattgate.data.split import VALIDATION_FILE, write_validation_ids


def write_random_pretokenized(
    path: Path,
    lengths,
    vocab: int,
    seed: int = 0,
    shard_docs: int = 500,
    validation_fraction: float = 0.0,
    sources: list[tuple[str, int]] | None = None,
) -> Path:
    """Random documents of `lengths`; `validation_fraction` > 0 carves a validation split as pretokenize does.

    `sources`: (name, number of documents) in order, splitting `lengths` into the sources of a mixture (the
    shards' `source` column and manifest `source_docs`); None: one source named `synthetic`."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    writer = ShardWriter(path, shard_docs=shard_docs)
    lengths = np.asarray(lengths, dtype=np.int64)
    sources = sources or [("synthetic", len(lengths))]
    if sum(n for _, n in sources) != len(lengths):
        raise ValueError(f"sources hold {sum(n for _, n in sources)} documents, lengths {len(lengths)}")
    names = np.repeat(np.arange(len(sources)), [n for _, n in sources])
    for n, which in zip(lengths, names):
        writer.source = sources[which][0]
        ids = rng.integers(0, vocab, int(n)).astype(np.int32)
        mask = (rng.random(int(n)) < 0.6).astype(np.int8)
        mask[0], mask[-1] = 0, 1
        writer.add(ids, mask)
    writer.flush()
    ranges, first = [], 0
    for name, count in sources:
        ranges.append((Source(name, f"synthetic/{name}"), first, first + count))
        first += count
    validation = None
    if validation_fraction:
        split = DataValidationConfig(inputs=(), fraction=validation_fraction, max_docs=None, seed=seed)
        held = held_out_mask(split, writer, writer.num_docs)
        write_validation_ids(path / VALIDATION_FILE, np.flatnonzero(held))
        validation = validation_record(split, writer, held)
    write_manifest(
        path,
        Manifest(
            **writer.manifest_fields(),
            vocab_size=vocab,
            dropped={},
            validation=validation,
            source_docs=source_docs(ranges, writer),
            synthetic=True,  # random ids: no tokenizer to export (train/export_files.py)
        ),
    )
    return path

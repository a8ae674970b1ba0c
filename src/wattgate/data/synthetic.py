"""Random pretokenized data in the stage's exact on-disk format, for benchmarks and smoke tests.

Token ids are uniform below `vocab`; about 60% of tokens carry loss, never
the first token of a document and always its last (so every document has one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wattgate.run_files import write_manifest
from wattgate.data.pretokenize import (
    FORMAT_VERSION,
    ShardWriter,
    held_out_mask,
    validation_record,
)
from wattgate.data.split import VALIDATION_FILE, SplitSettings, write_validation_ids


def write_random_pretokenized(
    path: Path, lengths, vocab: int, seed: int = 0, shard_docs: int = 500, validation_fraction: float = 0.0
) -> Path:
    """Random documents of `lengths`; `validation_fraction` > 0 carves a validation split as pretokenize does."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    writer = ShardWriter(path, shard_docs=shard_docs)
    for n in lengths:
        ids = rng.integers(0, vocab, int(n)).astype(np.int32)
        mask = (rng.random(int(n)) < 0.6).astype(np.int8)
        mask[0], mask[-1] = 0, 1
        writer.add(ids, mask)
    writer.flush()
    validation = None
    if validation_fraction:
        split = SplitSettings((), validation_fraction, None, seed)
        held = held_out_mask(split, writer, writer.num_docs)
        write_validation_ids(path / VALIDATION_FILE, np.flatnonzero(held))
        validation = validation_record(split, writer, held)
    write_manifest(
        path,
        {
            "format_version": FORMAT_VERSION,
            **writer.manifest_fields(),
            "vocab_size": vocab,
            "dropped": {},
            "validation": validation,
            "synthetic": True,  # random ids: no tokenizer to export (train/export_files.py)
        },
    )
    return path

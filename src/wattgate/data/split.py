"""The held-out validation split (`data.validation`): which documents are scored, never trained on.

Either separate files (`inputs`), or a carve from data.inputs by `fraction` and/or `max_docs`. The carve
looks only at each document's content hash (xxh3_64 of its token ids, the shards' `content_hash` column)
salted with `seed`: the same documents are held out whatever the input order, shard size or world size,
and exact duplicates share a hash, so they always land on the same side.

The split is stored beside the shards (whose contract does not change) as `validation.parquet`: the
sorted doc_ids of the held-out documents. manifest.json's `validation` section records its counts and
`doc_ids_sha256` (sha256 of those ids as little-endian int64), which the gate re-derives.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.errors import InputError
from wattgate.records.manifest import VALIDATION_FILE as VALIDATION_FILE, Manifest
from wattgate.records.run_config import DataValidationConfig
from wattgate.run_files import arrow_numpy

VALIDATION_SCHEMA = pa.schema([("doc_id", pa.int64())])

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def validation_split(v: DataValidationConfig) -> DataValidationConfig:
    """data.validation as pretokenize carves it: refused in one line when it names both separate inputs and a
    carve; `fraction` a float, so the manifest and messages say 0.0 for a config's 0."""
    fraction = float(v.fraction)
    if v.inputs and (fraction or v.max_docs):
        raise InputError(
            f"data.validation: inputs ({len(v.inputs)} file(s)) and "
            f"{'fraction ' + str(fraction) if fraction else 'max_docs ' + str(v.max_docs)} given together; "
            "hold out either separate files or a carve from data.inputs"
        )
    return v.replace(fraction=fraction)


def validation_enabled(v: DataValidationConfig) -> bool:
    """Whether the split holds anything out: separate inputs, or a carve by fraction or max_docs."""
    return bool(v.inputs or v.fraction or v.max_docs)


def validation_source(v: DataValidationConfig) -> str:
    """manifest.json's validation `source`: separate `inputs`, or a `carve` from data.inputs."""
    return "inputs" if v.inputs else "carve"


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer: turns (hash xor salt) into uniformly spread bits."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def carve_keys(content_hashes: np.ndarray, seed: int) -> np.ndarray:
    """Each document's place in the carve order (uint64): a function of its content hash and the seed only."""
    salt = _splitmix64(np.array([seed], dtype=np.uint64))[0]
    return _splitmix64(content_hashes.astype(np.int64).view(np.uint64) ^ salt)


def carve(content_hashes: np.ndarray, fraction: float, max_docs: int | None, seed: int) -> np.ndarray:
    """Boolean mask of the held-out documents.

    `fraction`: documents whose key falls in the lowest `fraction` of the 64-bit range (so each distinct
    content is held out with that probability). `max_docs`: of those (or of all documents when fraction is
    0), the ones with the smallest keys, at most max_docs; duplicates share a key, so a group of them is
    taken whole or not at all. O(n): a partition, no sort.
    """
    keys = carve_keys(content_hashes, seed)
    chosen = np.ones(len(keys), dtype=bool)
    if fraction:
        chosen &= keys < np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))
    if max_docs is not None and int(chosen.sum()) > max_docs:
        candidates = keys[chosen]
        kth = np.partition(candidates, max_docs - 1)[max_docs - 1]
        below = keys < kth
        at = keys == kth
        # the group at the threshold joins only when it fits whole (duplicates never straddle the split)
        chosen &= below | (at if int((chosen & below).sum() + (chosen & at).sum()) <= max_docs else False)
    return chosen


def doc_ids_sha256(doc_ids: np.ndarray) -> str:
    """sha256 of the sorted held-out doc_ids as little-endian int64: what manifest.json records."""
    return hashlib.sha256(np.sort(np.asarray(doc_ids, dtype="<i8")).tobytes()).hexdigest()


def write_validation_ids(path: Path, doc_ids: np.ndarray) -> None:
    """validation.parquet: the sorted held-out doc_ids (the caller writes into a temporary folder)."""
    table = pa.Table.from_arrays([pa.array(np.sort(np.asarray(doc_ids, dtype=np.int64)))], schema=VALIDATION_SCHEMA)
    pq.write_table(table, path, compression="zstd")


def read_validation_ids(pretokenized: Path, manifest: Manifest) -> np.ndarray:
    """The held-out doc_ids (sorted int64; empty without a split), checked against the manifest's record."""
    section = manifest.validation
    if section is None:
        return np.zeros(0, dtype=np.int64)
    path = pretokenized / section.file
    try:
        with pq.ParquetFile(path) as f:  # not pq.read_table: it imports pyarrow.dataset, and that pandas
            ids = arrow_numpy(f.read(columns=["doc_id"]).column("doc_id")).astype(np.int64)
    except (OSError, pa.ArrowException, KeyError) as exc:
        raise InputError(f"{path}: cannot read the validation split ({exc}); rerun pretokenize") from None
    if len(ids) != section.num_docs or doc_ids_sha256(ids) != section.doc_ids_sha256:
        raise InputError(
            f"{path}: {len(ids)} doc_ids that do not hash to manifest.json's validation.doc_ids_sha256 "
            f"({section.num_docs} documents); rerun pretokenize"
        )
    return np.sort(ids)


def train_doc_ids(num_docs: int, held_out: np.ndarray) -> np.ndarray:
    """Every doc_id but the held-out ones, ascending."""
    keep = np.ones(num_docs, dtype=bool)
    keep[held_out] = False
    return np.flatnonzero(keep).astype(np.int64)

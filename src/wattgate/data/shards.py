"""The pretokenized shards: their schema, how they are written (`shard-NNNNN.parquet` in token-bounded row groups)
and how their bytes and documents are hashed. Format: docs/architecture.md, "results/pretokenized/<run>/"."""

from __future__ import annotations

import importlib.util
import mmap
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Content hash of every shard file, recorded in manifest.json (`shard_hashes`) and verified by the gate:
# xxh3_128 hashes ~12 GB/s on one core (sha256 ~1.5, blake2b ~0.6), so the gate can afford all the bytes.
SHARD_HASH_ALGORITHM = "xxh3_128"


def shard_hash(path: str | Path) -> str:
    """xxh3_128 of a file's bytes, hex (falls back to blake2b-128 if xxhash is missing, named differently).

    The file is memory-mapped and hashed in place (~8 GB/s from the page cache, vs ~2.5 GB/s via read()).
    """
    h = content_hasher()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                h.update(mm)
    return h.hexdigest()


def content_hasher():
    try:
        import xxhash
    except ImportError:  # pragma: no cover - xxhash is a dependency (and one of datasets')
        import hashlib

        return hashlib.blake2b(digest_size=16)
    return xxhash.xxh3_128()


def shard_hash_algorithm() -> str:
    """The name recorded as manifest `shard_hash_algorithm` (what shard_hash computes on this install)."""
    return SHARD_HASH_ALGORITHM if importlib.util.find_spec("xxhash") is not None else "blake2b-128"


SHARD_SCHEMA = pa.schema(
    [
        ("doc_id", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        # beyond the contract's four columns: lets the gate check loss-bearing packs without reading masks
        ("num_loss_tokens", pa.int32()),
        # xxh3_64 of the document's token ids (int32 bytes) as int64: the validation carve and the gate's
        # leakage check compare documents by it without reading their tokens (data/split.py)
        ("content_hash", pa.int64()),
        # the data.inputs source the document came from (its `name`; a plain path's file stem): shares of a
        # mixture can be counted from the shards and packs.parquet alone (data/mixture.py)
        ("source", pa.string()),
    ]
)


def content_hash(ids: np.ndarray) -> int:
    """xxh3_64 of a document's token ids as int32 bytes, as a signed int64 (the shards' content_hash)."""
    import xxhash

    return int(np.uint64(xxhash.xxh3_64_intdigest(np.ascontiguousarray(ids, dtype=np.int32).tobytes())).view(np.int64))


ROW_GROUP_TOKENS = 1 << 18  # a row group holds at most this many tokens (or one longer document)
ROW_GROUP_DOCS = 16384


def row_group_bounds(
    lengths: np.ndarray, max_tokens: int = ROW_GROUP_TOKENS, max_docs: int = ROW_GROUP_DOCS
) -> list[int]:
    """Row offsets that cut a shard into row groups of at most `max_tokens` tokens and `max_docs` documents (a
    document longer than `max_tokens` is a group of its own). The trainer reads a document by decoding its whole
    row group, and a packed micro-batch draws documents from anywhere in the corpus: groups of a fixed 16,384
    documents (~32 MB of tokens at 500 a document) made each document cost a 32 MB decode."""
    bounds, tokens, start = [0], 0, 0
    for i, n in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        if i > start and (tokens + n > max_tokens or i - start >= max_docs):
            bounds.append(i)
            start, tokens = i, 0
        tokens += n
    if bounds[-1] != len(lengths):
        bounds.append(len(lengths))
    return bounds


def write_shard(table: pa.Table, path: Path) -> None:
    """One shard file, in row groups of `row_group_bounds` of its `num_tokens` column (zstd)."""
    bounds = row_group_bounds(table.column("num_tokens").to_numpy())
    with pq.ParquetWriter(path, table.schema, compression="zstd") as writer:
        for a, b in zip(bounds, bounds[1:]):
            writer.write_table(table.slice(a, b - a), row_group_size=b - a)


class ShardWriter:
    """Buffers documents and writes `shard-NNNNN.parquet` files of `shard_docs` rows."""

    def __init__(self, out: Path, shard_docs: int, source: str = "synthetic"):
        self.out, self.shard_docs = out, shard_docs
        self.source = source  # the `source` of the documents added next
        self._pending_sources: list[str] = []
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.shards: list[str] = []
        self.shard_hashes: dict[str, str] = {}  # file name -> shard_hash of its bytes
        self.num_docs = 0
        self.num_tokens = 0
        self.num_loss_tokens = 0
        self.max_token_id = -1
        # per written shard, every document's content_hash, length and loss tokens (compact arrays, not one
        # Python int per document: the split reads them after the last flush)
        self._parts: dict[str, list[np.ndarray]] = {"hashes": [], "lengths": [], "loss_counts": []}
        self._pending_hashes: list[int] = []  # content_hash of each buffered document

    def manifest_fields(self) -> dict:
        """What every manifest.json says of its shards (pretokenize's and the synthetic corpus's)."""
        return {
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "max_token_id": self.max_token_id,
            "shards": tuple(self.shards),
            "shard_hashes": dict(self.shard_hashes),
            "shard_hash_algorithm": shard_hash_algorithm(),
        }

    def _written(self, name: str) -> np.ndarray:
        parts = self._parts[name]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def hashes(self) -> np.ndarray:
        """content_hash of every written document, by doc_id."""
        return self._written("hashes")

    @property
    def lengths(self) -> np.ndarray:
        return self._written("lengths")

    @property
    def loss_counts(self) -> np.ndarray:
        return self._written("loss_counts")

    @property
    def docs_added(self) -> int:
        """Documents written or buffered: the next document's doc_id."""
        return self.num_docs + len(self.ids)

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self._pending_hashes.append(content_hash(ids))
        self._pending_sources.append(self.source)
        self.ids.append(ids)
        self.masks.append(mask)
        if len(self.ids) >= self.shard_docs:
            self.flush()

    def flush(self) -> None:
        if not self.ids:
            return
        lengths = np.fromiter((len(x) for x in self.ids), dtype=np.int32, count=len(self.ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat_ids = np.concatenate(self.ids).astype(np.int32, copy=False)
        flat_mask = np.concatenate(self.masks).astype(np.int8, copy=False)
        loss_tokens = np.add.reduceat(flat_mask, offsets[:-1], dtype=np.int32)
        doc_ids = np.arange(self.num_docs, self.num_docs + len(lengths), dtype=np.int64)
        hashes = np.asarray(self._pending_hashes, dtype=np.int64)
        table = pa.Table.from_arrays(
            [
                pa.array(doc_ids),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids)),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_mask)),
                pa.array(lengths),
                pa.array(loss_tokens),
                pa.array(hashes),
                pa.array(self._pending_sources, type=pa.string()),
            ],
            schema=SHARD_SCHEMA,
        )
        name = f"shard-{len(self.shards):05d}.parquet"
        write_shard(table, self.out / name)
        self.shards.append(name)
        self.shard_hashes[name] = shard_hash(self.out / name)
        self.num_docs += len(lengths)
        self.num_tokens += int(lengths.sum())
        self.num_loss_tokens += int(loss_tokens.sum(dtype=np.int64))
        self.max_token_id = max(self.max_token_id, int(flat_ids.max()))
        for name, values in (("hashes", hashes), ("lengths", lengths), ("loss_counts", loss_tokens)):
            self._parts[name].append(values.astype(np.int64))
        self.ids, self.masks, self._pending_hashes, self._pending_sources = [], [], [], []

"""manifest.json, the pretokenize stage's record of its shards (docs/architecture.md "results/pretokenized/<run>/").

`Manifest.read(path, rerun="pretokenize")` (run_files.read_manifest) checks every key a reader uses, with one
line naming the file and the key; pretokenize (data/pretokenize.py) and the synthetic corpus
(data/synthetic.py) build a `Manifest` and write its `to_json()`. Keys a writer leaves out (the synthetic
corpus has no tokenizer) are None here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from wattgate.records.base import Record, spec

MANIFEST_FORMAT_VERSION = 1
VALIDATION_FILE = "validation.parquet"


def _count(minimum: int = 0):
    return spec(minimum=minimum, omit_none=True, default=None)


def _optional():
    return spec(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceRange(Record):
    """manifest.json's source_docs[i]: a data.inputs source, its setting and its doc_id range [first_doc, end_doc)."""

    name: str
    path: str
    weight: float | None = _optional()
    epochs: float | None = _optional()
    max_tokens: float | None = _optional()
    first_doc: int = spec(minimum=0)
    end_doc: int = spec(minimum=0)
    num_tokens: int | None = _count()
    num_loss_tokens: int | None = _count()


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceSplit(Record):
    """manifest.json's validation.per_source[i]: one mixture source's own carve and what it held out."""

    name: str
    fraction: float | None = None
    max_docs: int | None = None
    seed: int | None = None
    num_docs: int = spec(minimum=0)
    num_tokens: int = spec(minimum=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestValidation(Record):
    """manifest.json's `validation`: the split's settings, its held-out side and the hash of its doc_ids."""

    num_docs: int = spec(minimum=0)
    source: str | None = None  # carve | inputs
    inputs: tuple[str, ...] = ()
    source_sha256: str | None = None
    fraction: float | None = None
    max_docs: int | None = None
    seed: int | None = None
    file: str = VALIDATION_FILE
    num_tokens: int | None = spec(minimum=0, default=None)
    num_loss_tokens: int | None = spec(minimum=0, default=None)
    doc_ids_sha256: str | None = None
    train_docs: int | None = spec(minimum=0, default=None)
    train_tokens: int | None = spec(minimum=0, default=None)
    train_loss_tokens: int | None = spec(minimum=0, default=None)
    copies_of_train: int | None = spec(minimum=0, default=None)
    per_source: tuple[SourceSplit, ...] | None = _optional()


@dataclass(frozen=True, kw_only=True, slots=True)
class Overlong(Record):
    """manifest.json's `overlong`: documents over pretokenize.max_tokens and what was done with them."""

    max_tokens: int | None
    policy: str
    documents: int = spec(minimum=0)
    split_chunks: int = spec(minimum=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest(Record):
    """manifest.json (format_version 1)."""

    FORMAT_VERSION: ClassVar[int] = MANIFEST_FORMAT_VERSION

    num_docs: int = spec(minimum=0)
    shards: tuple[str, ...]
    max_token_id: int = spec(minimum=-1)  # -1: no token written
    num_tokens: int = spec(minimum=0)
    num_loss_tokens: int = spec(minimum=0)
    shard_hashes: dict[str, str]
    shard_hash_algorithm: str
    vocab_size: int | None = _count()
    tokenizer_sha256: str | None = _optional()
    tokenizer_path: str | None = _optional()
    source_sha256: str | None = _optional()
    sources: tuple[str, ...] | None = _optional()
    source_docs: tuple[SourceRange, ...] | None = _optional()
    dropped: dict[str, int] | None = _optional()
    chat_turns: dict[str, int] | None = _optional()
    overlong: Overlong | None = _optional()
    config: dict[str, Any] | None = _optional()  # the pretokenize settings, as they were
    validation: ManifestValidation | None = None
    synthetic: bool | None = _optional()  # random ids: no tokenizer to export

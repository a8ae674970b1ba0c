"""Pretokenize a corpus into reproducible Arrow shards (see docs/architecture.md, results/pretokenized/<run>/).

One row per document: dense `doc_id`, `input_ids`, `loss_mask` (1 = the token
is a training target) and `num_tokens`. Position 0 of every document is never
a target: nothing precedes it to predict it from. Documents with no target
left (e.g. a chat whose assistant turns were truncated away) are dropped and
counted, because a pack of them would carry no loss.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wattgate.artifacts import atomic_dir, sha256_tree
from wattgate.run_files import MANIFEST_FORMAT_VERSION, write_manifest
from wattgate.records.manifest import Manifest, ManifestValidation, Overlong, SourceRange, SourceSplit
from wattgate.config import max_doc_tokens
from wattgate.data.distinct_inputs import check_distinct_content
from wattgate.data.shards import ShardWriter
from wattgate.data.mixture import Source, is_mixture, parse_sources, source_name
from wattgate.data.encode import EncodePool, Tokenize, encode_workers, encoded_batches
from wattgate.data.records import BadRecordPolicy, Fields, raw_records
from wattgate.data.split import (
    VALIDATION_FILE,
    carve,
    doc_ids_sha256,
    validation_enabled,
    validation_source,
    validation_split,
    write_validation_ids,
)
from wattgate.data.tokenizer import load_tokenizer, tokenizer_sha256
from wattgate.errors import InputError
from wattgate.records.base import ABSENT
from wattgate.records.run_config import DataValidationConfig, PretokenizeConfig, RunConfig

if TYPE_CHECKING:
    from tqdm import tqdm

FORMAT_VERSION = MANIFEST_FORMAT_VERSION  # the reader's (run_files): one number


def recorded_settings(config: RunConfig) -> dict[str, Any]:
    """manifest.json's `config`: the settings that shaped the shards (pretokenize's, with max_tokens resolved, and
    data.text_field / messages_field); the gate's settings check compares it with the config being gated."""
    p = config.pretokenize
    return {
        "loss_on": p.loss_on,
        "max_tokens": max_doc_tokens(config),
        "overlong": p.overlong,
        "on_bad_record": p.on_bad_record,
        "append_eos": p.append_eos,
        "batch_size": p.batch_size,
        "shard_docs": p.shard_docs,
        "text_field": config.data.text_field,
        "messages_field": config.data.messages_field,
        "max_doc_chars": p.max_doc_chars,
    }


def cut_overlong(ids: np.ndarray, mask: np.ndarray, max_tokens: int, policy: str):
    """Pieces of at most max_tokens under the overlong policy (truncate | split | drop)."""
    if len(ids) <= max_tokens:
        return [(ids, mask)]
    if policy == "drop":
        return []
    if policy == "truncate":
        return [(ids[:max_tokens], mask[:max_tokens])]
    return [(ids[s : s + max_tokens], mask[s : s + max_tokens]) for s in range(0, len(ids), max_tokens)]


def recorded_tokenizer_path(tokenizer_dir: str | Path, out: str | Path) -> str:
    """The tokenizer folder as the manifest records it: relative to the pretokenized folder when both live in one
    results folder (results/tokenizer/<run> beside results/pretokenized/<run>: `../../tokenizer/<run>`; work/tokenizer
    beside work/pretokenized: `../tokenizer`), so a results/ moved or copied elsewhere reads its own tokenizer; else
    absolute (a model folder's tokenizer), found from any directory."""
    tokenizer, out = Path(tokenizer_dir).resolve(), Path(out).resolve()
    results = out.parent.parent if out.parent.name == "pretokenized" else out.parent  # results/pretokenized/<run>
    if tokenizer.is_relative_to(results):
        return os.path.relpath(tokenizer, out)
    return str(tokenizer)


# manifest.json `dropped` reasons of pretokenize's own (bad records: data/records.py)
DROP_NO_LOSS_TOKENS = "no_loss_tokens"
DROP_OVERLONG = "overlong"


@dataclass
class OverlongCount:
    """Documents over pretokenize.max_tokens so far, and the chunks `split` cut them into."""

    documents: int = 0
    split_chunks: int = 0


@dataclass(frozen=True)
class Pretokenizer:
    """One pretokenize run's path from input files to shards: the encoding pool, how records are read and
    tokenized (`max_tokens`: the longest document kept whole, max_doc_tokens), and what the documents go to (the
    shard writer, the progress bar, the overlong count)."""

    pool: EncodePool
    settings: PretokenizeConfig
    max_tokens: int
    fields: Fields
    policy: BadRecordPolicy
    writer: ShardWriter
    bar: tqdm
    overlong: OverlongCount

    def tokenize_inputs(self, inputs: list[str], source: str = "data.inputs") -> None:
        """Stream `inputs` through the tokenizer into the writer in input order (encoded on the pool while the
        next batches are read), counting overlong documents."""
        settings, max_tokens, policy, overlong = self.settings, self.max_tokens, self.policy, self.overlong
        for batch in encoded_batches(raw_records(inputs, self.fields, source), self.pool, settings.batch_size):
            self.pool.tokenize.account(batch, policy)
            for ids, mask in batch.docs:
                pieces = cut_overlong(ids, mask, max_tokens, settings.overlong)
                if len(ids) > max_tokens:
                    overlong.documents += 1
                    overlong.split_chunks += len(pieces) if settings.overlong == "split" else 0
                for piece_ids, piece_mask in pieces:
                    piece_mask[0] = 0  # pieces never overlap, so this touches only this piece
                    if not piece_mask.any():
                        policy.dropped[DROP_NO_LOSS_TOKENS] += 1
                        continue
                    self.writer.add(piece_ids, piece_mask)
            self.bar.update(batch.records)


def held_out_mask(
    split: DataValidationConfig, writer: ShardWriter, first_validation_input: int, per_source: list | None = None
) -> np.ndarray:
    """Which documents the validation split holds (see data/split.py), with one-line errors for empty sides.

    `per_source`: a mixture's (first doc, end doc, its carve) per source: each source is carved with its
    own settings, and a training copy of a held-out document joins the held-out side (copies never straddle)."""
    hashes = np.asarray(writer.hashes, dtype=np.int64)
    n = len(hashes)
    if per_source and not split.inputs:
        held = np.zeros(n, dtype=bool)
        for start, end, own in per_source:
            if validation_enabled(own):
                held[start:end] = carve(hashes[start:end], own.fraction, own.max_docs, own.seed)
        held |= np.isin(hashes, hashes[held])
        if not held.any():
            raise InputError("data.validation: the per-source carves hold out no document; raise a fraction")
    elif split.inputs:
        held = np.arange(n) >= first_validation_input
        if not held.any():
            raise InputError(f"data.validation.inputs ({', '.join(split.inputs)}): no document survived pretokenizing")
        if np.isin(hashes[held], hashes[~held]).all():
            raise InputError(
                f"data.validation.inputs ({', '.join(split.inputs)}): all {int(held.sum())} documents are "
                "exact copies of training documents; hold out documents the training data does not contain"
            )
    else:
        held = carve(hashes, split.fraction, split.max_docs, split.seed)
        asked = " and ".join(
            part
            for part in (
                f"fraction {split.fraction}" if split.fraction else "",
                f"max_docs {split.max_docs}" if split.max_docs else "",
            )
            if part
        )
        distinct = len(np.unique(hashes))
        if not held.any():
            raise InputError(
                f"data.validation: {asked} of {n} documents ({distinct} distinct) holds out none; "
                "raise data.validation.fraction or set max_docs"
            )
    if held.all():
        raise InputError(
            f"data.validation: the split holds out all {n} documents and leaves no training document; "
            "lower data.validation.fraction or max_docs"
        )
    return held


def validation_record(split: DataValidationConfig, writer: ShardWriter, held: np.ndarray) -> ManifestValidation:
    """manifest.json's `validation` section: the split's settings, sides and the hash of its doc_id list."""
    hashes = np.asarray(writer.hashes, dtype=np.int64)
    lengths = np.asarray(writer.lengths, dtype=np.int64)
    loss = np.asarray(writer.loss_counts, dtype=np.int64)
    ids = np.flatnonzero(held)
    return ManifestValidation(
        source=validation_source(split),
        inputs=tuple(split.inputs),
        source_sha256=sha256_tree(list(split.inputs)) if split.inputs else None,
        fraction=split.fraction,
        max_docs=split.max_docs,
        seed=split.seed,
        file=VALIDATION_FILE,
        num_docs=len(ids),
        num_tokens=int(lengths[held].sum()),
        num_loss_tokens=int(loss[held].sum()),
        doc_ids_sha256=doc_ids_sha256(ids),
        train_docs=int((~held).sum()),
        train_tokens=int(lengths[~held].sum()),
        train_loss_tokens=int(loss[~held].sum()),
        # separate inputs may repeat training documents; the gate's leakage check names them
        copies_of_train=int(np.isin(hashes[held], hashes[~held]).sum()),
    )


def split_for(split: DataValidationConfig, src: Source) -> DataValidationConfig:
    """A mixture source's carve: data.validation's settings with the source's own override on top."""
    own = src.validation
    if own is None:
        return split.replace(inputs=())
    return DataValidationConfig(
        inputs=(),
        fraction=float(own.fraction if own.fraction is not None else split.fraction),
        max_docs=split.max_docs if own.max_docs is ABSENT else own.max_docs,  # null given: no cap for this source
        seed=own.seed if own.seed is not None else split.seed,
    )


def source_docs(ranges: list, writer: ShardWriter) -> tuple[SourceRange, ...]:
    """manifest.json's `source_docs`: per data.inputs source its setting and doc_id range [first_doc, end_doc)."""
    lengths, loss = writer.lengths, writer.loss_counts
    return tuple(
        SourceRange(
            **src.spec(),
            first_doc=first,
            end_doc=end,
            num_tokens=int(lengths[first:end].sum()),
            num_loss_tokens=int(loss[first:end].sum()),
        )
        for src, first, end in ranges
    )


def pretokenize(
    config: RunConfig, tokenizer_dir: str | Path, out: str | Path, progress: bool | None = None
) -> Manifest:
    """Run the stage; returns the manifest written to `out/manifest.json`."""
    settings, max_tokens = config.pretokenize, max_doc_tokens(config)
    split = validation_split(config.data.validation)
    sources = parse_sources(config)
    inputs = [src.path for src in sources]
    check_distinct_content(inputs, "data.inputs")
    tokenizer = load_tokenizer(tokenizer_dir)
    dropped: Counter = Counter()
    policy = BadRecordPolicy(settings.on_bad_record, dropped)
    fields = Fields(text=config.data.text_field, messages=config.data.messages_field, max_chars=settings.max_doc_chars)
    workers = encode_workers(inputs + list(split.inputs), fields)
    tokenize = Tokenize(tokenizer, fields, settings.loss_on, settings.append_eos, str(tokenizer_dir))

    from tqdm import tqdm

    with atomic_dir(out) as tmp, EncodePool(tokenize, tokenizer_dir, workers) as pool:
        writer = ShardWriter(tmp, settings.shard_docs)
        bar = tqdm(unit="doc", desc="pretokenize", disable=None if progress is None else not progress, file=sys.stderr)
        overlong = OverlongCount()
        pretokenizer = Pretokenizer(
            pool=pool,
            settings=settings,
            max_tokens=max_tokens,
            fields=fields,
            policy=policy,
            writer=writer,
            bar=bar,
            overlong=overlong,
        )
        ranges = []  # (source, first doc_id, end doc_id): sources are tokenized in order, so each is a range
        for src in sources:
            writer.source, first = src.name, writer.docs_added
            pretokenizer.tokenize_inputs([src.path])
            ranges.append((src, first, writer.docs_added))
        first_validation_input = writer.docs_added
        for path in split.inputs:
            writer.source = source_name(path)
            pretokenizer.tokenize_inputs([path], source="data.validation.inputs")
        bar.close()
        tokenize.check_template_rendered_any()
        writer.flush()
        overlong_docs, split_chunks = overlong.documents, overlong.split_chunks
        if settings.overlong == "drop" and overlong_docs:
            dropped[DROP_OVERLONG] = overlong_docs
        if writer.num_docs == 0:
            raise InputError(f"{', '.join(inputs)}: no document survived pretokenization (dropped: {dict(dropped)})")
        mixture = is_mixture(config)
        if mixture:
            for src, first, end in ranges:
                if first == end:
                    raise InputError(
                        f"data.inputs (source {src.name!r}, {src.path}): no document survived pretokenization "
                        f"(dropped so far: {dict(dropped)}); fix the source or remove it from the mixture"
                    )
        per_source = (
            [(first, end, split_for(split, src)) for src, first, end in ranges]
            if mixture and not split.inputs and (validation_enabled(split) or any(src.validation for src in sources))
            else None
        )
        validation = None
        if validation_enabled(split) or (per_source and any(validation_enabled(s) for _, _, s in per_source)):
            held = held_out_mask(split, writer, first_validation_input, per_source)
            write_validation_ids(tmp / VALIDATION_FILE, np.flatnonzero(held))
            validation = validation_record(split, writer, held)
            if per_source:  # a mixture: each source's own carve and what it holds out
                validation = validation.replace(
                    per_source=tuple(
                        SourceSplit(
                            name=src.name,
                            fraction=own.fraction,
                            max_docs=own.max_docs,
                            seed=own.seed,
                            num_docs=int(held[first:end].sum()),
                            num_tokens=int(writer.lengths[first:end][held[first:end]].sum()),
                        )
                        for (src, first, end), (_, _, own) in zip(ranges, per_source)
                    )
                )
        manifest = Manifest(
            tokenizer_sha256=tokenizer_sha256(tokenizer_dir),
            tokenizer_path=recorded_tokenizer_path(tokenizer_dir, out),
            vocab_size=len(tokenizer),
            source_sha256=sha256_tree(inputs),
            sources=tuple(inputs),
            source_docs=source_docs(ranges, writer),
            **writer.manifest_fields(),
            dropped=dict(sorted(dropped.items())),
            chat_turns=dict(sorted(policy.noted.items())),  # kept but irregular (e.g. assistant first)
            overlong=Overlong(
                max_tokens=max_tokens,
                policy=settings.overlong,
                documents=overlong_docs,
                split_chunks=split_chunks,
            ),
            config=recorded_settings(config),
            validation=validation,
        )
        write_manifest(tmp, manifest)
    return manifest

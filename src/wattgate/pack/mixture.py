"""A weighted mixture's documents per epoch: exact shares, chosen by content hash and seed.

Each source's training documents are put in one fixed order: by a key mixed from each document's
content_hash, pack.seed and the source's name (data/split.py carve_keys), so the order is the same
whatever the input order, shard size or world size. That order, repeated end to end, is the source's
stream; epoch e takes the next stretch of it, from the document boundary nearest to e x target tokens
to the one nearest to (e + 1) x target. So:
- upsampling repeats whole documents (a stretch longer than the source covers it k or k + 1 times);
- downsampling takes a subset, and over epochs the source cycles through every document before repeating any;
- each epoch's tokens are within one document of the target (each end is off by at most half a document).

Targets (tokens per epoch): `epochs: e` -> e x the source's training tokens; `max_tokens: m` -> min(m, those
tokens); `weight: w` -> w / (sum of weights) x the weighted sources' training tokens together (the weighted
part of an epoch is as long as one pass over them). The gate re-derives the choice (gate/mixture_checks.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from wattgate.data.mixture import Source
from wattgate.data.split import carve_keys
from wattgate.errors import InputError
from wattgate.records.manifest import Manifest
from wattgate.records.plan import MixtureEpoch, MixtureSource, PlanMixture


@dataclass(frozen=True)
class SourceDocs:
    """One source of the manifest's `source_docs`, with the doc_ids it trains on (its range minus held-out)."""

    source: Source
    doc_ids: np.ndarray


def source_seed(seed: int, name: str) -> int:
    """pack.seed mixed with the source's name: each source gets its own order, stable under reordering."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def read_source_docs(manifest: Manifest, sources: list[Source], held_out: np.ndarray, where: str) -> list[SourceDocs]:
    """The config's sources matched by name with the manifest's `source_docs` ranges; one-line errors."""
    if manifest.source_docs is None:
        raise InputError(f"{where}: manifest.json has no source_docs (made before mixtures); rerun pretokenize")
    by_name = {r.name: r for r in manifest.source_docs}
    out = []
    for src in sources:
        r = by_name.get(src.name)
        if r is None:
            raise InputError(
                f"{where}: source {src.name!r} of data.inputs is not in manifest.json's source_docs; rerun pretokenize"
            )
        ids = np.arange(r.first_doc, r.end_doc, dtype=np.int64)
        ids = ids[~np.isin(ids, held_out)] if len(held_out) else ids
        if not len(ids):
            raise InputError(
                f"data.inputs (source {src.name!r}): no training document (all {r.end_doc - r.first_doc} "
                "held out for validation); lower its validation fraction or add documents"
            )
        out.append(SourceDocs(src, ids))
    return out


def targets(sources: list[SourceDocs], lengths: np.ndarray, max_repeats: float) -> np.ndarray:
    """Target tokens per epoch of every source (float); one-line error for a source repeated past max_repeats."""
    totals = np.array([float(lengths[s.doc_ids].sum()) for s in sources])
    weighted = [i for i, s in enumerate(sources) if s.source.kind == "weight"]
    weight_sum = sum(sources[i].source.value for i in weighted)
    weighted_tokens = totals[weighted].sum() if weighted else 0.0
    out = np.empty(len(sources))
    for i, s in enumerate(sources):
        kind, value = s.source.kind, s.source.value
        if kind == "weight":
            out[i] = value / weight_sum * weighted_tokens
        elif kind == "epochs":
            out[i] = value * totals[i]
        else:
            out[i] = min(float(value), totals[i])
        repeats = out[i] / totals[i]
        if repeats > max_repeats:
            raise InputError(
                f"data.inputs (source {s.source.name!r}): {kind} {value} needs {repeats:.2f} passes over its "
                f"{int(totals[i])} training tokens per epoch, more than data.max_repeats {max_repeats}; lower its "
                f"{kind} or raise data.max_repeats"
            )
    return out


def _boundary(cum: np.ndarray, target: float) -> int:
    """Position (in documents, from the stream's start) of the document boundary nearest `target` tokens."""
    total = int(cum[-1])
    t = round(target)
    q, r = divmod(t, total)
    j = int(np.searchsorted(cum, r, side="left"))  # cum[j] >= r: boundary after j + 1 documents
    before = int(cum[j - 1]) if j > 0 else 0
    take = j + 1 if j < len(cum) and int(cum[j]) - r < r - before else j
    return q * len(cum) + take


def choose(
    sources: list[SourceDocs], lengths: np.ndarray, content_hashes: np.ndarray, epochs: int, seed: int, max_repeats
) -> list[list[np.ndarray]]:
    """Per epoch, per source: the chosen doc_ids (a document repeated once per time it is trained)."""
    tgt = targets(sources, lengths, max_repeats)
    out: list[list[np.ndarray]] = [[] for _ in range(epochs)]
    for s, target in zip(sources, tgt):
        keys = carve_keys(content_hashes[s.doc_ids], source_seed(seed, s.source.name))
        order = np.argsort(keys)  # numpy's SIMD quicksort: ~5x a stable sort of uint64
        ordered = keys[order]
        if (ordered[1:] == ordered[:-1]).any():
            # copies share a key: a stable sort orders them by doc_id (ascending here), whatever the quicksort did
            order = np.argsort(keys, kind="stable")
        order = s.doc_ids[order]
        cum = np.cumsum(lengths[order])
        start = 0
        for e in range(epochs):
            end = _boundary(cum, (e + 1) * target)
            n = len(order)
            # within one pass a slice; across passes a gather of the cyclic positions
            out[e].append(order[start % n : end % n] if start // n == end // n else order[np.arange(start, end) % n])
            start = end
    return out


def mixture_record(
    sources: list[SourceDocs],
    chosen: list[list[np.ndarray]],
    lengths: np.ndarray,
    loss: np.ndarray,
    seed: int,
    max_repeats: float,
) -> PlanMixture:
    """plan.json's `mixture`: per source its setting and, per epoch, the documents, tokens and loss tokens."""
    tgt = targets(sources, lengths, max_repeats)
    rows = []
    for i, s in enumerate(sources):
        total = int(lengths[s.doc_ids].sum())
        per_epoch = []
        lo = int(s.doc_ids[0])
        for e in range(len(chosen)):
            ids = chosen[e][i]
            # counts over the source's doc_id range: the sorted multiset without a sort (O(range))
            counts = np.bincount(ids - lo, minlength=int(s.doc_ids[-1]) - lo + 1)
            span = slice(lo, lo + len(counts))
            per_epoch.append(
                MixtureEpoch(
                    docs=len(ids),
                    distinct_docs=int(np.count_nonzero(counts)),
                    tokens=int(np.dot(counts, lengths[span])),
                    loss_tokens=int(np.dot(counts, loss[span])),
                    doc_ids_sha256=counts_sha256(counts, lo),
                )
            )
        rows.append(
            MixtureSource(
                **s.source.spec(),
                train_docs=len(s.doc_ids),
                train_tokens=total,
                target_tokens_per_epoch=float(round(tgt[i], 3)),
                repeats=float(round(tgt[i] / total, 4)),
                per_epoch=tuple(per_epoch),
            )
        )
    return PlanMixture(seed=seed, max_repeats=max_repeats, sources=tuple(rows))


def counts_sha256(counts: np.ndarray, first: int) -> str:
    """sha256 of the sorted doc_ids (little-endian int64), repeats included, from each doc_id's count (doc_id
    first + i is counts[i]): what a source's epoch holds; the gate hashes its packs' counts the same way."""
    ids = np.repeat(np.arange(first, first + len(counts), dtype="<i8"), counts)
    return hashlib.sha256(ids.tobytes()).hexdigest()

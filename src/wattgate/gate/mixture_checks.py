"""A weighted mixture's proofs (pack/mixture.py): per source and epoch, the packs hold what plan.json records.

For every source and epoch, from the packs' per-document counts alone (one bincount, then slices):
- the documents, tokens and loss tokens equal plan.json's `mixture` record, and the multiset of doc_ids
  hashes to its `doc_ids_sha256` (every chosen document its planned number of times, nothing else);
- whole documents repeat evenly (counts differ by at most one between a source's documents: a stretch of
  its cyclic order);
- the tokens lie within one document (the source's longest) of the target its weight, epochs or
  max_tokens gives (recomputed here from the config and the shards).
Also: documents that appear in two sources (same content_hash) are named; leakage counts them once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from wattgate.data.mixture import is_mixture, parse_sources
from wattgate.errors import InputError
from wattgate.records.manifest import Manifest
from wattgate.records.plan import Plan, PlanMixture
from wattgate.records.run_config import RunConfig


@dataclass(frozen=True)
class MixtureInputs:
    names: list[str]
    first: np.ndarray  # doc_id ranges [first, end) per source
    end: np.ndarray
    targets: np.ndarray  # tokens per epoch the config asks of each source
    longest: np.ndarray  # the longest training document of each source (the tolerance of its share)
    record: PlanMixture  # plan.json's `mixture` (no sources when the plan has none)
    problems: tuple[str, ...]


def mixture_inputs(config: RunConfig, manifest: Manifest, plan: Plan, doc_tokens: np.ndarray, held: np.ndarray):
    """What the per-source checks compare against (None: no mixture in the config nor the plan)."""
    record = plan.mixture
    if not is_mixture(config) and record is None:
        return None
    problems = []
    if record is None:
        problems.append("data.inputs is a mixture but plan.json has no mixture record; rerun pack")
        record = PlanMixture(seed=0, max_repeats=0, sources=())
    if not is_mixture(config):
        problems.append("plan.json records a mixture but data.inputs is a plain list; rerun pack")
    try:
        sources = parse_sources(config)
    except InputError as exc:
        return MixtureInputs(
            [], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), record, (str(exc),)
        )
    ranges = {r.name: r for r in manifest.source_docs or ()}
    names, first, end, totals = [], [], [], []
    for s in sources:
        r = ranges.get(s.name)
        bounds = (r.first_doc, r.end_doc) if r is not None else (None, None)
        if r is None or not all(0 <= b <= len(doc_tokens) for b in (r.first_doc, r.end_doc)):
            problems.append(
                f"source {s.name!r} has no doc_id range in manifest.json's source_docs "
                f"(first_doc/end_doc {bounds[0]!r}/{bounds[1]!r}); rerun pretokenize"
            )
            continue
        names.append(s.name)
        first.append(r.first_doc)
        end.append(r.end_doc)
    first_a, end_a = np.asarray(first, np.int64), np.asarray(end, np.int64)
    longest = np.zeros(len(names))
    for i in range(len(names)):
        train = ~held[first_a[i] : end_a[i]]
        t = doc_tokens[first_a[i] : end_a[i]][train]
        totals.append(float(t.sum()))
        longest[i] = float(t.max(initial=0))
    by_name = {s.name: s for s in sources}
    weighted = [i for i, n in enumerate(names) if by_name[n].kind == "weight"]
    weight_sum = sum(by_name[names[i]].value for i in weighted)
    weighted_tokens = sum(totals[i] for i in weighted)
    targets = np.zeros(len(names))
    for i, n in enumerate(names):
        s = by_name[n]
        targets[i] = (
            s.value / weight_sum * weighted_tokens
            if s.kind == "weight"
            else s.value * totals[i]
            if s.kind == "epochs"
            else min(float(s.value), totals[i])
        )
    return MixtureInputs(names, first_a, end_a, targets, longest, record, tuple(problems))


def epoch_problems(
    mix: MixtureInputs, epoch: int, seen: np.ndarray, doc_tokens: np.ndarray, doc_loss: np.ndarray, held: np.ndarray
) -> list[str]:
    """What is wrong with one epoch's per-source counts (`seen`: times each doc_id is packed in the epoch)."""
    problems = []
    recorded = {r.name: r for r in mix.record.sources}
    covered = np.zeros(len(seen), dtype=bool)
    for i, name in enumerate(mix.names):
        lo, hi = int(mix.first[i]), int(mix.end[i])
        covered[lo:hi] = True
        # over the whole range: a held-out document's count is 0 unless packed, which the caller's held-out
        # check names (and which then also changes the hash below)
        c = seen[lo:hi]
        ids = np.arange(lo, hi, dtype=np.int64)
        docs, tokens, loss = int(c.sum()), int(np.dot(c, doc_tokens[lo:hi])), int(np.dot(c, doc_loss[lo:hi]))
        per_epoch = recorded[name].per_epoch if name in recorded else ()
        want = per_epoch[epoch] if epoch < len(per_epoch) else None
        where = f"epoch {epoch}: source {name!r}"
        if want is None:
            problems.append(f"{where}: plan.json's mixture records no such source or epoch; rerun pack")
            continue
        got = (docs, tokens, loss)
        planned = (want.docs, want.tokens, want.loss_tokens)
        if got != planned:
            problems.append(
                f"{where}: packs hold {docs} documents ({tokens} tokens, {loss} with loss), plan.json records "
                f"{planned[0]} ({planned[1]} tokens, {planned[2]} with loss); rerun pack"
            )
        elif hashlib.sha256(np.repeat(ids, c).astype("<i8").tobytes()).hexdigest() != want.doc_ids_sha256:
            problems.append(
                f"{where}: the packed documents are not the planned ones (doc_ids_sha256 differs); rerun pack"
            )
        h = held[lo:hi]
        c = c[~h] if h.any() else c  # repeats are even over the source's training documents
        ids = ids[~h] if h.any() else ids
        if len(c) and int(c.max()) - int(c.min()) > 1:
            worst = int(ids[np.argmin(c)])
            problems.append(
                f"{where}: repeats uneven ({int(c.min())} to {int(c.max())} per document, e.g. doc_id {worst} "
                f"x{int(c.min())}); a source repeats whole documents in turn"
            )
        if abs(tokens - mix.targets[i]) > mix.longest[i] + 1:
            problems.append(
                f"{where}: {tokens} tokens, target {mix.targets[i]:.0f} from data.inputs (more than one document, "
                f"{int(mix.longest[i])} tokens, off); rerun pack"
            )
    stray = np.flatnonzero((seen > 0) & ~covered & ~held)
    if stray.size:
        problems.append(f"epoch {epoch}: {stray.size} packed document(s) of no source, e.g. doc_id {int(stray[0])}")
    return problems


def cross_source_duplicates(mix: MixtureInputs, hashes: np.ndarray) -> str:
    """A note naming documents whose content appears in two sources ('' when none): one argsort of the content
    hashes (numpy's SIMD sort, ~20 ms at 1M) puts copies side by side."""
    if len(mix.names) < 2:
        return ""
    order = np.argsort(hashes)
    same = np.flatnonzero(hashes[order[1:]] == hashes[order[:-1]])
    if not same.size:
        return ""
    a, b = order[same], order[same + 1]
    src_a, src_b = np.searchsorted(mix.end, a, side="right"), np.searchsorted(mix.end, b, side="right")
    cross = (src_a != src_b) & (src_a < len(mix.names)) & (src_b < len(mix.names))
    if not cross.any():
        return ""
    count = len(np.unique(hashes[a[cross]]))
    i = int(np.flatnonzero(cross)[0])
    x, y = sorted((int(a[i]), int(b[i])))
    name = lambda d: mix.names[int(np.searchsorted(mix.end, d, side="right"))]  # noqa: E731
    return (
        f"{count} document(s) appear in two sources (counted once), e.g. doc_id {x} of {name(x)!r} = "
        f"doc_id {y} of {name(y)!r}"
    )


def mixture_markdown(record: PlanMixture) -> list[str]:
    """gate.md's mixture table: per source its setting, planned share, tokens and repeats per epoch."""
    rows = record.sources
    if not rows:
        return []
    epochs = max(len(r.per_epoch) for r in rows)
    lines = ["", "## Mixture", ""]
    lines += ["| source | setting | target share | planned share | tokens per epoch | repeats | documents |"]
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    target_total = sum(r.target_tokens_per_epoch for r in rows) or 1.0
    total = [sum(r.per_epoch[e].tokens for r in rows if e < len(r.per_epoch)) for e in range(epochs)]
    for r in rows:
        per = r.per_epoch
        kind, value = r.setting
        shares = " / ".join(f"{p.tokens / max(total[e], 1):.4f}" for e, p in enumerate(per))
        tokens = " / ".join(str(p.tokens) for p in per)
        docs = " / ".join(str(p.docs) for p in per)
        target = r.target_tokens_per_epoch / target_total
        lines.append(f"| {r.name} | {kind} {value} | {target:.4f} | {shares} | {tokens} | {r.repeats} | {docs} |")
    return lines + ["", "Per epoch, separated by /; repeats: passes over the source's training tokens per epoch."]

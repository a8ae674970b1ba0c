"""The gate's `conservation` check: each document exactly once per epoch, or dropped as pack.remainder allows
(a mixture: as many times as plan.json's mixture record plans it); token sums match the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from wattgate.gate.checks import Check, _listed
from wattgate.gate.inputs import PackRows
from wattgate.gate.mixture_checks import MixtureInputs, epoch_problems
from wattgate.pack.remainder import DROP_REASONS, DROPPING_POLICIES
from wattgate.records.plan import DroppedDocs, PlanStats


def remainder_problems(
    policy: str | None,
    dropped: np.ndarray,
    dropped_reasons: Mapping[str, DroppedDocs],
    doc_tokens: np.ndarray,
    packs: PackRows,
    global_batch_packs: int | None,
) -> list[str]:
    """What pack.remainder promises about drops (see pack/remainder.py): rebin and none drop nothing; drop
    drops, with reason 'remainder', the lightest packs beyond the last full global batch."""
    problems = [
        f"unknown drop reason {r!r} (allowed: {', '.join(sorted(DROP_REASONS))})"
        for r in dropped_reasons
        if r not in DROP_REASONS
    ]
    if policy is None or not len(dropped):
        return problems
    if policy not in DROPPING_POLICIES:
        return problems + [f"pack.remainder: {policy} drops no document, plan drops {len(dropped)}; rerun pack"]
    if global_batch_packs and len(packs):
        # fewer than one global batch of packs, each no heavier than the lightest kept pack
        limit = (global_batch_packs - 1) * int(packs.num_tokens.min())
        dropped_tokens = int(doc_tokens[dropped].sum())
        if dropped_tokens > limit:
            problems.append(
                f"pack.remainder: drop drops less than a global batch ({global_batch_packs} packs, "
                f"each no heavier than the lightest kept pack: <= {limit} tokens), plan drops "
                f"{dropped_tokens} tokens; rerun pack"
            )
    return problems


@dataclass(frozen=True, kw_only=True, slots=True)
class Corpus:
    """The pretokenized documents conservation counts: each one's tokens, the manifest's total, each one's loss
    tokens (a mixture's shares; None: zero) and the validation split's doc_ids (`held_out`, which no epoch may
    hold: they are the validation pass's; None: none)."""

    doc_tokens: np.ndarray
    manifest_tokens: int
    doc_loss_tokens: np.ndarray | None = None
    held_out: np.ndarray | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RemainderPolicy:
    """What pack.remainder promises about drops: `policy` (the plan's pack.remainder) and `global_batch_packs`
    (world x micro_batch_size x grad_accum) enforce it; None skips that part (and only checks reasons against
    DROP_REASONS). `config_policy` (the run config's pack.remainder) must equal `policy` when both are given."""

    policy: str | None = None
    global_batch_packs: int | None = None
    config_policy: str | None = None


ANY_REMAINDER = RemainderPolicy()  # no policy to hold the drops to


def check_conservation(
    packs: PackRows,
    epochs: int,
    corpus: Corpus,
    stats: PlanStats,
    remainder: RemainderPolicy = ANY_REMAINDER,
    mixture: MixtureInputs | None = None,
) -> Check:
    """Each training document exactly once per epoch, or dropped as the remainder policy allows (the drops and
    their reasons: plan.json's `stats`); token sums match.

    `mixture` (a weighted mixture, gate/mixture_checks.py): instead of once per epoch, each source's documents
    as many times as plan.json's mixture record plans them, nothing else, and shares within one document.
    """
    doc_tokens, manifest_tokens, held_out = corpus.doc_tokens, corpus.manifest_tokens, corpus.held_out
    dropped_doc_ids, dropped_reasons = stats.dropped_doc_ids, stats.dropped
    policy, global_batch_packs, config_policy = remainder.policy, remainder.global_batch_packs, remainder.config_policy
    name = "conservation"
    n = len(doc_tokens)
    problems = []
    if int(doc_tokens.sum()) != manifest_tokens:
        problems.append(f"shards hold {int(doc_tokens.sum())} tokens, manifest says {manifest_tokens}")
    dropped = np.asarray(dropped_doc_ids, dtype=np.int64)
    if len(dropped) and (dropped.min() < 0 or dropped.max() >= n or len(np.unique(dropped)) != len(dropped)):
        problems.append("dropped_doc_ids out of range or repeated")
        dropped = dropped[(dropped >= 0) & (dropped < n)]
    reasons_total = sum(v.docs or 0 for v in dropped_reasons.values())
    if reasons_total != len(dropped_doc_ids):
        problems.append(f"{len(dropped_doc_ids)} dropped documents but reasons account for {reasons_total}")
    if policy is not None and config_policy is not None and policy != config_policy:
        problems.append(f"plan was made with pack.remainder {policy}, config says {config_policy}; rerun pack")
    problems += remainder_problems(policy, dropped, dropped_reasons, doc_tokens, packs, global_batch_packs)
    ids = packs.doc_ids
    if len(ids) and (ids.min() < 0 or ids.max() >= n):
        return Check(name, False, _listed(problems + [f"doc_id outside 0..{n - 1}"]))
    expected = np.ones(n, dtype=np.int64)
    expected[dropped] = 0
    held = np.zeros(n, dtype=bool)
    if held_out is not None and len(held_out):
        held[held_out[(held_out >= 0) & (held_out < n)]] = True
        expected[held] = 0
    entry_epoch = np.repeat(packs.epoch, packs.docs_per_row)
    if mixture is not None:
        problems += list(mixture.problems)
    for epoch in range(epochs):
        seen = np.bincount(ids[entry_epoch == epoch], minlength=n)
        if mixture is not None:
            loss = corpus.doc_loss_tokens if corpus.doc_loss_tokens is not None else np.zeros(n, dtype=np.int64)
            problems += epoch_problems(mixture, epoch, seen, doc_tokens, loss, held)
            # a mixture's own checks said what is missing or repeated; below only the held-out side is checked
            seen = np.minimum(seen, 1)
            expected = seen
        twice = np.flatnonzero(seen > 1)
        missing = np.flatnonzero((seen == 0) & (expected == 1))
        used_dropped = np.flatnonzero((seen > 0) & (expected == 0))
        if twice.size:
            problems.append(
                f"epoch {epoch}: {twice.size} document(s) more than once, e.g. doc_id {twice[0]} x{seen[twice[0]]}"
            )
        if missing.size:
            problems.append(
                f"epoch {epoch}: {missing.size} document(s) neither packed nor dropped, e.g. doc_id {missing[0]}"
            )
        if used_dropped.size:
            problems.append(f"epoch {epoch}: {used_dropped.size} dropped document(s) packed anyway")
        if (trained_held := int((held & (seen > 0)).sum())) > 0:
            problems.append(f"epoch {epoch}: {trained_held} held-out validation document(s) packed for training")
    if problems:
        return Check(name, False, _listed(problems))
    aside = f"; {int(held.sum())} held out for validation" if held.any() else ""
    if mixture is not None:
        return Check(
            name,
            True,
            f"{len(mixture.names)} sources: every epoch holds each source's planned documents the planned number "
            f"of times, repeats even, tokens within one document of the target, in each of {epochs} epoch(s){aside}",
        )
    kept_tokens = manifest_tokens - int(doc_tokens[dropped].sum()) - int(doc_tokens[held].sum())
    return Check(
        name,
        True,
        f"{n - len(dropped) - int(held.sum())} documents ({kept_tokens} tokens) exactly once in each of "
        f"{epochs} epoch(s); {len(dropped)} dropped with reasons{aside}",
    )

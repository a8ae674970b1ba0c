"""The gate's checks: small pure functions over loaded artifacts, each returning a named verdict.

Names are stable (tests, gate.json readers and people grep for them):
equal_steps, pack_contents, conservation, launch, provenance, fit,
checkpoint_space, balance, schedule, segments, budget and jobs (gate/cost.py), tokenizer (gate/tokenizer_check.py),
weights (gate/weights_check.py), collectives (wattgate/proof).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from wattgate.gate.inputs import PackRows, ShardContent
from wattgate.forecast.walltime import step_rank_costs
from wattgate.gate.memory import GIB, Budget
from wattgate.gate.mixture_checks import MixtureInputs, epoch_problems
from wattgate.pack.remainder import DROP_REASONS, DROPPING_POLICIES
from wattgate.schedule import learning_rate
from wattgate.records.manifest import Manifest
from wattgate.records.plan import DroppedDocs, Plan, PlanStats
from wattgate.records.run_config import RunConfig

MAX_LISTED = 8  # offending items named in a detail line before "..."


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def _listed(items: list[str]) -> str:
    more = f" ... (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return "; ".join(items[:MAX_LISTED]) + more


def _where(packs: PackRows, rows: np.ndarray) -> str:
    r = int(rows[0])
    return (
        f"epoch {packs.epoch[r]} step {packs.step[r]} micro {packs.micro[r]} rank {packs.rank[r]} slot {packs.slot[r]}"
    )


def _per_rank(counts: np.ndarray) -> str:
    return "{" + ", ".join(f"{r}: {int(c)}" for r, c in enumerate(counts)) + "}"


def check_equal_steps(
    packs: PackRows,
    world_size: int,
    epochs: int | list[int],
    micro_batch_size: int,
    grad_accum: int,
    steps_per_epoch: int | dict[int, int],
) -> Check:
    """Every rank runs the same (step, micro) sequence with full micro-batches in every epoch.

    `epochs` and `steps_per_epoch` may list the epochs of one segment of a continued plan and each one's
    step count there (pack/segments.py); an int means epochs 0..epochs-1 of steps_per_epoch steps each."""
    name = "equal_steps"
    epoch_list = list(range(epochs)) if isinstance(epochs, int) else sorted(epochs)
    per_epoch = {e: steps_per_epoch for e in epoch_list} if isinstance(steps_per_epoch, int) else dict(steps_per_epoch)
    if len(packs) == 0:
        return Check(name, False, "the plan has no packs")
    bad_rank = (packs.rank < 0) | (packs.rank >= world_size)
    if bad_rank.any():
        return Check(name, False, f"rank outside 0..{world_size - 1} at {_where(packs, np.flatnonzero(bad_rank))}")
    if set(np.unique(packs.epoch).tolist()) != set(epoch_list):
        return Check(name, False, f"plan has epochs {sorted(set(packs.epoch.tolist()))}, expected {epoch_list}")
    n_micro_max = int(packs.micro.max()) + 1
    n_step_max = int(packs.step.max()) + 1
    # one integer per (epoch, rank, step, micro)
    key = ((packs.epoch * world_size + packs.rank) * n_step_max + packs.step) * n_micro_max + packs.micro
    keys, per_key = np.unique(key, return_counts=True)
    owner = keys // (n_step_max * n_micro_max)  # epoch * world_size + rank
    step_of_key = (keys // n_micro_max) % n_step_max
    problems = []
    for epoch in epoch_list:
        sel_epoch = (owner // world_size) == epoch
        ranks = owner[sel_epoch] % world_size
        micro = np.bincount(ranks, minlength=world_size)
        rank_steps = np.unique(ranks * n_step_max + step_of_key[sel_epoch])
        steps = np.bincount(rank_steps // n_step_max, minlength=world_size)
        packs_per_rank = np.bincount(packs.rank[packs.epoch == epoch], minlength=world_size)
        if micro.min() != micro.max() or steps.min() != steps.max() or packs_per_rank.min() != packs_per_rank.max():
            problems.append(
                f"epoch {epoch}: ranks differ: micro-batches per rank {_per_rank(micro)}, "
                f"optimizer steps {_per_rank(steps)}, packs {_per_rank(packs_per_rank)}"
            )
            continue
        sequences = [
            keys[sel_epoch & (owner % world_size == r)] % (n_step_max * n_micro_max) for r in range(world_size)
        ]
        if any(not np.array_equal(sequences[0], s) for s in sequences[1:]):
            problems.append(f"epoch {epoch}: ranks run different (step, micro) sequences")
        elif steps[0] != per_epoch.get(epoch):
            problems.append(f"epoch {epoch}: {steps[0]} steps, plan.json says {per_epoch.get(epoch)}")
    for field, limit, key_name in (
        (packs.micro, grad_accum, "grad_accum"),
        (packs.step, max(per_epoch.values()), "steps_per_epoch"),
    ):
        outside = np.flatnonzero((field < 0) | (field >= limit))
        if outside.size:
            problems.append(f"index outside 0..{limit - 1} ({key_name}) at {_where(packs, outside)}")
    _, micro_per_step = np.unique(keys // n_micro_max, return_counts=True)  # per (epoch, rank, step)
    if (micro_per_step != grad_accum).any():
        odd = micro_per_step[micro_per_step != grad_accum]
        problems.append(
            f"{odd.size} (rank, step)s with a micro-batch count other than grad_accum {grad_accum} (e.g. {odd[0]})"
        )
    partial = np.flatnonzero(per_key != micro_batch_size)
    if partial.size:
        problems.append(
            f"{partial.size} micro-batch(es) with a pack count other than micro_batch_size "
            f"{micro_batch_size} (first holds {per_key[partial[0]]})"
        )
    if problems:
        return Check(name, False, _listed(problems))
    shown = steps_per_epoch if isinstance(steps_per_epoch, int) else "/".join(str(per_epoch[e]) for e in epoch_list)
    return Check(
        name,
        True,
        f"{world_size} ranks x {shown} steps x {grad_accum} micro-batches "
        f"x {micro_batch_size} packs, identical in all {len(epoch_list)} epoch(s)",
    )


def check_pack_contents(packs: PackRows, seq_len: int, doc_tokens: np.ndarray, doc_loss_tokens: np.ndarray) -> Check:
    """Every pack fits seq_len, holds documents whose lengths match the shards, and carries loss."""
    name = "pack_contents"
    problems = []
    empty = np.flatnonzero(packs.docs_per_row == 0)
    if empty.size:
        problems.append(f"{empty.size} empty pack(s), first at {_where(packs, empty)}")
    over = np.flatnonzero(packs.num_tokens > seq_len)
    if over.size:
        problems.append(
            f"{over.size} pack(s) over seq_len {seq_len}, first {packs.num_tokens[over[0]]} tokens "
            f"at {_where(packs, over)}"
        )
    ids = packs.doc_ids
    if len(ids) and (ids.min() < 0 or ids.max() >= len(doc_tokens)):
        return Check(name, False, _listed(problems + [f"doc_id outside 0..{len(doc_tokens) - 1}"]))
    if not np.array_equal(packs.offsets, packs.length_offsets):
        rows = np.flatnonzero(np.diff(packs.offsets) != np.diff(packs.length_offsets))
        return Check(
            name,
            False,
            _listed(
                problems
                + [
                    f"{rows.size} pack(s) whose doc_ids and doc_lengths lists differ in length, "
                    f"first at {_where(packs, rows)}"
                ]
            ),
        )
    wrong_sum = np.flatnonzero(packs.sum_per_row(packs.doc_lengths) != packs.num_tokens)
    if wrong_sum.size:
        problems.append(
            f"{wrong_sum.size} pack(s) whose num_tokens differs from the sum of doc_lengths, "
            f"first at {_where(packs, wrong_sum)}"
        )
    wrong_len = np.flatnonzero(doc_tokens[ids] != packs.doc_lengths)
    if wrong_len.size:
        d = int(ids[wrong_len[0]])
        problems.append(
            f"{wrong_len.size} doc_lengths differ from the shards, e.g. doc_id {d}: "
            f"{packs.doc_lengths[wrong_len[0]]} vs {doc_tokens[d]}"
        )
    no_loss = np.flatnonzero((packs.sum_per_row(doc_loss_tokens[ids]) == 0) & (packs.docs_per_row > 0))
    if no_loss.size:
        problems.append(f"{no_loss.size} pack(s) without a loss-bearing token, first at {_where(packs, no_loss)}")
    if problems:
        return Check(name, False, _listed(problems))
    return Check(
        name,
        True,
        f"{len(packs)} packs, each 1..{seq_len} tokens with loss; longest "
        f"{int(packs.num_tokens.max()) if len(packs) else 0}",
    )


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


def check_launch(plan: Plan, config: RunConfig) -> Check:
    """The plan was made for the launch that will run it."""
    c, t = config.cluster, config.train
    # (what the plan says, what the config says, where the config says it)
    expected: list[tuple[str, int | None, int, str]] = [
        ("world_size", plan.world_size, c.nodes * c.gpus_per_node, "cluster.nodes x cluster.gpus_per_node"),
        ("micro_batch_size", plan.micro_batch_size, t.micro_batch_size, "train.micro_batch_size"),
        # a plan continuing another world size's run runs its own grad_accum (pack/segments.py), made from the
        # config's
        (
            "grad_accum",
            plan.grad_accum if plan.config_grad_accum is None else plan.config_grad_accum,
            t.grad_accum,
            "train.grad_accum",
        ),
        ("seq_len", plan.seq_len, t.seq_len, "train.seq_len"),
        ("epochs", plan.epochs, t.epochs, "train.epochs"),
    ]
    if plan.validation is not None:
        mbs = t.eval_micro_batch_size or t.micro_batch_size
        expected.append(("eval_micro_batch_size", plan.eval_micro_batch_size, mbs, "train.eval_micro_batch_size"))
    wrong = [f"plan {k} {made} != {src} {v}" for k, made, v, src in expected if made != v]
    if wrong:
        return Check("launch", False, _listed(wrong) + "; rerun pack for this launch")
    return Check(
        "launch",
        True,
        f"world {plan.world_size} = {c.nodes} node(s) x {c.gpus_per_node}, "
        f"micro_batch_size {plan.micro_batch_size}, grad_accum {plan.grad_accum}" + fill_note(plan),
    )


def fill_note(plan: Plan) -> str:
    """How full the packs are, and what caps it: each epoch's packs are rounded up to whole steps of world x
    micro_batch_size x grad_accum, so a corpus small for its world cannot pass plan.json's `efficiency_bound`
    whatever the packing; below that, documents that do not pack tighter."""
    s = plan.stats
    if s is None or s.efficiency is None or s.efficiency_bound is None:
        return ""
    step = plan.world_size * plan.micro_batch_size * plan.grad_accum
    note = f"; packs {s.efficiency:.4f} full"
    if s.efficiency_bound < 0.99:
        note += (
            f" (whole steps of {step} packs cap any plan of these tokens at {s.efficiency_bound:.4f}: the last "
            "step of an epoch is part empty; fewer ranks, a smaller grad_accum or more documents fill it)"
        )
    if s.efficiency < s.efficiency_bound - 0.01:
        note += (
            f" ({s.efficiency_bound:.4f} if the documents packed without a gap: they do not pack tighter, e.g. "
            "many longer than half of seq_len)"
        )
    return note


def check_provenance(
    plan: Plan,
    packs_sha256: str,
    manifest_sha256: str,
    manifest: Manifest,
    model_vocab: int,
    content: ShardContent | None = None,
) -> Check:
    """The plan describes these exact files, the shards hold what the manifest says, and every token id
    exists in the model's embedding. `content` (verify_shards) None: shard bytes not checked."""
    problems = []
    if plan.packs_sha256 != packs_sha256:
        problems.append("packs.parquet changed since it was planned (sha256 differs from plan.json)")
    if plan.pretokenized_manifest_sha256 != manifest_sha256:
        problems.append("the pretokenized data changed since the plan was made (manifest sha256 differs); rerun pack")
    if content is not None:
        problems += list(content.problems)
    max_id = manifest.max_token_id
    if max_id >= model_vocab:
        problems.append(f"largest token id {max_id} does not fit the model's vocab_size {model_vocab}")
    true_max = content.max_token_id if content is not None else None
    if true_max is not None and true_max >= model_vocab:
        problems.append(
            f"the shards hold token id {true_max} >= the model's vocab_size {model_vocab}; rerun "
            "pretokenize with the model's tokenizer"
        )
    if true_max is not None and true_max > max_id:
        problems.append(f"the shards hold token id {true_max}, manifest max_token_id says {max_id}; rerun pretokenize")
    if manifest.vocab_size is not None and manifest.vocab_size > model_vocab:
        problems.append(f"tokenizer has {manifest.vocab_size} tokens, model embeds {model_vocab}")
    if problems:
        return Check("provenance", False, _listed(problems))
    shown = true_max if true_max is not None else max_id
    shards = (
        ""
        if content is None
        else f"; {content.shards} shard hashes match ({content.algorithm}), lengths verified {content.scope}"
    )
    return Check(
        "provenance", True, f"packs and manifest hashes match{shards}; max token id {shown} < vocab {model_vocab}"
    )


FIT_HINTS = {
    "load": "more GPUs shard the fp32 parameters further",
    "steady": "try train.activation_checkpointing, a smaller micro batch, or more GPUs",
    "export": "more GPUs shard the parameters and AdamW state further",
    "host_per_node": "fewer ranks per node, or set cluster.host_mem_gib to what the nodes have",
}


def _budget_text(budget: Budget, headroom: float) -> str:
    assert budget.bytes is not None  # check_fit words only the budgets it checked
    usable = budget.bytes * (1 - headroom)
    return f"{usable / GIB:.1f} GiB usable ({budget.bytes / GIB:.1f} GiB from {budget.source}, {headroom:.0%} headroom)"


def check_fit(phases: dict[str, dict[str, int]], budgets: dict[str, Budget], headroom: float) -> Check:
    """Estimated peak of every phase (device per rank: load, steady, export; host per node) within its budget.

    A phase whose budget is unknown (bytes None) is reported as not checked and does not fail.
    """
    over, fits, unchecked = [], {}, []
    for phase, terms in phases.items():
        budget, total = budgets[phase], sum(terms.values())
        if budget.bytes is None:
            unchecked.append(f"{phase} {total / GIB:.1f} GiB per {budget.per} {budget.source}")
        elif total > budget.bytes * (1 - headroom):
            biggest = max(terms, key=terms.__getitem__)
            over.append(
                f"{phase}: estimated peak {total / GIB:.1f} GiB per {budget.per} > "
                f"{_budget_text(budget, headroom)}; largest term {biggest} {terms[biggest] / GIB:.1f} GiB "
                f"({FIT_HINTS.get(phase, 'more GPUs')})"
            )
        else:
            fits.setdefault(budget, []).append(f"{phase} {total / GIB:.1f}")
    if over:
        fitting = [f"{', '.join(items)} GiB per {budget.per}" for budget, items in fits.items()]
        rest = ([f"fits: {', '.join(fitting)}"] if fitting else []) + unchecked
        return Check("fit", False, "; ".join(over + rest))
    fitting = [
        f"{', '.join(items)} GiB per {budget.per} of {_budget_text(budget, headroom)}" for budget, items in fits.items()
    ]
    return Check("fit", True, "; ".join(fitting + unchecked))


def check_checkpoint_space(checkpoint_bytes: int, keep: int, final_bytes: int, free_bytes: int, where: str) -> Check:
    """Room for keep checkpoints (+1 being written before the oldest is deleted) and the final export."""
    need = (keep + 1) * checkpoint_bytes + final_bytes
    detail = (
        f"need {need / GIB:.2f} GiB ({keep}+1 x {checkpoint_bytes / GIB:.2f} GiB checkpoints + "
        f"{final_bytes / GIB:.2f} GiB final), {free_bytes / GIB:.1f} GiB free at {where}"
    )
    return Check("checkpoint_space", need <= free_bytes, detail)


def check_balance(packs: PackRows, world_size: int, attn_weight: float, max_ratio: float) -> Check:
    """max/mean rank cost of every optimizer step within tolerance (no rank a permanent straggler)."""
    if len(packs) == 0 or packs.rank.min() < 0 or packs.rank.max() >= world_size:
        return Check("balance", False, "no packs or ranks out of range (see equal_steps)")
    per_rank, keys = step_rank_costs(packs, world_size, attn_weight)
    ratio = per_rank.max(axis=1) / np.maximum(per_rank.mean(axis=1), 1e-9)
    worst = int(np.argmax(ratio))
    n_steps = int(packs.step.max()) + 1
    detail = (
        f"max/mean rank cost per step: worst {ratio[worst]:.3f} (epoch {keys[worst] // n_steps} step "
        f"{keys[worst] % n_steps}), mean {ratio.mean():.3f}, limit {max_ratio:.3f}"
    )
    return Check("balance", bool(ratio[worst] <= max_ratio), detail)


def check_schedule(plan: Plan, config: RunConfig) -> Check:
    """At least one step; warmup shorter than the run; notes on a checkpoint cadence longer than the run."""
    t = config.train
    planned = plan.segments[-1].end_step if plan.segments else plan.epochs * plan.steps_per_epoch
    max_steps = t.max_steps
    total = min(planned, max_steps) if max_steps else planned  # the trainer stops at train.max_steps
    capped = f" (train.max_steps {max_steps})" if max_steps and max_steps < planned else ""
    problems = []
    if total < 1:
        problems.append("the plan has no optimizer step")
    if t.warmup_steps >= total:
        problems.append(f"train.warmup_steps {t.warmup_steps} >= total steps {total}{capped}")
    late = []  # the loop checkpoints at the last step whatever checkpoint_every says: a smoke run is fine
    if total >= 1 and t.checkpoint_every > total:
        late.append(
            f"train.checkpoint_every {t.checkpoint_every} > total steps {total}{capped}: "
            f"the only checkpoint is the one at the last step ({total})"
        )
    notes = "".join(f"; note: {n}" for n in late + validation_schedule_notes(plan, config, total))
    if problems:
        return Check("schedule", False, _listed(problems) + notes)
    evals = f", validation every {t.eval_every}" if plan.validation is not None and t.eval_every else ""
    return Check(
        "schedule",
        True,
        f"{total} steps{capped}, warmup {t.warmup_steps}, checkpoint every {t.checkpoint_every}{evals}{notes}",
    )


def validation_schedule_notes(plan: Plan, config: RunConfig, total: int) -> list[str]:
    """What the validation schedule will and will not do, for `schedule` (notes: none of these fails)."""
    t = config.train
    notes = []
    has_split = plan.validation is not None
    if t.eval_every and not has_split:
        notes.append(f"train.eval_every {t.eval_every} without data.validation: no validation runs")
    elif has_split and t.eval_every > total:
        notes.append(
            f"train.eval_every {t.eval_every} > total steps {total}: validation only at epoch ends and the last step"
        )
    if t.export_from == "best" and not has_split:
        notes.append("train.export_from best without data.validation: final/ is the last step's")
    return notes


def _steps_of(packs: PackRows) -> int:
    return len(np.unique(packs.epoch * (int(packs.step.max()) + 1) + packs.step)) if len(packs) else 0


def check_segments(plan: Plan, config: RunConfig, packs: PackRows, prefix: PackRows | None, problems: tuple) -> Check:
    """A plan that continues a run on another world size: its segments chain, the prefix is what ran, and the
    learning rate and the tokens per step go on across the boundary (pack/segments.py)."""
    segs = plan.segments
    if not segs:
        return Check("segments", True, "one segment: the plan starts at step 0")
    probs = list(problems)
    if segs[0].first_step != 0:
        probs.append(f"segment 0 starts at step {segs[0].first_step}, not 0")
    for k, (a, b) in enumerate(zip(segs, segs[1:])):
        if a.end_step != b.first_step:
            probs.append(
                f"segment {k} ends at step {a.end_step} but segment {k + 1} starts at "
                f"{b.first_step}: steps would be skipped or repeated"
            )
    boundary, end = segs[-1].first_step, segs[-1].end_step
    if end - boundary != _steps_of(packs):
        probs.append(f"the current segment has {_steps_of(packs)} steps, plan.json says {end - boundary}")
    # counted in packs, segment by segment: step numbers restart in each segment's packs.parquet, so the
    # prefix's (epoch, step) keys of two segments coincide and cannot count its steps
    ran = [(g.end_step - g.first_step) * g.world_size * g.micro_batch_size * g.grad_accum for g in segs[:-1]]
    if prefix is not None and not problems and len(prefix) != sum(ran):
        probs.append(
            f"the consumed prefix holds {len(prefix)} packs, but its segments ran {sum(ran)} before the boundary "
            f"at step {boundary} ({' + '.join(map(str, ran))}: steps x ranks x micro-batch x grad_accum)"
        )
    resumed = plan.resumed_from.step if plan.resumed_from is not None else None
    if resumed != boundary:
        probs.append(f"the checkpoint it continues is at step {resumed}, the boundary at {boundary}")
    if probs:
        return Check("segments", False, _listed(probs))
    # the learning rate: the prefix ran towards its own total; the continuation schedules the new total
    t = config.train
    old_total = end if segs[-2].plan_total_steps is None else segs[-2].plan_total_steps

    def lr(step: int, total: int) -> float:
        return learning_rate(step, total, t.lr, t.warmup_steps, t.min_lr_ratio)

    before, ran, now = lr(boundary - 1, old_total), lr(boundary, old_total), lr(boundary, end)
    jump, step_change = abs(now - ran), abs(ran - before)
    tokens_before = float(prefix.num_tokens.sum()) / max(boundary, 1) if prefix is not None else float("nan")
    tokens_after = float(packs.num_tokens.sum()) / max(_steps_of(packs), 1)
    ratio = tokens_after / tokens_before if tokens_before == tokens_before and tokens_before > 0 else float("nan")
    old, new = segs[-2], segs[-1]
    old_pps = old.world_size * old.micro_batch_size * old.grad_accum
    new_pps = new.world_size * new.micro_batch_size * new.grad_accum
    closest = max(1, round(old_pps / (new.world_size * new.micro_batch_size)))
    detail = (
        f"{len(segs)} segments: steps 0-{boundary} on {old.world_size} ranks (grad_accum "
        f"{old.grad_accum}), {boundary}-{end} on {new.world_size} (grad_accum "
        f"{new.grad_accum}); lr at the boundary {now:.3g} (the prefix's schedule: {ran:.3g}, one step "
        f"before {before:.3g}); tokens per step {tokens_before:.0f} -> {tokens_after:.0f} (x{ratio:.3f}), "
        f"{old_pps} -> {new_pps} packs per step"
    )
    bad = []
    if jump > max(2 * step_change, 1e-6 * t.lr):
        bad.append(f"lr jumps by {jump:.3g} at the boundary (a step moves it {step_change:.3g})")
    if new.grad_accum != closest and new_pps != old_pps:
        bad.append(f"grad_accum {new.grad_accum} is not the closest to the old global batch ({closest})")
    if bad:
        return Check("segments", False, "; ".join(bad) + ": " + detail)
    return Check("segments", True, detail)

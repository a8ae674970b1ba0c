"""The gate's checks: small pure functions over loaded artifacts, each returning a named verdict (`Check`).

Names are stable (tests, gate.json readers and people grep for them): equal_steps, pack_contents, launch,
provenance and balance (here), conservation (gate/conservation_check.py), fit and checkpoint_space
(gate/fit_checks.py), schedule and segments (gate/schedule_checks.py), budget and jobs (gate/cost.py), tokenizer
(gate/tokenizer_check.py), weights (gate/weights_check.py), collectives (wattgate/proof).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wattgate.gate.inputs import PackRows, ShardContent
from wattgate.forecast.walltime import step_rank_costs
from wattgate.records.manifest import Manifest
from wattgate.records.plan import Plan
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


def check_pack_contents(
    packs: PackRows, seq_len: int, doc_tokens: np.ndarray, doc_loss_tokens: np.ndarray, padding_per_epoch: int = 0
) -> Check:
    """Every pack fits seq_len, holds documents whose lengths match the shards, and carries loss. `padding_per_epoch`:
    the empty packs an epoch may hold (a plan of one document per row pads its count to whole steps with them)."""
    name = "pack_contents"
    problems = []
    empty = np.flatnonzero(packs.docs_per_row == 0)
    padding = int(np.bincount(packs.epoch[empty]).max()) if empty.size else 0
    if padding > padding_per_epoch:
        allowed = f" (a plan of one document per row may pad with {padding_per_epoch})" if padding_per_epoch else ""
        problems.append(f"{empty.size} empty pack(s), first at {_where(packs, empty)}{allowed}")
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
    padded = f"; {empty.size} empty padding pack(s), at most {padding} an epoch" if empty.size else ""
    return Check(
        name,
        True,
        f"{len(packs)} packs, each 1..{seq_len} tokens with loss; longest "
        f"{int(packs.num_tokens.max()) if len(packs) else 0}{padded}",
    )


def check_launch(plan: Plan, config: RunConfig) -> Check:
    """The plan was made for the launch that will run it."""
    c, t, context = config.cluster, config.train, config.parallel.context
    # (what the plan says, what the config says, where the config says it); under parallel.context the plan's
    # world is the data-parallel ranks: C ranks share each one's rows
    world_key = "cluster.nodes x cluster.gpus_per_node" + (" / parallel.context" if context > 1 else "")
    expected: list[tuple[str, int | None, int, str]] = [
        ("world_size", plan.world_size, c.nodes * c.gpus_per_node // context, world_key),
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
        f"world {plan.world_size} = {c.nodes} node(s) x {c.gpus_per_node}"
        + (f" / parallel.context {context} (ranks sharing each row)" if context > 1 else "")
        + ", "
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


def check_balance(
    packs: PackRows, world_size: int, attn_weight: float, max_ratio: float, padded_steps_allowed: bool = False
) -> Check:
    """max/mean rank cost of every optimizer step within tolerance (no rank a permanent straggler).

    `padded_steps_allowed` (a plan of one document per row, which pads its last step with empty rows because a
    document cannot be split): a step holding such padding is left out of the bound and named; its ranks idle
    for part of one step, and the equal step count (equal_steps) is what keeps the collectives matched."""
    if len(packs) == 0 or packs.rank.min() < 0 or packs.rank.max() >= world_size:
        return Check("balance", False, "no packs or ranks out of range (see equal_steps)")
    per_rank, keys = step_rank_costs(packs, world_size, attn_weight)
    ratio = per_rank.max(axis=1) / np.maximum(per_rank.mean(axis=1), 1e-9)
    n_steps = int(packs.step.max()) + 1
    padded = ""
    if padded_steps_allowed:
        empty = packs.num_tokens == 0
        left_out = np.isin(keys, packs.epoch[empty] * n_steps + packs.step[empty])
        if left_out.any():
            padded = f"; {int(left_out.sum())} step(s) with empty padding rows left out (one document per row)"
            if left_out.all():
                return Check("balance", True, f"every step holds padding rows{padded}")
            ratio, keys = ratio[~left_out], keys[~left_out]
    worst = int(np.argmax(ratio))
    detail = (
        f"max/mean rank cost per step: worst {ratio[worst]:.3f} (epoch {keys[worst] // n_steps} step "
        f"{keys[worst] % n_steps}), mean {ratio.mean():.3f}, limit {max_ratio:.3f}{padded}"
    )
    return Check("balance", bool(ratio[worst] <= max_ratio), detail)

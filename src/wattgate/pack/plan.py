"""The pack stage: pretokenized manifest -> plan.json + packs.parquet (see docs/architecture.md)."""

from __future__ import annotations

import math
import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path
from wattgate.config import context_degree, data_parallel_size
from wattgate.errors import InputError
from wattgate.pack.assign import Layout, Placement, assign_ranks, pack_costs, rank_cost_ratios, sort_placement
from wattgate.pack.bfd import pack_bfd
from wattgate.pack.planner import plan_packs
from wattgate.pack.remainder import DROP_REASON_REMAINDER, Packs, one_per_pack, pad_with_empty, rebin
from wattgate.pack.segments import (
    HISTORY,
    PlanSettings,
    SegmentRows,
    ResumeSource,
    continue_plan,
    keep_in_history,
    resume_source,
    segment_rows,
    step_ordinal,
)
from wattgate.data.mixture import is_mixture, parse_sources
from wattgate.data.split import read_validation_ids, train_doc_ids
from wattgate.pack.mixture import choose, mixture_record, read_source_docs
from wattgate.pack.validation import ValidationPlan, plan_validation
from wattgate.records.manifest import Manifest
from wattgate.records.plan import PLAN_FORMAT_VERSION, DroppedDocs, Plan, PlanMixture, PlanStats, ResumedFrom, Segment
from wattgate.run_files import (
    run_folder_beside,
    PACKS,
    check_output,
    first_line,
    publish_plan,
    read_manifest,
)
from wattgate.identity import model_train_identity
from wattgate.records.run_config import RunConfig, TrainConfig

FORMAT_VERSION = PLAN_FORMAT_VERSION  # the reader's (run_files): one number

PACKS_SCHEMA = pa.schema(
    [
        ("epoch", pa.int32()),
        ("step", pa.int32()),
        ("micro", pa.int32()),
        ("rank", pa.int32()),
        ("slot", pa.int32()),
        ("doc_ids", pa.list_(pa.int64())),
        ("doc_lengths", pa.list_(pa.int32())),
        ("num_tokens", pa.int32()),
    ]
)

STRATEGY = {"rebin": "bfd+rebin", "drop": "bfd+drop", "none": "per-rank-bfd (uneven control)"}


SHARD_LENGTH_COLUMNS = ("doc_id", "num_tokens")


def read_shard_lengths(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One shard's doc_id and num_tokens columns, refused (InputError naming the shard) unless both are
    integers without nulls and every length is at least 1: pretokenize never writes an empty document."""
    try:
        names = pq.read_schema(path).names
        missing = [c for c in SHARD_LENGTH_COLUMNS if c not in names]
        if missing:
            raise InputError(f"{path}: shard has no {' or '.join(missing)} column; rerun pretokenize")
        t = pq.read_table(path, columns=list(SHARD_LENGTH_COLUMNS))
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot read shard ({first_line(exc)}); rerun pretokenize") from None
    for name in SHARD_LENGTH_COLUMNS:
        column = t.column(name)
        if not pa.types.is_integer(column.type) or column.null_count:
            what = f"{column.null_count} null value(s)" if column.null_count else f"type {column.type}"
            raise InputError(f"{path}: column {name} has {what}, not integers; rerun pretokenize")
    doc_ids = t.column("doc_id").to_numpy().astype(np.int64)
    lengths = t.column("num_tokens").to_numpy().astype(np.int64)
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        first = int(empty[0])
        raise InputError(
            f"{path}: doc_id {doc_ids[first]} has num_tokens {lengths[first]} ({empty.size} document(s) with "
            "num_tokens < 1); rerun pretokenize"
        )
    return doc_ids, lengths


def read_doc_lengths(pretokenized: Path, manifest: Manifest) -> np.ndarray:
    """Token count of every document, indexed by doc_id (which must be dense 0..n-1)."""
    ids, lengths = [], []
    for name in manifest.shards:
        shard_ids, shard_lengths = read_shard_lengths(pretokenized / name)
        ids.append(shard_ids)
        lengths.append(shard_lengths)
    doc_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    n = manifest.num_docs
    if len(doc_ids) != n or not np.array_equal(doc_ids, np.arange(n)):
        raise InputError(
            f"{pretokenized}: shards hold {len(doc_ids)} doc_ids, manifest says {n} dense ids; rerun pretokenize"
        )
    return np.concatenate(lengths).astype(np.int64)


def efficiency_bound(epoch_tokens: list[int], seq_len: int, packs_per_step: int) -> float:
    """The best efficiency (tokens / (packs x seq_len)) any plan of these tokens can have: each epoch needs at least
    ceil(tokens / seq_len) packs, rounded up to whole steps of `packs_per_step` (every rank the same count). A small
    corpus on a wide world pays that rounding: 20k documents at 128 packs a step cannot pass ~0.97."""
    packs = sum(math.ceil(math.ceil(t / seq_len) / packs_per_step) * packs_per_step for t in epoch_tokens)
    return float(sum(epoch_tokens) / (packs * seq_len)) if packs else 1.0


def plan_stats(placement, lengths, tokens, costs, layout: Layout, seq_len: int, dropped_docs) -> PlanStats:
    W = layout.world_size
    per_rank_tokens = np.bincount(placement.rank, weights=tokens[placement.pack], minlength=W).astype(np.int64)
    per_rank_packs = np.bincount(placement.rank, minlength=W)
    epochs = int(placement.epoch.max()) + 1
    micro_key = placement.step * (int(placement.micro.max()) + 1) + placement.micro
    per_rank_micro, per_rank_steps = [], []
    for r in range(W):
        sel = placement.rank == r
        per_rank_micro.append([len(np.unique(micro_key[sel & (placement.epoch == e)])) for e in range(epochs)])
        per_rank_steps.append([len(np.unique(placement.step[sel & (placement.epoch == e)])) for e in range(epochs)])
    dropped = {}
    if len(dropped_docs):
        dropped[DROP_REASON_REMAINDER] = DroppedDocs(docs=len(dropped_docs), tokens=int(lengths[dropped_docs].sum()))
    ratios = rank_cost_ratios(placement, costs, W)
    return PlanStats(
        num_docs=len(lengths),
        num_tokens=int(lengths.sum()),
        packs_per_epoch=len(tokens),
        efficiency=float(tokens.sum() / (len(tokens) * seq_len)),
        efficiency_bound=efficiency_bound([int(tokens.sum())], seq_len, layout.packs_per_step),
        per_rank_tokens=tuple(per_rank_tokens.tolist()),
        per_rank_packs=tuple(per_rank_packs.tolist()),
        per_rank_micro_batches_per_epoch=tuple(tuple(m) for m in per_rank_micro),
        per_rank_steps_per_epoch=tuple(tuple(s) for s in per_rank_steps),
        dropped=dropped,
        dropped_doc_ids=tuple(int(d) for d in dropped_docs),
        max_rank_cost_ratio_step=ratios.max_step,
        mean_rank_cost_ratio_step=ratios.mean_step,
        max_rank_cost_ratio_micro=ratios.max_micro,
        mean_rank_cost_ratio_micro=ratios.mean_micro,
    )


def plan_subset(
    doc_ids: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    layout: Layout,
    remainder: str,
    epochs: int,
    seed: int,
    attn_weight: float,
):
    """plan_packs over the documents `doc_ids` (the training side of the split); packs name manifest doc ids."""
    packs, placement, tokens, costs = plan_packs(
        lengths[doc_ids], seq_len, layout, remainder, epochs, seed, attn_weight
    )
    packs = Packs(
        docs=doc_ids[packs.docs],
        offsets=packs.offsets,
        dropped_docs=np.sort(doc_ids[packs.dropped_docs]),
        rank_of_pack=packs.rank_of_pack,
    )
    return packs, placement, tokens, costs


def plan_epochs(
    chosen: list[np.ndarray],
    lengths: np.ndarray,
    seq_len: int,
    layout: Layout,
    remainder: str,
    seed: int,
    attn_weight: float,
):
    """A mixture's plan: each epoch's chosen documents (repeats included) packed and placed on their own.

    When every epoch holds the same documents the ordinary planner runs once (as for a plain list); else each
    epoch is planned with a seed of its own and the epochs' packs are numbered one after another."""
    # each epoch's doc_ids in ascending order from their counts (O(n), no sort): the packing then sees one
    # order whatever the sources' stream order
    counts = [np.bincount(c, minlength=len(lengths)) for c in chosen]
    if all(np.array_equal(c, counts[0]) for c in counts[1:]):
        first = np.repeat(np.arange(len(lengths), dtype=np.int64), counts[0])
        return plan_subset(first, lengths, seq_len, layout, remainder, len(chosen), seed, attn_weight)
    chosen = [np.repeat(np.arange(len(lengths), dtype=np.int64), c) for c in counts]
    parts = []
    if remainder == "rebin":
        # every epoch gets the same pack count, so the same steps (the schedule and equal_steps take one
        # steps_per_epoch): BFD per epoch, then rebin each up to the largest count's global-batch multiple
        per_step = layout.packs_per_step
        sorted_docs = chosen
        bfd = [first_packs(lengths[d], seq_len, layout.one_document_rows) for d in sorted_docs]
        count = max(-(-len(b) // per_step) * per_step for b in bfd)
        for e, (docs, b) in enumerate(zip(sorted_docs, bfd)):
            sub = lengths[docs]
            # one document per row: nothing to move, padding packs make up the count
            packs = pad_with_empty(b, count - len(b)) if layout.one_document_rows else rebin(b, sub, per_step, count)
            tokens = packs.sum_per_pack(sub)
            costs = pack_costs(tokens, packs.sum_per_pack(sub**2), attn_weight)
            placement = assign_ranks(costs, layout, 1, seed * 1_000_003 + e)
            parts.append((docs, packs, placement, tokens, costs))
    else:  # `none`, the uneven control: per epoch as it comes
        for e, docs in enumerate(chosen):
            parts.append(
                (docs,) + plan_packs(lengths[docs], seq_len, layout, remainder, 1, seed * 1_000_003 + e, attn_weight)
            )
    base, doc_base = 0, 0
    docs_out, offsets_out, owner, tokens, costs, placements = [], [np.zeros(1, np.int64)], [], [], [], []
    for e, (docs, packs, placement, tok, cost) in enumerate(parts):
        docs_out.append(docs[packs.docs])
        offsets_out.append(packs.offsets[1:] + doc_base)
        doc_base += int(packs.offsets[-1])
        if packs.rank_of_pack is not None:
            owner.append(packs.rank_of_pack)
        placements.append(
            (
                placement.pack + base,
                np.full(len(placement.pack), e),
                *(getattr(placement, f) for f in ("step", "micro", "rank", "slot")),
            )
        )
        tokens.append(tok)
        costs.append(cost)
        base += len(packs)
    packs = Packs(
        docs=np.concatenate(docs_out),
        offsets=np.concatenate(offsets_out),
        rank_of_pack=np.concatenate(owner) if owner else None,
    )
    placement = sort_placement(Placement(*[np.concatenate(c) for c in zip(*placements)]))
    return packs, placement, np.concatenate(tokens), np.concatenate(costs)


def first_packs(lengths: np.ndarray, seq_len: int, one_document_rows: bool) -> Packs:
    """The documents packed before the remainder policy: by BFD, or each in a pack of its own."""
    if one_document_rows:
        return one_per_pack(len(lengths))
    return Packs.from_assignment(pack_bfd(lengths, seq_len))


def one_document_rows(config: RunConfig) -> tuple[bool, str]:
    """(whether each row holds one document, why) from pack.documents_per_row; `auto` asks transformers which of
    the model's layers carry a recurrent state (a model it cannot build packs many: the gate names it)."""
    setting = config.pack.documents_per_row
    if setting != "auto":
        return setting == "one", f"pack.documents_per_row {setting}"
    from wattgate.hf_config import model_hf_config, recurrent_layers

    try:
        layers = recurrent_layers(model_hf_config(config.model))
    except Exception as exc:  # noqa: BLE001 - document_isolation in the gate fails such a model, naming why
        why = first_line(exc)
        return False, f"pack.documents_per_row auto: which layers carry a recurrent state is unknown ({why})"
    if not layers:
        return False, "pack.documents_per_row auto: every layer attends"
    shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    carry = "carries" if len(layers) == 1 else "carry"
    return True, f"pack.documents_per_row auto: {shown} {carry} a recurrent state across documents"


def check_context_model(config: RunConfig) -> None:
    """One line before any planning when parallel.context cannot run the model (hf_config.context_refusal)."""
    if context_degree(config) == 1:
        return
    from wattgate.hf_config import context_refusal, model_hf_config

    line = context_refusal(model_hf_config(config.model), context_degree(config))
    if line:
        raise InputError(line)


def read_doc_extras(pretokenized: Path, manifest: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """content_hash and num_loss_tokens of every document by doc_id: what a mixture's choice and record need."""
    hashes, loss = [], []
    for name in manifest.shards:
        path = pretokenized / name
        try:
            t = pq.read_table(path, columns=["content_hash", "num_loss_tokens"])
        except (OSError, pa.ArrowException, KeyError) as exc:
            raise InputError(
                f"{path}: no content_hash or num_loss_tokens column ({first_line(exc)}); rerun pretokenize"
            ) from None
        hashes.append(t.column("content_hash").to_numpy().astype(np.int64))
        loss.append(t.column("num_loss_tokens").to_numpy().astype(np.int64))
    return np.concatenate(hashes), np.concatenate(loss)


def mixture_choice(
    config: RunConfig, pretokenized: Path, manifest: Manifest, lengths: np.ndarray, held_out: np.ndarray
) -> tuple[list[np.ndarray], PlanMixture]:
    """(per-epoch chosen doc_ids, plan.json's `mixture`) for a mixture config; one-line errors."""
    if config.pack.remainder == "drop":
        raise InputError(
            "pack.remainder: drop would take documents from a mixture's shares after they were chosen; "
            "use rebin with a mixture (data.inputs mappings)"
        )
    sources = read_source_docs(manifest, parse_sources(config), held_out, str(pretokenized))
    hashes, loss = read_doc_extras(pretokenized, manifest)
    seed, max_repeats, epochs = config.pack.seed, config.data.max_repeats, config.train.epochs
    chosen = choose(sources, lengths, hashes, epochs, seed, max_repeats)
    record = mixture_record(sources, chosen, lengths, loss, seed, max_repeats)
    return [np.concatenate(c) for c in chosen], record


def eval_micro_batch_size(train: TrainConfig) -> int:
    """train.eval_micro_batch_size, defaulting to train.micro_batch_size."""
    return train.eval_micro_batch_size or train.micro_batch_size


def validation_section(held_out: np.ndarray, lengths: np.ndarray, settings: PlanSettings) -> ValidationPlan | None:
    """The validation pass's packs and plan.json's `validation` (its `stats`; packs_sha256 added on publish),
    or None without held-out documents."""
    if not len(held_out):
        return None
    return plan_validation(
        held_out,
        lengths,
        settings.seq_len,
        settings.world_size,
        settings.eval_micro_batch_size,
        settings.seed,
        settings.attn_weight,
        one_document_rows=settings.max_documents_per_row == 1,
    )


def build_plan(config: RunConfig, pretokenized: str | Path, out: str | Path) -> Plan:
    pretokenized, out = Path(pretokenized), Path(out)
    check_output(out, "pack")  # before any work: a folder pack did not write is refused, never written into
    manifest, manifest_raw = read_manifest(pretokenized)
    manifest_sha = hashlib.sha256(manifest_raw).hexdigest()
    lengths = read_doc_lengths(pretokenized, manifest)
    held_out = read_validation_ids(pretokenized, manifest)
    train_ids = train_doc_ids(len(lengths), held_out)
    train, pack = config.train, config.pack
    seq_len = train.seq_len
    if len(lengths) and lengths.max() > seq_len:
        worst = int(np.argmax(lengths))
        raise InputError(
            f"{pretokenized}: doc_id {worst} has {lengths[worst]} tokens > train.seq_len {seq_len}; "
            "rerun pretokenize with pretokenize.max_tokens <= seq_len"
        )
    check_context_model(config)
    one_rows, why = one_document_rows(config)
    if one_rows:
        print(f"pack: one document per row ({why})", flush=True)
    layout = Layout(data_parallel_size(config), train.micro_batch_size, train.grad_accum, one_rows)
    settings = PlanSettings(
        world_size=layout.world_size,
        seq_len=seq_len,
        micro_batch_size=layout.micro_batch_size,
        eval_micro_batch_size=eval_micro_batch_size(train),
        epochs=train.epochs,
        remainder=pack.remainder,
        seed=pack.seed,
        attn_weight=pack.attn_weight,
        pretokenized_manifest_sha256=manifest_sha,
        max_documents_per_row=1 if one_rows else None,
    )
    # a run with checkpoints of an earlier plan that differs only in the world size goes on from them
    checkpoints = run_folder_beside(out, config.run_name) / "checkpoints"
    vplan = validation_section(held_out, lengths, settings)
    chosen, mixture = (
        mixture_choice(config, pretokenized, manifest, lengths, held_out) if is_mixture(config) else (None, None)
    )
    source = resume_source(out, checkpoints, settings, lambda: model_train_identity(config))
    if isinstance(source, ResumeSource):
        return build_continued_plan(
            out,
            settings,
            source,
            lengths=lengths,
            layout=layout,
            vplan=vplan,
            held_out=held_out,
            mixture=(chosen, mixture),
        )
    if source != "no complete checkpoint":
        print(f"pack: not continuing from {checkpoints}: {source}; the new plan starts over", flush=True)
    if chosen is not None:
        packs, placement, tokens, costs = plan_epochs(
            chosen, lengths, seq_len, layout, pack.remainder, pack.seed, pack.attn_weight
        )
    else:
        packs, placement, tokens, costs = plan_subset(
            train_ids, lengths, seq_len, layout, pack.remainder, train.epochs, pack.seed, pack.attn_weight
        )

    stats = plan_stats(placement, lengths[train_ids], tokens, costs, layout, seq_len, packs.dropped_docs)
    if chosen is not None:  # a mixture's epochs may differ: its packs and efficiency over the whole plan
        stats = stats.replace(
            packs_per_epoch=len(placement.pack) // train.epochs,
            efficiency=float(tokens[placement.pack].sum() / (len(placement.pack) * seq_len)),
            efficiency_bound=efficiency_bound(
                [int(tokens[placement.pack[placement.epoch == e]].sum()) for e in range(train.epochs)],
                seq_len,
                layout.packs_per_step,
            ),
        )
    if packs.dropped_docs.size:
        entry = stats.dropped[DROP_REASON_REMAINDER].replace(tokens=int(lengths[packs.dropped_docs].sum()))
        stats = stats.replace(dropped={**stats.dropped, DROP_REASON_REMAINDER: entry})
    plan = Plan(
        world_size=layout.world_size,
        seq_len=seq_len,
        micro_batch_size=layout.micro_batch_size,
        eval_micro_batch_size=settings.eval_micro_batch_size,
        grad_accum=layout.grad_accum,
        epochs=train.epochs,
        steps_per_epoch=int(placement.step.max()) + 1,
        strategy=STRATEGY[pack.remainder],
        remainder=pack.remainder,
        seed=pack.seed,
        attn_weight=pack.attn_weight,
        pretokenized_manifest_sha256=manifest_sha,
        packs_sha256=None,  # set from the written file in publish_plan
        stats=stats,
        validation=vplan.stats if vplan is not None else None,
        mixture=mixture,
        max_documents_per_row=settings.max_documents_per_row,
    )
    plan = publish_plan(
        out, plan, lambda tmp: write_packs_table(tmp, placement, packs, lengths, tokens), eval_writer(vplan, lengths)
    )
    keep_in_history(out, plan)
    return plan


def build_continued_plan(
    out: Path,
    settings: PlanSettings,
    source: ResumeSource,
    lengths: np.ndarray,
    layout: Layout,
    vplan: ValidationPlan | None = None,
    held_out: tuple | np.ndarray = (),
    mixture: tuple = (None, None),
) -> Plan:
    """The consumed prefix of the plan `source` ran (kept in history/) and the rest for the new world size, as
    one plan; the validation pass re-planned for the new ranks. `layout`: the config's (its grad_accum is
    plan.json's config_grad_accum). `mixture`: a mixture's per-epoch chosen documents and plan.json record:
    later epochs are re-packed from exactly those, so every source keeps its counts."""
    found, old, old_folder = source.checkpoint, source.plan, source.folder
    cols, info = continue_plan(source, lengths, layout, held_out, chosen=mixture[0])
    boundary, ga = info.first_step, info.grad_accum
    ordinal = step_ordinal(cols.epoch, cols.step)
    n_new = int(ordinal.max()) + 1
    step_epoch = np.zeros(n_new, np.int64)
    step_epoch[ordinal] = cols.epoch
    new_ends = [boundary + g + 1 for g in range(n_new) if g + 1 == n_new or step_epoch[g + 1] != step_epoch[g]]
    old_rows = segment_rows(old_folder)
    old_ord = step_ordinal(old_rows.epoch, old_rows.step)
    first_old = info.segments[-1].first_step
    old_epoch = np.zeros(int(old_ord.max()) + 1, np.int64)
    old_epoch[old_ord] = old_rows.epoch
    prior_ends = [e for e in old.epoch_ends or () if e <= first_old]
    prior_ends += [
        first_old + g + 1
        for g in range(len(old_epoch) - 1)
        if old_epoch[g + 1] != old_epoch[g] and first_old + g + 1 < boundary
    ]
    assert old.packs_sha256 is not None  # a plan in history/ is a published one (resume_source checked its hash)
    segments = [
        *info.segments[:-1],
        info.segments[-1].replace(
            packs=f"{HISTORY}/{old.packs_sha256[:16]}/{PACKS}",
            packs_sha256=old.packs_sha256,
            end_step=boundary,
            plan_total_steps=first_old + len(old_epoch),  # what its LR schedule ran towards
        ),
        Segment(
            packs=PACKS,
            world_size=layout.world_size,
            grad_accum=ga,
            micro_batch_size=layout.micro_batch_size,
            first_step=boundary,
            end_step=boundary + n_new,
        ),
    ]
    old_pps = info.old_world_size * layout.micro_batch_size * info.old_grad_accum
    new_pps = layout.world_size * layout.micro_batch_size * ga
    change = (
        f"world size {info.old_world_size} -> {layout.world_size}: grad_accum {info.old_grad_accum} -> "
        f"{ga} keeps the global batch at {new_pps} packs of {settings.seq_len} tokens per step"
        + ("" if new_pps == old_pps else f" (was {old_pps}: the closest the new world size allows)")
        + f"; {info.how}"
    )
    seg_steps = {int(e): len(np.unique(cols.step[cols.epoch == e])) for e in np.unique(cols.epoch)}
    tokens = cols.num_tokens
    plan = Plan(
        world_size=settings.world_size,
        seq_len=settings.seq_len,
        micro_batch_size=settings.micro_batch_size,
        eval_micro_batch_size=settings.eval_micro_batch_size,
        epochs=settings.epochs,
        remainder=settings.remainder,
        seed=settings.seed,
        attn_weight=settings.attn_weight,
        pretokenized_manifest_sha256=settings.pretokenized_manifest_sha256,
        grad_accum=ga,
        config_grad_accum=layout.grad_accum,
        steps_per_epoch=max(seg_steps.values()),
        segment_steps={str(e): n for e, n in seg_steps.items()},
        epoch_ends=tuple(sorted(set(prior_ends) | set(new_ends))),
        strategy=STRATEGY[settings.remainder],
        packs_sha256=None,
        segments=tuple(segments),
        resumed_from=ResumedFrom(
            checkpoint=str(found.path),
            step=boundary,
            epoch=found.state.position.epoch or 0,
            change=change,
        ),
        stats=PlanStats(
            num_docs=len(lengths),
            num_tokens=int(lengths.sum()),
            segment_packs=len(tokens),
            segment_tokens=int(tokens.sum()),
            dropped=old.stats.dropped,
            dropped_doc_ids=old.stats.dropped_doc_ids,
        ),
        validation=vplan.stats if vplan is not None else None,
        mixture=mixture[1],
        max_documents_per_row=settings.max_documents_per_row,
    )
    print(f"pack: continuing {found.path} (step {boundary}): {change}", flush=True)
    plan = publish_plan(out, plan, lambda tmp: write_rows_table(tmp, cols, lengths), eval_writer(vplan, lengths))
    keep_in_history(out, plan)
    return plan


def write_rows_table(path: Path, cols: SegmentRows, lengths: np.ndarray) -> None:
    """packs.parquet from row columns (epoch, step, micro, rank, slot, num_tokens, CSR doc_ids)."""
    offsets, docs = cols.offsets, cols.doc_ids
    table = pa.Table.from_arrays(
        [pa.array(c.astype(np.int32)) for c in (cols.epoch, cols.step, cols.micro, cols.rank, cols.slot)]
        + [
            pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(docs)).cast(pa.list_(pa.int64())),
            pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(lengths[docs].astype(np.int32))).cast(
                pa.list_(pa.int32())
            ),
            pa.array(cols.num_tokens.astype(np.int32)),
        ],
        schema=PACKS_SCHEMA,
    )
    pq.write_table(table, path, compression="zstd", row_group_size=65536)


def eval_writer(vplan: ValidationPlan | None, lengths: np.ndarray):
    """The writer of eval_packs.parquet for publish_plan (None: the plan has no validation pass)."""
    if vplan is None:
        return None
    return lambda tmp: write_packs_table(tmp, vplan.placement, vplan.packs, lengths, vplan.tokens)


def write_packs(path: Path, placement, packs: Packs, lengths: np.ndarray, tokens: np.ndarray) -> None:
    """Write packs.parquet on its own (atomically)."""
    with atomic_path(path) as tmp:
        write_packs_table(tmp, placement, packs, lengths, tokens)


def write_packs_table(path: Path, placement, packs: Packs, lengths: np.ndarray, tokens: np.ndarray) -> None:
    """Write the packs table to `path` as it is (the caller makes it atomic)."""
    sizes, flat_docs, starts = packs.sizes, packs.docs, packs.offsets
    # rows follow the placement; gather each row's pack documents into one flat list
    row_sizes = sizes[placement.pack]
    offsets = np.zeros(len(row_sizes) + 1, dtype=np.int64)
    np.cumsum(row_sizes, out=offsets[1:])
    gather = np.repeat(starts[placement.pack] - offsets[:-1], row_sizes) + np.arange(offsets[-1])
    row_docs = flat_docs[gather]
    table = pa.Table.from_arrays(
        [
            pa.array(placement.epoch.astype(np.int32)),
            pa.array(placement.step.astype(np.int32)),
            pa.array(placement.micro.astype(np.int32)),
            pa.array(placement.rank.astype(np.int32)),
            pa.array(placement.slot.astype(np.int32)),
            pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(row_docs)).cast(pa.list_(pa.int64())),
            pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(lengths[row_docs].astype(np.int32))).cast(
                pa.list_(pa.int32())
            ),
            pa.array(tokens[placement.pack].astype(np.int32)),
        ],
        schema=PACKS_SCHEMA,
    )
    pq.write_table(table, path, compression="zstd", row_group_size=65536)

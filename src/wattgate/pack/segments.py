"""Resume on another world size: the consumed prefix of the old plan, and the rest re-planned for the new one.

Every plan pack publishes is also kept under plan/history/<packs sha>/ (hard links; Snakemake deletes a
rule's outputs before it reruns it). When the run already has a complete checkpoint made with one of those
plans, and only the world size changed, pack does not start over. The plan becomes a list of segments:
- the consumed prefix: every optimizer step up to the newest complete checkpoint (its state.json names the
  step and the packs_sha256 of the plan it ran), kept as it was, in its archived packs.parquet;
- the current segment (packs.parquet): the remaining steps of that epoch and all later epochs, for the new
  world size. When the old step's packs divide evenly over the new ranks, each step keeps exactly its packs
  (dealt to the new ranks and micro-batches by cost, pack/assign.py) and grad_accum changes so the global
  batch stays the same packs; the gradients are then sums over the same documents as an uninterrupted run.
  Otherwise the remaining documents of the epoch, and every later epoch, are packed and balanced afresh
  with the grad_accum that comes closest to the old global batch in packs.

Steps in a segment's packs.parquet are numbered from 0 within each epoch of that segment; the segment
records its first global step. plan.json's `segments` lists them all, `epoch_ends` the global step that
ends each epoch. The gate proves the whole (gate/schedule_checks.py check_segments).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from wattgate.artifacts import sha256_file
from wattgate.errors import InputError
from wattgate.run_files import PACKS, PLAN, read_plan
from wattgate.pack.assign import Layout, assign_ranks, pack_costs, sort_placement
from wattgate.pack.planner import plan_packs
from wattgate.identity import model_train_differences
from wattgate.records.checkpoint import CheckpointState, RunIdentity
from wattgate.records.plan import SAME_FOR_RESUME, Plan, Segment, resume_settings

HISTORY = "history"


@dataclass(frozen=True)
class PlanSettings:
    """What a plan is made for: the config's settings, and the manifest it packs (its sha256)."""

    world_size: int
    seq_len: int
    micro_batch_size: int
    eval_micro_batch_size: int
    epochs: int
    remainder: str
    seed: int
    attn_weight: float
    pretokenized_manifest_sha256: str
    max_documents_per_row: int | None = None  # plan.json's: 1 for one document per row

    def resume_settings(self) -> tuple:
        """The settings a continued plan must share with the plan it continues (SAME_FOR_RESUME, in order)."""
        return resume_settings(self)


ROW_COLUMNS = ("epoch", "step", "micro", "rank", "slot", "num_tokens")


@dataclass(frozen=True)
class SegmentRows:
    """A segment's packs.parquet rows as columns (run order), doc lists flattened: row r holds
    doc_ids[offsets[r]:offsets[r + 1]]."""

    epoch: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    num_tokens: np.ndarray
    offsets: np.ndarray
    doc_ids: np.ndarray

    def take(self, order: np.ndarray) -> SegmentRows:
        """The rows `order` (in that order)."""
        sizes = np.diff(self.offsets)[order]
        starts = self.offsets[:-1][order]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        gather = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
        return SegmentRows(
            **{c: getattr(self, c)[order] for c in ROW_COLUMNS}, offsets=offsets, doc_ids=self.doc_ids[gather]
        )

    @classmethod
    def concat(cls, parts: list[SegmentRows]) -> SegmentRows:
        offsets, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            offsets.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        return cls(
            **{c: np.concatenate([getattr(p, c) for p in parts]) for c in ROW_COLUMNS},
            offsets=np.concatenate(offsets),
            doc_ids=np.concatenate([p.doc_ids for p in parts]),
        )


@dataclass(frozen=True)
class Packing:
    """How the rest of a plan is re-packed: the new layout, and the plan settings the planner (plan_packs) takes."""

    layout: Layout
    seq_len: int
    epochs: int
    seed: int
    attn_weight: float
    remainder: str


@dataclass(frozen=True)
class Continuation:
    """How continue_plan goes on: the new grad_accum from the resume step on, the old plan's layout and
    segments (a plan that was not continued: one segment from step 0), and how the rest was planned."""

    grad_accum: int
    first_step: int
    old_world_size: int
    old_grad_accum: int
    how: str
    segments: tuple[Segment, ...]


def keep_in_history(out: Path, plan: Plan) -> Path:
    """Hard-link (else copy) the published plan.json and packs.parquet under history/<packs sha>/."""
    assert plan.packs_sha256 is not None  # set when the plan is published
    dest = out / HISTORY / plan.packs_sha256[:16]
    dest.mkdir(parents=True, exist_ok=True)
    for name in (PLAN, PACKS):
        target = dest / name
        if target.exists():
            continue
        tmp = dest / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(out / name, tmp)
        except OSError:
            shutil.copyfile(out / name, tmp)
        os.replace(tmp, target)
    return dest


@dataclass(frozen=True)
class FoundCheckpoint:
    """A checkpoint folder and its state.json."""

    path: Path
    state: CheckpointState


@dataclass(frozen=True)
class ResumeSource:
    """What a continued plan goes on from: the newest complete checkpoint, the plan it ran and that plan's
    folder under history/."""

    checkpoint: FoundCheckpoint
    plan: Plan
    folder: Path


def newest_checkpoint(checkpoints: Path) -> FoundCheckpoint | None:
    """The newest complete checkpoint (every file its state.json lists present at its size), or None. Sizes only
    here: train verifies the hashes."""
    if not checkpoints.is_dir():
        return None

    def step_of(p: Path) -> int:
        try:
            return int(p.name.split("-", 1)[1])
        except (IndexError, ValueError):
            return -1

    for path in sorted(
        (p for p in checkpoints.glob("step-*") if p.is_dir() and p.suffix != ".tmp"), key=step_of, reverse=True
    ):
        try:
            data = json.loads((path / "state.json").read_text())
        except (OSError, ValueError, RecursionError):
            continue
        try:
            state = CheckpointState.from_json(data, str(path / "state.json"))
        except InputError:  # train skips such a folder too (train/checkpoint.py is_complete)
            state = None
        if state is None or state.hash_algorithm is None:  # None only in a dry run's, which is never on disk
            print(f"pack: WARNING: skipping {path}: its state.json is not a checkpoint state", flush=True)
            continue
        if all((path / n).is_file() and (path / n).stat().st_size == state.size_of(n) for n in state.files):
            return FoundCheckpoint(path, state)
    return None


def resume_source(
    out: Path, checkpoints: Path, new: PlanSettings, identity_of: Callable[[], RunIdentity] | None = None
) -> ResumeSource | str:
    """The checkpoint, plan and history folder the run goes on from under `new` plan settings, else why not.

    `identity_of()`: this config's run identity parts `model` and `train` (wattgate/identity.py; called only when
    there is a checkpoint, since it reads the model's files). A checkpoint of another identity is never
    continued: train would set it aside and find no step to go on from."""
    found = newest_checkpoint(checkpoints)
    if found is None:
        return "no complete checkpoint"
    state = found.state
    if identity_of is not None and (diffs := model_train_differences(state.identity, identity_of(), True)):
        return f"the run identity of checkpoint step {state.step} differs in {', '.join(diffs)}"
    sha = state.position.plan or ""
    folder = out / HISTORY / sha[:16]
    if not sha or not (folder / PLAN).is_file():
        return f"the plan of checkpoint {found.path} is not in {out / HISTORY}"
    old, _ = read_plan(folder)
    if old.packs_sha256 != sha or sha256_file(folder / PACKS) != sha:
        return f"{folder}: archived plan does not match its hash"
    changed = [k for k, a, b in zip(SAME_FOR_RESUME, old.resume_settings(), new.resume_settings()) if a != b]
    if changed:
        return f"the plan changed in {', '.join(changed)} since checkpoint step {state.step}"
    if old.world_size == new.world_size:
        return "same world size"
    return ResumeSource(found, old, folder)


def segment_rows(folder: Path) -> SegmentRows:
    """A plan's packs.parquet as columns (doc lists flattened with offsets), rows in run order."""
    t = pq.read_table(folder / PACKS)
    ids = t.column("doc_ids").combine_chunks()
    offsets = ids.offsets.to_numpy().astype(np.int64)
    rows = SegmentRows(
        **{c: t.column(c).to_numpy().astype(np.int64) for c in ROW_COLUMNS},
        offsets=offsets - offsets[0],
        doc_ids=ids.values.to_numpy().astype(np.int64)[offsets[0] : offsets[-1]],
    )
    return rows.take(np.lexsort((rows.slot, rows.rank, rows.micro, rows.step, rows.epoch)))


def step_ordinal(epoch: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Each row's optimizer step in run order (0-based), from its (epoch, step)."""
    key = epoch * (int(step.max()) + 1 if len(step) else 1) + step
    _, ordinal = np.unique(key, return_inverse=True)
    return ordinal


def continue_plan(
    source: ResumeSource,
    lengths: np.ndarray,
    layout_new: Layout,
    held_out=(),
    chosen=None,
) -> tuple[SegmentRows, Continuation]:
    """(columns of the current segment's rows, its plan fields) continuing the plan of `source` after its
    checkpoint.

    `held_out`: the validation split's doc_ids, never packed for training (a re-pack's later epochs hold
    every other document but the original plan's drops). `chosen`: a mixture's documents per epoch
    (pack/mixture.py, repeats included): a re-pack's later epochs hold exactly those."""
    old, found = source.plan, source.checkpoint
    # a plan that was not continued: one segment from step 0 (its packs and end named by the caller)
    segments = old.segments or (
        Segment(
            world_size=old.world_size,
            grad_accum=old.grad_accum,
            micro_batch_size=old.micro_batch_size,
            first_step=0,
            end_step=0,
            packs=PACKS,
        ),
    )
    first = old.first_step
    boundary = found.state.step  # global optimizer steps done
    rows = segment_rows(source.folder)
    ordinal = step_ordinal(rows.epoch, rows.step)
    done = boundary - first  # steps of the old segment already run
    if not 0 < done <= int(ordinal.max()) + 1:
        raise InputError(
            f"checkpoint step {boundary} is not inside the plan's last segment (steps {first} to "
            f"{first + int(ordinal.max()) + 1}); rerun pack from scratch (delete the checkpoints)"
        )
    if done == int(ordinal.max()) + 1:
        raise InputError(
            f"{found.path}: the run is complete (checkpoint step {boundary} is its last step), so there is "
            f"nothing left to plan on {layout_new.world_size} ranks; to train again from step 0, move the "
            f"checkpoints folder away (or change run_name) and rerun pack"
        )
    mbs = old.micro_batch_size
    old_pps = old.world_size * mbs * old.grad_accum
    rest = ordinal >= done
    if old_pps % (layout_new.world_size * mbs) == 0:
        ga = old_pps // (layout_new.world_size * mbs)
        cols = redeal_steps(
            rows,
            ordinal,
            rest,
            Layout(layout_new.world_size, mbs, ga, layout_new.one_document_rows),
            lengths,
            old.attn_weight,
            old.seed,
        )
        how = "each remaining step keeps its packs"
    else:
        ga = max(1, round(old_pps / (layout_new.world_size * mbs)))
        packing = Packing(
            layout=Layout(layout_new.world_size, mbs, ga, layout_new.one_document_rows),
            seq_len=old.seq_len,
            epochs=old.epochs,
            seed=old.seed,
            attn_weight=old.attn_weight,
            # `drop` dropped its remainder once, the same documents in every epoch; a second drop here would
            # lose documents from some epochs only (the gate's conservation refuses that): keep them all
            remainder="rebin" if old.remainder == "drop" else old.remainder,
        )
        cols = repack_rest(
            rows,
            ordinal,
            rest,
            lengths,
            packing,
            dropped=list(old.stats.dropped_doc_ids) + [int(d) for d in held_out],
            chosen=chosen,
        )
        how = "the remaining documents re-packed"
    return cols, Continuation(
        grad_accum=ga,
        first_step=boundary,
        old_world_size=old.world_size,
        old_grad_accum=old.grad_accum,
        how=how,
        segments=segments,
    )


def redeal_steps(
    rows: SegmentRows,
    ordinal: np.ndarray,
    rest: np.ndarray,
    layout: Layout,
    lengths: np.ndarray,
    attn_weight: float,
    seed: int,
) -> SegmentRows:
    """The remaining steps with exactly their packs, dealt over the new ranks and micro-batches by cost."""
    sel = np.flatnonzero(rest)
    sub = rows.take(sel)
    sub_ord = ordinal[sel]
    doc_len = lengths[sub.doc_ids].astype(np.int64)
    per_row = np.diff(sub.offsets)
    row_of_entry = np.repeat(np.arange(len(per_row)), per_row)
    tokens = np.bincount(row_of_entry, weights=doc_len, minlength=len(per_row))
    sum_sq = np.bincount(row_of_entry, weights=doc_len.astype(np.float64) ** 2, minlength=len(per_row))
    costs = pack_costs(tokens, sum_sq, attn_weight)
    epoch, step, micro, rank, slot = (np.empty(len(sel), np.int64) for _ in range(5))
    order = np.empty(len(sel), np.int64)
    pos = 0
    epoch_of_step = {}
    for k in np.unique(sub_ord):
        mine = np.flatnonzero(sub_ord == k)
        p = assign_ranks(costs[mine], layout, 1, seed * 1_000_003 + int(k))
        e = int(sub.epoch[mine[0]])
        s = epoch_of_step.setdefault(e, [])
        s.append(k)
        n = len(mine)
        order[pos : pos + n] = mine[p.pack]
        epoch[pos : pos + n] = e
        step[pos : pos + n] = len(s) - 1
        micro[pos : pos + n], rank[pos : pos + n], slot[pos : pos + n] = p.micro, p.rank, p.slot
        pos += n
    moved = sub.take(order)
    return dataclasses.replace(moved, epoch=epoch, step=step, micro=micro, rank=rank, slot=slot)


def repack_rest(
    rows: SegmentRows,
    ordinal: np.ndarray,
    rest: np.ndarray,
    lengths: np.ndarray,
    packing: Packing,
    dropped: list[int],
    chosen: list[np.ndarray] | None = None,
) -> SegmentRows:
    """The remaining documents of the boundary epoch, and every later epoch, packed afresh by `packing`."""
    boundary_epoch = int(rows.epoch[np.flatnonzero(rest)[0]])
    entry_rest = np.repeat(rest & (rows.epoch == boundary_epoch), np.diff(rows.offsets))
    left = rows.doc_ids[entry_rest]
    # a plain plan holds each document once per epoch; a mixture's repeats stay (sorted either way)
    left = np.sort(left) if chosen is not None else np.unique(left)
    parts = [_planned(left, lengths, packing, first_epoch=boundary_epoch, epochs=1)]
    later = packing.epochs - boundary_epoch - 1
    if later > 0 and chosen is not None:
        # each later epoch its own chosen documents (they differ between epochs), planned on their own
        for e in range(boundary_epoch + 1, packing.epochs):
            docs = np.sort(chosen[e])
            parts.append(_planned(docs, lengths, packing, first_epoch=e, epochs=1))
    elif later > 0:
        # every document of the corpus but those the original plan dropped (a segment may hold only part of an
        # epoch when the run was resized before, so its rows cannot say which documents an epoch holds)
        kept = np.setdiff1d(np.arange(len(lengths)), np.asarray(dropped, dtype=np.int64))
        parts.append(_planned(kept, lengths, packing, first_epoch=boundary_epoch + 1, epochs=later))
    return SegmentRows.concat(parts)


def _planned(doc_ids: np.ndarray, lengths: np.ndarray, packing: Packing, first_epoch: int, epochs: int) -> SegmentRows:
    """`doc_ids` packed and placed by the ordinary planner for `epochs` epochs, numbered from `first_epoch`."""
    seed = packing.seed * 1_000_003 + first_epoch  # each part of a re-pack its own placement, the same on rerun
    packs, placement, tokens, _ = plan_packs(
        lengths[doc_ids], packing.seq_len, packing.layout, packing.remainder, epochs, seed, packing.attn_weight
    )
    placement = sort_placement(placement)
    sizes = np.diff(packs.offsets)[placement.pack]
    starts = packs.offsets[:-1][placement.pack]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    gather = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
    return SegmentRows(
        epoch=placement.epoch + first_epoch,
        step=placement.step,
        micro=placement.micro,
        rank=placement.rank,
        slot=placement.slot,
        num_tokens=tokens[placement.pack].astype(np.int64),
        offsets=offsets,
        doc_ids=doc_ids[packs.docs[gather]],
    )

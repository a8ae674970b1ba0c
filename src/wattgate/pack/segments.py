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
ends each epoch. The gate proves the whole (gate/checks.py check_segments).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from wattgate.artifacts import sha256_file
from wattgate.errors import InputError
from wattgate.run_files import read_plan
from wattgate.pack.assign import Layout, assign_ranks, pack_costs, sort_placement
from wattgate.pack.planner import plan_packs
from wattgate.identity import model_train_differences

HISTORY = "history"
# plan keys that must be unchanged for a re-plan to continue a run (anything else starts over)
SAME_FOR_RESUME = (
    "seq_len",
    "micro_batch_size",
    "epochs",
    "remainder",
    "seed",
    "attn_weight",
    "pretokenized_manifest_sha256",
)


def keep_in_history(out: Path, plan: dict) -> Path:
    """Hard-link (else copy) the published plan.json and packs.parquet under history/<packs sha>/."""
    dest = out / HISTORY / plan["packs_sha256"][:16]
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("plan.json", "packs.parquet"):
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


def newest_checkpoint(checkpoints: Path) -> dict | None:
    """state.json of the newest complete checkpoint (every file it lists present at its size), or None."""
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
            state = json.loads((path / "state.json").read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if not _is_state(state):  # train skips such a folder too (train/checkpoint.py is_complete)
            print(f"pack: WARNING: skipping {path}: its state.json is not a checkpoint state", flush=True)
            continue
        sizes = {n: v["bytes"] if isinstance(v, dict) else v for n, v in state["files"].items()}
        if all((path / n).is_file() and (path / n).stat().st_size == size for n, size in sizes.items()):
            return state | {"path": str(path)}
    return None


def _is_state(state) -> bool:
    """A state.json train wrote: an object with a whole `step`, a `position` object and `files` name -> {bytes,
    hash} (or, written before content hashes, name -> size). Sizes only here: train verifies the hashes."""
    files = state.get("files", {}) if isinstance(state, dict) else None
    return (
        isinstance(files, dict)
        and all(isinstance(v, int) or (isinstance(v, dict) and isinstance(v.get("bytes"), int)) for v in files.values())
        and isinstance(state.get("step"), int)
        and isinstance(state.get("position") or {}, dict)
    )


def resume_source(
    out: Path, checkpoints: Path, new: dict, identity_of: Callable[[], dict] | None = None
) -> tuple[dict, dict, Path] | tuple[None, str, None]:
    """(checkpoint state, old plan, its history folder) when the run can go on under `new` plan settings,
    else (None, why not, None).

    `identity_of()`: this config's run identity parts `model` and `train` (wattgate/identity.py; called only when
    there is a checkpoint, since it reads the model's files). A checkpoint of another identity is never
    continued: train would set it aside and find no step to go on from."""
    state = newest_checkpoint(checkpoints)
    if state is None:
        return None, "no complete checkpoint", None
    if identity_of is not None and (diffs := model_train_differences(state.get("identity"), identity_of(), True)):
        return None, f"the run identity of checkpoint step {state['step']} differs in {', '.join(diffs)}", None
    sha = str((state.get("position") or {}).get("plan", ""))
    folder = out / HISTORY / sha[:16]
    if not sha or not (folder / "plan.json").is_file():
        return None, f"the plan of checkpoint {state['path']} is not in {out / HISTORY}", None
    old, _ = read_plan(folder)
    if old.get("packs_sha256") != sha or sha256_file(folder / "packs.parquet") != sha:
        return None, f"{folder}: archived plan does not match its hash", None
    changed = [k for k in SAME_FOR_RESUME if old.get(k) != new.get(k)]
    if changed:
        return None, f"the plan changed in {', '.join(changed)} since checkpoint step {state['step']}", None
    if old["world_size"] == new["world_size"]:
        return None, "same world size", None
    return state, old, folder


def segment_rows(folder: Path) -> dict[str, np.ndarray]:
    """A plan's packs.parquet as columns (doc lists flattened with offsets), rows in run order."""
    t = pq.read_table(folder / "packs.parquet")
    cols = {
        c: t.column(c).to_numpy().astype(np.int64) for c in ("epoch", "step", "micro", "rank", "slot", "num_tokens")
    }
    ids = t.column("doc_ids").combine_chunks()
    offsets = ids.offsets.to_numpy().astype(np.int64)
    cols["offsets"] = offsets - offsets[0]
    cols["doc_ids"] = ids.values.to_numpy().astype(np.int64)[offsets[0] : offsets[-1]]
    order = np.lexsort((cols["slot"], cols["rank"], cols["micro"], cols["step"], cols["epoch"]))
    return reorder(cols, order)


def reorder(cols: dict, order: np.ndarray) -> dict:
    sizes = np.diff(cols["offsets"])[order]
    starts = cols["offsets"][:-1][order]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    gather = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
    out = {k: v[order] for k, v in cols.items() if k not in ("offsets", "doc_ids")}
    return out | {"offsets": offsets, "doc_ids": cols["doc_ids"][gather]}


def step_ordinal(epoch: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Each row's optimizer step in run order (0-based), from its (epoch, step)."""
    key = epoch * (int(step.max()) + 1 if len(step) else 1) + step
    _, ordinal = np.unique(key, return_inverse=True)
    return ordinal


def continue_plan(
    old: dict, old_folder: Path, state: dict, lengths: np.ndarray, layout_new: Layout, held_out=(), chosen=None
) -> tuple[dict, dict]:
    """(columns of the current segment's rows, its plan fields) continuing `old` after checkpoint `state`.

    `held_out`: the validation split's doc_ids, never packed for training (a re-pack's later epochs hold
    every other document but the original plan's drops). `chosen`: a mixture's documents per epoch
    (pack/mixture.py, repeats included): a re-pack's later epochs hold exactly those."""
    segments = old.get("segments") or [
        {
            "world_size": old["world_size"],
            "grad_accum": old["grad_accum"],
            "micro_batch_size": old["micro_batch_size"],
            "first_step": 0,
        }
    ]
    first = int(segments[-1]["first_step"])
    boundary = int(state["step"])  # global optimizer steps done
    rows = segment_rows(old_folder)
    ordinal = step_ordinal(rows["epoch"], rows["step"])
    done = boundary - first  # steps of the old segment already run
    if not 0 < done <= int(ordinal.max()) + 1:
        raise InputError(
            f"checkpoint step {boundary} is not inside the plan's last segment (steps {first} to "
            f"{first + int(ordinal.max()) + 1}); rerun pack from scratch (delete the checkpoints)"
        )
    if done == int(ordinal.max()) + 1:
        raise InputError(
            f"{state['path']}: the run is complete (checkpoint step {boundary} is its last step), so there is "
            f"nothing left to plan on {layout_new.world_size} ranks; to train again from step 0, move the "
            f"checkpoints folder away (or change run_name) and rerun pack"
        )
    mbs = old["micro_batch_size"]
    old_pps = old["world_size"] * mbs * old["grad_accum"]
    rest = ordinal >= done
    if old_pps % (layout_new.world_size * mbs) == 0:
        ga = old_pps // (layout_new.world_size * mbs)
        cols = redeal_steps(
            rows, ordinal, rest, Layout(layout_new.world_size, mbs, ga), lengths, old["attn_weight"], old["seed"]
        )
        how = "each remaining step keeps its packs"
    else:
        ga = max(1, round(old_pps / (layout_new.world_size * mbs)))
        cols = repack_rest(
            rows,
            ordinal,
            rest,
            Layout(layout_new.world_size, mbs, ga),
            lengths,
            old["seq_len"],
            old["epochs"],
            old["seed"],
            old["attn_weight"],
            # `drop` dropped its remainder once, the same documents in every epoch; a second drop here would
            # lose documents from some epochs only (the gate's conservation refuses that): keep them all
            "rebin" if old["remainder"] == "drop" else old["remainder"],
            list(old.get("stats", {}).get("dropped_doc_ids", [])) + [int(d) for d in held_out],
            chosen,
        )
        how = "the remaining documents re-packed"
    return cols, {
        "grad_accum": ga,
        "first_step": boundary,
        "old_world_size": old["world_size"],
        "old_grad_accum": old["grad_accum"],
        "how": how,
        "segments": segments,
    }


def redeal_steps(
    rows: dict,
    ordinal: np.ndarray,
    rest: np.ndarray,
    layout: Layout,
    lengths: np.ndarray,
    attn_weight: float,
    seed: int,
) -> dict:
    """The remaining steps with exactly their packs, dealt over the new ranks and micro-batches by cost."""
    sel = np.flatnonzero(rest)
    sub = reorder(rows, sel)
    sub_ord = ordinal[sel]
    doc_len = lengths[sub["doc_ids"]].astype(np.int64)
    per_row = np.diff(sub["offsets"])
    row_of_entry = np.repeat(np.arange(len(per_row)), per_row)
    tokens = np.bincount(row_of_entry, weights=doc_len, minlength=len(per_row))
    sum_sq = np.bincount(row_of_entry, weights=doc_len.astype(np.float64) ** 2, minlength=len(per_row))
    costs = pack_costs(tokens, sum_sq, attn_weight)
    out = {k: np.empty(len(sel), np.int64) for k in ("epoch", "step", "micro", "rank", "slot")}
    order = np.empty(len(sel), np.int64)
    pos = 0
    epoch_of_step = {}
    for k in np.unique(sub_ord):
        mine = np.flatnonzero(sub_ord == k)
        p = assign_ranks(costs[mine], layout, 1, seed * 1_000_003 + int(k))
        e = int(sub["epoch"][mine[0]])
        s = epoch_of_step.setdefault(e, [])
        s.append(k)
        n = len(mine)
        order[pos : pos + n] = mine[p.pack]
        out["epoch"][pos : pos + n] = e
        out["step"][pos : pos + n] = len(s) - 1
        out["micro"][pos : pos + n], out["rank"][pos : pos + n], out["slot"][pos : pos + n] = p.micro, p.rank, p.slot
        pos += n
    moved = reorder(sub, order)
    return moved | out


def repack_rest(
    rows: dict,
    ordinal: np.ndarray,
    rest: np.ndarray,
    layout: Layout,
    lengths: np.ndarray,
    seq_len: int,
    epochs: int,
    seed: int,
    attn_weight: float,
    remainder: str,
    dropped: list[int],
    chosen: list[np.ndarray] | None = None,
) -> dict:
    """The remaining documents of the boundary epoch, and every later epoch, packed afresh for `layout`."""
    boundary_epoch = int(rows["epoch"][np.flatnonzero(rest)[0]])
    entry_rest = np.repeat(rest & (rows["epoch"] == boundary_epoch), np.diff(rows["offsets"]))
    left = rows["doc_ids"][entry_rest]
    # a plain plan holds each document once per epoch; a mixture's repeats stay (sorted either way)
    left = np.sort(left) if chosen is not None else np.unique(left)
    parts = [
        _planned(
            left,
            lengths,
            seq_len,
            layout,
            1,
            seed * 1_000_003 + boundary_epoch,
            attn_weight,
            remainder,
            epoch_offset=boundary_epoch,
        )
    ]
    later = epochs - boundary_epoch - 1
    if later > 0 and chosen is not None:
        # each later epoch its own chosen documents (they differ between epochs), planned on their own
        for e in range(boundary_epoch + 1, epochs):
            docs = np.sort(chosen[e])
            parts.append(
                _planned(
                    docs, lengths, seq_len, layout, 1, seed * 1_000_003 + e, attn_weight, remainder, epoch_offset=e
                )
            )
    elif later > 0:
        # every document of the corpus but those the original plan dropped (a segment may hold only part of an
        # epoch when the run was resized before, so its rows cannot say which documents an epoch holds)
        kept = np.setdiff1d(np.arange(len(lengths)), np.asarray(dropped, dtype=np.int64))
        parts.append(
            _planned(
                kept,
                lengths,
                seq_len,
                layout,
                later,
                seed * 1_000_003 + boundary_epoch + 1,
                attn_weight,
                remainder,
                epoch_offset=boundary_epoch + 1,
            )
        )
    return concat_rows(parts)


def _planned(
    doc_ids: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    layout: Layout,
    epochs: int,
    seed: int,
    attn_weight: float,
    remainder: str,
    epoch_offset: int,
) -> dict:
    """`doc_ids` packed and placed by the ordinary planner for `epochs` epochs, numbered from epoch_offset."""
    packs, placement, tokens, _ = plan_packs(lengths[doc_ids], seq_len, layout, remainder, epochs, seed, attn_weight)
    placement = sort_placement(placement)
    sizes = np.diff(packs.offsets)[placement.pack]
    starts = packs.offsets[:-1][placement.pack]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    gather = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
    return {
        "epoch": placement.epoch + epoch_offset,
        "step": placement.step,
        "micro": placement.micro,
        "rank": placement.rank,
        "slot": placement.slot,
        "num_tokens": tokens[placement.pack].astype(np.int64),
        "offsets": offsets,
        "doc_ids": doc_ids[packs.docs[gather]],
    }


def concat_rows(parts: list[dict]) -> dict:
    out = {k: np.concatenate([p[k] for p in parts]) for k in ("epoch", "step", "micro", "rank", "slot", "num_tokens")}
    offsets, docs, base = [np.zeros(1, np.int64)], [], 0
    for p in parts:
        offsets.append(p["offsets"][1:] + base)
        base += int(p["offsets"][-1])
        docs.append(p["doc_ids"])
    return out | {"offsets": np.concatenate(offsets), "doc_ids": np.concatenate(docs)}

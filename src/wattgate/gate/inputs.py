"""Load the artifacts the gate checks: plan, packs and manifest (wattgate.run_files), and shard columns.

Everything is read into flat numpy arrays once; each check is then a pure
function over these arrays. Unreadable or malformed input is an InputError
(exit 2), distinct from a failed check (exit 1).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.artifacts import sha256_file
from wattgate.data.shards import shard_hash, shard_hash_algorithm
from wattgate.data.split import read_validation_ids
from wattgate.errors import InputError
from wattgate.run_files import (
    PACKS,
    PackRows,
    arrow_numpy,
    first_line,
    parquet_columns,
    read_manifest,
    read_packs,
    read_parquet,
    read_plan,
)
from wattgate.records.manifest import Manifest
from wattgate.records.plan import Plan
from wattgate.records.run_config import RunConfig

# Up to this many tokens in all shards, the gate decodes every document's input_ids (~60M tokens/s on the
# 2-core bench VM, so <= ~0.07 s) to
# check its length against num_tokens and the true max token id. Above it, the per-row-group checks from
# the Parquet metadata stand in (leaf value count == sum of num_tokens, column statistics max), the shard
# hashes prove the bytes are those pretokenize wrote, and the trainer checks each document it reads.
FULL_CONTENT_CHECK_TOKENS = 4_000_000


@dataclass(frozen=True)
class GateInputs:
    config: RunConfig
    plan: Plan
    packs: PackRows
    manifest: Manifest
    doc_tokens: np.ndarray  # by doc_id, from the shards
    doc_loss_tokens: np.ndarray
    content_hashes: np.ndarray  # every document's content_hash by doc_id
    packs_sha256: str  # of the files on disk
    manifest_sha256: str
    checkpoint_dir: Path
    content: ShardContent | None = None  # shard hashes, true lengths and token ids (None: not verified)
    prefix: PackRows | None = None  # a continued plan's consumed steps of its earlier segments (pack/segments.py)
    prefix_problems: tuple = ()  # archived segments that are missing or do not hash to plan.json's record
    validation: ValidationInputs | None = None  # the held-out split and its pass (None: no split)


@dataclass(frozen=True)
class ValidationInputs:
    """The validation split (data/split.py) and the plan's validation pass (pack/validation.py)."""

    held_out: np.ndarray  # sorted doc_ids
    content_hashes: np.ndarray  # every document's content_hash by doc_id
    packs: PackRows | None  # eval_packs.parquet (None: the plan has no validation pass)
    packs_sha256: str | None  # of the file on disk
    problems: tuple[str, ...]  # what could not be read or does not match its record


@dataclass(frozen=True)
class ShardContent:
    """What the shards' bytes say, against what the manifest and num_tokens columns claim."""

    problems: tuple[str, ...]  # hash mismatches, lengths or token ids that disagree
    max_token_id: int | None  # the largest token id in the shards (None: no statistics to tell)
    scope: str  # how far the lengths were verified: "per document" or "per row group"
    algorithm: str
    shards: int


def read_doc_columns(pretokenized: Path, manifest: Manifest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """num_tokens, num_loss_tokens and content_hash of every document, indexed by doc_id."""
    n = manifest.num_docs  # a count, and shards a list of names: read_manifest checked
    tokens = np.full(n, -1, dtype=np.int64)
    loss = np.zeros(n, dtype=np.int64)
    content = np.zeros(n, dtype=np.int64)
    columns = ["doc_id", "num_tokens", "num_loss_tokens", "content_hash"]
    for name in manifest.shards:
        path = pretokenized / name
        _require_columns(path, parquet_columns(path, "pretokenize"), columns)
        t = read_parquet(path, columns, "pretokenize")
        ids = arrow_numpy(t.column("doc_id"))
        if len(ids) and (ids.min() < 0 or ids.max() >= n):
            raise InputError(f"{path}: doc_id outside 0..{n - 1} of the manifest; rerun pretokenize")
        tokens[ids] = arrow_numpy(t.column("num_tokens"))
        loss[ids] = arrow_numpy(t.column("num_loss_tokens"))
        content[ids] = arrow_numpy(t.column("content_hash"))
    if (tokens < 0).any():
        raise InputError(
            f"{pretokenized}: shards miss {(tokens < 0).sum()} of the manifest's doc_ids; rerun pretokenize"
        )
    return tokens, loss, content


def _leaf_column(meta, prefix: str) -> int | None:
    """Index of the leaf column under `prefix` (e.g. input_ids.list.element) in the Parquet metadata."""
    for i in range(meta.num_columns):
        if meta.schema.column(i).path.startswith(prefix + "."):
            return i
    return None


def verify_shards(pretokenized: Path, manifest: Manifest, full: bool | None = None) -> ShardContent:
    """Hash every shard's bytes against the manifest; check input_ids lengths against num_tokens and the true max id.

    `full` (default: all shards hold <= FULL_CONTENT_CHECK_TOKENS tokens) decodes every document's
    input_ids; otherwise each row group's input_ids value count (Parquet metadata) must equal the sum
    of its num_tokens and the max comes from the column statistics.
    """
    shards = manifest.shards
    expected = manifest.shard_hashes
    algorithm = manifest.shard_hash_algorithm
    if full is None:
        full = manifest.num_tokens <= FULL_CONTENT_CHECK_TOKENS
    problems: list[str] = []
    if algorithm != shard_hash_algorithm():
        problems.append(
            f"manifest shard_hash_algorithm {algorithm!r}, this install hashes with "
            f"{shard_hash_algorithm()!r}; rerun pretokenize"
        )
    elif sorted(expected) != sorted(shards):
        problems.append("manifest shard_hashes do not name the same files as shards; rerun pretokenize")
    max_id: int | None = -1
    for name in shards:
        path = pretokenized / name
        if name in expected:
            try:
                if shard_hash(path) != expected[name]:
                    problems.append(
                        f"{name}: content hash differs from the manifest (the shard changed after "
                        "pretokenize); rerun pretokenize, pack and gate"
                    )
            except OSError as exc:
                raise InputError(f"{path}: cannot read ({exc.strerror}); rerun pretokenize") from None
        try:
            if full:
                assert max_id is not None  # _check_documents keeps it an int
                max_id = _check_documents(path, name, problems, max_id)
            elif max_id is not None:
                max_id = _check_row_groups(path, name, problems, max_id)
        except (OSError, pa.ArrowException, KeyError, ValueError) as exc:
            raise InputError(f"{path}: cannot read ({first_line(exc)}); rerun pretokenize") from None
    return ShardContent(
        tuple(problems),
        None if max_id is None or max_id < 0 else max_id,
        "per document" if full else "per row group",
        algorithm,
        len(shards),
    )


def _check_documents(path: Path, name: str, problems: list[str], max_id: int) -> int:
    names = pq.read_schema(path).names
    columns = ["doc_id", "input_ids", "num_tokens", "loss_mask", "num_loss_tokens"]
    _require_columns(path, names, columns)
    with pq.ParquetFile(path) as f:  # not pq.read_table: it imports pyarrow.dataset, and that pandas
        t = f.read(columns=columns)
    ids = t.column("input_ids").combine_chunks()
    actual = _list_lengths(ids)
    claimed = arrow_numpy(t.column("num_tokens")).astype(np.int64)
    _first_wrong(
        problems, name, t, actual != claimed, lambda r: f"holds {actual[r]} tokens, num_tokens says {claimed[r]}"
    )
    flat = pc.list_flatten(ids)
    if len(flat) and (low := pc.min(flat).as_py()) is not None and low < 0:
        problems.append(f"{name}: a negative token id ({low}) in input_ids; rerun pretokenize, pack and gate")
    _check_loss_mask(t, name, actual, problems)
    top = pc.max(flat).as_py()
    return max_id if top is None else max(max_id, int(top))


def _check_loss_mask(t: pa.Table, name: str, lengths: np.ndarray, problems: list[str]) -> None:
    """One 0/1 loss_mask entry per token, and num_loss_tokens (what the gate proves loss from) their sum."""
    mask = t.column("loss_mask").combine_chunks()
    entries = _list_lengths(mask)
    _first_wrong(
        problems, name, t, entries != lengths, lambda r: f"has {entries[r]} loss_mask entries for {lengths[r]} tokens"
    )
    flat = arrow_numpy(pc.list_flatten(mask))
    if len(flat) and ((flat != 0) & (flat != 1)).any():
        problems.append(f"{name}: loss_mask holds values other than 0 and 1; rerun pretokenize, pack and gate")
    else:
        summed, claimed = _list_sums(mask), arrow_numpy(t.column("num_loss_tokens")).astype(np.int64)
        _first_wrong(
            problems,
            name,
            t,
            summed != claimed,
            lambda r: f"has {summed[r]} loss tokens, num_loss_tokens says {claimed[r]}",
        )


def _list_lengths(lists: pa.Array) -> np.ndarray:
    """Each list's length (a null list: 0)."""
    if lists.null_count:
        return arrow_numpy(pc.list_value_length(lists).fill_null(0)).astype(np.int64)
    return np.diff(arrow_numpy(lists.offsets)).astype(np.int64)  # fill_null would import pandas


def _list_sums(lists: pa.Array) -> np.ndarray:
    """Each list's sum (a null list: 0)."""
    totals = np.zeros(len(pc.list_flatten(lists)) + 1, dtype=np.int64)
    np.cumsum(arrow_numpy(pc.list_flatten(lists)), out=totals[1:])
    offsets = arrow_numpy(lists.offsets).astype(np.int64)
    offsets -= offsets[0]
    return totals[offsets[1:]] - totals[offsets[:-1]]


def _first_wrong(problems: list[str], name: str, t: pa.Table, wrong: np.ndarray, says) -> None:
    """One problem naming the first document where `wrong` holds (`says(row)`) and how many there are."""
    rows = np.flatnonzero(wrong)
    if rows.size:
        r = int(rows[0])
        problems.append(
            f"{name}: doc_id {t.column('doc_id')[r].as_py()} {says(r)} ({rows.size} such document(s)); "
            "rerun pretokenize, pack and gate"
        )


def _require_columns(path: Path, names: list[str], needed: list[str]) -> None:
    if missing := [c for c in needed if c not in names]:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; rerun pretokenize")


def _check_row_groups(path: Path, name: str, problems: list[str], max_id: int | None) -> int | None:
    f = pq.ParquetFile(path)
    meta = f.metadata
    leaf = _leaf_column(meta, "input_ids")
    claimed = arrow_numpy(f.read(columns=["num_tokens"]).column("num_tokens")).astype(np.int64)
    rerun = "rerun pretokenize, pack and gate"
    start = 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        n = int(claimed[start : start + rg.num_rows].sum())
        col = rg.column(leaf) if leaf is not None else None
        # one leaf value per token (an empty list would add one null level; documents are never empty)
        if col is None or col.num_values != n:
            problems.append(
                f"{name}: row group {g} (rows {start}..{start + rg.num_rows - 1}) holds "
                f"{None if col is None else col.num_values} input_ids values, num_tokens sum to {n}; "
                "rerun pretokenize, pack and gate"
            )
        stats = col.statistics if col is not None else None
        if stats is None or not stats.has_min_max:
            max_id = None if n else max_id
        else:
            if stats.min < 0:
                problems.append(f"{name}: row group {g} holds a negative token id ({stats.min}) in input_ids; {rerun}")
            if max_id is not None:
                max_id = max(max_id, int(stats.max))
        if (problem := _row_group_mask_problem(rg, _leaf_column(meta, "loss_mask"), n)) is not None:
            problems.append(f"{name}: row group {g} {problem}; {rerun}")
        start += rg.num_rows
    return max_id


def _row_group_mask_problem(rg, leaf: int | None, tokens: int) -> str | None:
    """From the Parquet metadata alone: one loss_mask value per token, all 0 or 1 (where statistics tell)."""
    col = rg.column(leaf) if leaf is not None else None
    if col is None or col.num_values != tokens:
        return f"holds {None if col is None else col.num_values} loss_mask values for {tokens} tokens"
    stats = col.statistics
    if stats is not None and stats.has_min_max and (stats.min < 0 or stats.max > 1):
        return f"holds loss_mask values {stats.min}..{stats.max}, not 0 or 1"
    return None


def load_inputs(config: RunConfig, pretokenized: str | Path, plan_dir: str | Path, checkpoint_dir: Path) -> GateInputs:
    pretokenized, plan_dir = Path(pretokenized), Path(plan_dir)
    plan, _ = read_plan(plan_dir)
    manifest, manifest_raw = read_manifest(pretokenized)
    packs_path = plan_dir / PACKS
    packs = read_packs(packs_path)
    doc_tokens, doc_loss, content_hashes = read_doc_columns(pretokenized, manifest)
    content = verify_shards(pretokenized, manifest)
    packs_sha256 = sha256_file(packs_path)
    prefix, prefix_problems = read_prefix(plan_dir, plan)
    return GateInputs(
        config=config,
        plan=plan,
        packs=packs,
        manifest=manifest,
        doc_tokens=doc_tokens,
        doc_loss_tokens=doc_loss,
        packs_sha256=packs_sha256,
        manifest_sha256=hashlib.sha256(manifest_raw).hexdigest(),
        checkpoint_dir=checkpoint_dir,
        content=content,
        prefix=prefix,
        prefix_problems=prefix_problems,
        validation=read_validation(pretokenized, plan_dir, manifest, plan, content_hashes),
        content_hashes=content_hashes,
    )


def read_validation(
    pretokenized: Path, plan_dir: Path, manifest: Manifest, plan: Plan, hashes: np.ndarray
) -> ValidationInputs | None:
    """The split and the validation pass as the gate checks them; a file that cannot be read is a problem of
    the validation checks (they fail naming it), not an input error: the gate still reports every check."""
    if manifest.validation is None and plan.validation is None:
        return None
    problems: list[str] = []
    held = np.zeros(0, dtype=np.int64)
    if manifest.validation is not None:
        try:
            held = read_validation_ids(pretokenized, manifest)
        except InputError as exc:
            problems.append(str(exc))
    else:
        problems.append("plan.json has a validation pass, the pretokenized data no split; rerun pack")
    packs, sha = None, None
    section = plan.validation
    if section is not None:
        path = plan_dir / section.packs
        try:
            packs, sha = read_packs(path), sha256_file(path)
        except (InputError, OSError) as exc:
            problems.append(str(exc))
        if sha is not None and sha != section.packs_sha256:
            problems.append(f"{path.name} changed since it was planned (sha256 differs from plan.json); rerun pack")
    elif manifest.validation is not None:
        problems.append("the pretokenized data holds a validation split, plan.json no validation pass; rerun pack")
    return ValidationInputs(held, hashes, packs, sha, tuple(problems))


def concat_packs(parts: list[PackRows]) -> PackRows:
    """Rows of several plans as one PackRows (doc lists re-offset)."""
    base = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
    offsets = np.concatenate([[0]] + [p.offsets[1:] + b for p, b in zip(parts, base)])
    return PackRows(
        **{
            f: np.concatenate([getattr(p, f) for p in parts])
            for f in ("epoch", "step", "micro", "rank", "slot", "num_tokens", "doc_ids", "doc_lengths")
        },
        offsets=offsets,
        length_offsets=offsets,
    )


def consumed_rows(packs: PackRows, steps: int) -> PackRows:
    """The rows of a segment's first `steps` optimizer steps in run order."""
    key = packs.epoch * (int(packs.step.max()) + 1) + packs.step
    _, ordinal = np.unique(key, return_inverse=True)
    keep = ordinal < steps
    entry_keep = np.repeat(keep, packs.docs_per_row)
    offsets = np.concatenate([[0], np.cumsum(packs.docs_per_row[keep])])
    return PackRows(
        **{f: getattr(packs, f)[keep] for f in ("epoch", "step", "micro", "rank", "slot", "num_tokens")},
        doc_ids=packs.doc_ids[entry_keep],
        doc_lengths=packs.doc_lengths[entry_keep],
        offsets=offsets,
        length_offsets=offsets,
    )


def read_prefix(plan_dir: Path, plan: Plan) -> tuple[PackRows | None, tuple]:
    """The consumed steps of every earlier segment of a continued plan, and what is wrong with their archives."""
    segments = plan.segments or ()
    parts, problems = [], []
    for k, seg in enumerate(segments[:-1]):
        path = plan_dir / seg.packs
        if not path.is_file():
            problems.append(f"segment {k}: {path} is missing (pack keeps it under history/; rerun pack)")
            continue
        if sha256_file(path) != seg.packs_sha256:
            problems.append(f"segment {k}: {path} does not hash to plan.json's packs_sha256")
            continue
        parts.append(consumed_rows(read_packs(path), seg.end_step - seg.first_step))
    return (concat_packs(parts) if parts else None), tuple(problems)

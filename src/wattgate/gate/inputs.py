"""Load the artifacts the gate checks: plan, packs, pretokenized manifest and shard columns.

Everything is read into flat numpy arrays once; each check is then a pure
function over these arrays. Unreadable or malformed input is an InputError
(exit 2), distinct from a failed check (exit 1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.artifacts import sha256_file
from wattgate.data.pretokenize import shard_hash, shard_hash_algorithm
from wattgate.errors import InputError

PACKS_COLUMNS = ("epoch", "step", "micro", "rank", "slot", "doc_ids", "doc_lengths", "num_tokens")
# Up to this many tokens in all shards, the gate decodes every document's input_ids (~60M tokens/s on the
# 2-core bench VM, so <= ~0.07 s) to
# check its length against num_tokens and the true max token id. Above it, the per-row-group checks from
# the Parquet metadata stand in (leaf value count == sum of num_tokens, column statistics max), the shard
# hashes prove the bytes are those pretokenize wrote, and the trainer checks each document it reads.
FULL_CONTENT_CHECK_TOKENS = 4_000_000


@dataclass(frozen=True)
class PackRows:
    """packs.parquet as arrays: one entry per row, documents flattened with row offsets."""

    epoch: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    num_tokens: np.ndarray
    doc_ids: np.ndarray
    doc_lengths: np.ndarray
    offsets: np.ndarray  # row r holds doc_ids[offsets[r]:offsets[r + 1]]
    length_offsets: np.ndarray  # the same for doc_lengths; must equal `offsets` (checked, not assumed)

    def __len__(self) -> int:
        return len(self.epoch)

    @property
    def docs_per_row(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row_of_doc(self) -> np.ndarray:
        return np.repeat(np.arange(len(self)), self.docs_per_row)

    def sum_per_row(self, per_entry: np.ndarray) -> np.ndarray:
        """Sum of a per-document-entry array over each row (rows may be empty)."""
        totals = np.zeros(len(per_entry) + 1, dtype=np.result_type(per_entry.dtype, np.int64))
        np.cumsum(per_entry, out=totals[1:])
        return totals[self.offsets[1:]] - totals[self.offsets[:-1]]

    @classmethod
    def from_table(cls, t: pa.Table) -> "PackRows":
        ids, lengths = t.column("doc_ids").combine_chunks(), t.column("doc_lengths").combine_chunks()

        def offsets_of(lists) -> np.ndarray:
            o = lists.offsets.to_numpy().astype(np.int64)
            return o - o[0]

        offsets = offsets_of(ids)
        return cls(
            **{c: t.column(c).to_numpy().astype(np.int64) for c in ("epoch", "step", "micro", "rank", "slot", "num_tokens")},
            doc_ids=pc.list_flatten(ids).to_numpy().astype(np.int64),
            doc_lengths=pc.list_flatten(lengths).to_numpy().astype(np.int64),
            offsets=offsets,
            length_offsets=offsets_of(lengths),
        )


@dataclass(frozen=True)
class GateInputs:
    config: dict
    plan: dict
    packs: PackRows
    manifest: dict
    doc_tokens: np.ndarray  # by doc_id, from the shards
    doc_loss_tokens: np.ndarray
    packs_sha256: str  # of the files on disk
    manifest_sha256: str
    checkpoint_dir: Path
    content: "ShardContent | None" = None  # shard hashes, true lengths and token ids (None: not verified)
    prefix: "PackRows | None" = None  # a continued plan's consumed steps of its earlier segments (pack/segments.py)
    prefix_problems: tuple = ()        # archived segments that are missing or do not hash to plan.json's record


@dataclass(frozen=True)
class ShardContent:
    """What the shards' bytes say, against what the manifest and num_tokens columns claim."""

    problems: tuple[str, ...]  # hash mismatches, lengths or token ids that disagree
    max_token_id: int | None  # the largest token id in the shards (None: no statistics to tell)
    scope: str  # how far the lengths were verified: "per document" or "per row group"
    algorithm: str
    shards: int


def _read_json(path: Path, what: str, rerun: str) -> tuple[dict, bytes]:
    try:
        raw = path.read_bytes()
        obj = json.loads(raw)
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise InputError(f"{path}{where}: invalid JSON in {what} ({msg}); rerun {rerun}") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: {what} is not a JSON object (found {type(obj).__name__}); rerun {rerun}")
    return obj, raw


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_parquet(path: Path, columns: list[str] | None = None, rerun: str = "the stage that wrote it") -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException, KeyError, ValueError) as exc:
        raise InputError(f"{path}: cannot read ({_first_line(exc)}); rerun {rerun}") from None


def _schema_names(path: Path, rerun: str) -> list[str]:
    try:
        return pq.read_schema(path).names
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise InputError(f"{path}: cannot read ({_first_line(exc)}); rerun {rerun}") from None


def read_packs(path: Path) -> PackRows:
    names = _schema_names(path, "pack")
    missing = [c for c in PACKS_COLUMNS if c not in names]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; rerun pack")
    table = _read_parquet(path, list(PACKS_COLUMNS), "pack")
    try:
        return PackRows.from_table(table)
    except (pa.ArrowException, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{path}: malformed columns ({_first_line(exc)}); rerun pack") from None


def read_doc_columns(pretokenized: Path, manifest: dict) -> tuple[np.ndarray, np.ndarray]:
    """num_tokens and num_loss_tokens of every document, indexed by doc_id."""
    n = manifest.get("num_docs", 0)
    if not isinstance(n, int) or n < 0:
        raise InputError(f"{pretokenized / 'manifest.json'}: 'num_docs' is not a count; rerun pretokenize")
    tokens = np.full(n, -1, dtype=np.int64)
    loss = np.zeros(n, dtype=np.int64)
    shards = manifest.get("shards", [])
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
        raise InputError(f"{pretokenized / 'manifest.json'}: 'shards' is not a list of file names; rerun pretokenize")
    for name in shards:
        path = pretokenized / name
        names = _schema_names(path, "pretokenize")
        has_loss = "num_loss_tokens" in names
        missing = [c for c in ("doc_id", "num_tokens") if c not in names]
        if missing:
            raise InputError(f"{path}: missing column(s) {', '.join(missing)}; rerun pretokenize")
        t = _read_parquet(path, ["doc_id", "num_tokens", "num_loss_tokens" if has_loss else "loss_mask"],
                          "pretokenize")
        ids = t.column("doc_id").to_numpy()
        if len(ids) and (ids.min() < 0 or ids.max() >= n):
            raise InputError(f"{path}: doc_id outside 0..{n - 1} of the manifest; rerun pretokenize")
        tokens[ids] = t.column("num_tokens").to_numpy()
        if has_loss:
            loss[ids] = t.column("num_loss_tokens").to_numpy()
        else:  # shards from before the num_loss_tokens column
            loss[ids] = [int(np.sum(m)) for m in t.column("loss_mask").to_pylist()]
    if (tokens < 0).any():
        raise InputError(f"{pretokenized}: shards miss {(tokens < 0).sum()} of the manifest's doc_ids; rerun pretokenize")
    return tokens, loss


def _leaf_column(meta, prefix: str) -> int | None:
    """Index of the leaf column under `prefix` (e.g. input_ids.list.element) in the Parquet metadata."""
    for i in range(meta.num_columns):
        if meta.schema.column(i).path.startswith(prefix + "."):
            return i
    return None


def verify_shards(pretokenized: Path, manifest: dict, full: bool | None = None) -> ShardContent:
    """Hash every shard's bytes against the manifest; check input_ids lengths against num_tokens and the true max id.

    `full` (default: all shards hold <= FULL_CONTENT_CHECK_TOKENS tokens) decodes every document's
    input_ids; otherwise each row group's input_ids value count (Parquet metadata) must equal the sum
    of its num_tokens and the max comes from the column statistics.
    """
    shards = manifest.get("shards", [])
    expected = manifest.get("shard_hashes")
    algorithm = manifest.get("shard_hash_algorithm", shard_hash_algorithm())
    if full is None:
        full = int(manifest.get("num_tokens", 0) or 0) <= FULL_CONTENT_CHECK_TOKENS
    problems: list[str] = []
    if not isinstance(expected, dict):
        problems.append("manifest has no shard_hashes; rerun pretokenize (then pack and gate)")
    elif algorithm != shard_hash_algorithm():
        problems.append(f"manifest shard_hash_algorithm {algorithm!r}, this install hashes with "
                        f"{shard_hash_algorithm()!r}; rerun pretokenize")
    elif sorted(expected) != sorted(shards):
        problems.append("manifest shard_hashes do not name the same files as shards; rerun pretokenize")
    max_id: int | None = -1
    for name in shards:
        path = pretokenized / name
        if isinstance(expected, dict) and name in expected:
            try:
                if shard_hash(path) != expected[name]:
                    problems.append(f"{name}: content hash differs from the manifest (the shard changed after "
                                    "pretokenize); rerun pretokenize, pack and gate")
            except OSError as exc:
                raise InputError(f"{path}: cannot read ({exc.strerror}); rerun pretokenize") from None
        try:
            if full:
                max_id = _check_documents(path, name, problems, max_id)
            elif max_id is not None:
                max_id = _check_row_groups(path, name, problems, max_id)
        except (OSError, pa.ArrowException, KeyError, ValueError) as exc:
            raise InputError(f"{path}: cannot read ({_first_line(exc)}); rerun pretokenize") from None
    return ShardContent(tuple(problems), None if max_id is None or max_id < 0 else max_id,
                        "per document" if full else "per row group", algorithm, len(shards))


def _check_documents(path: Path, name: str, problems: list[str], max_id: int) -> int:
    t = pq.read_table(path, columns=["doc_id", "input_ids", "num_tokens"])
    ids = t.column("input_ids").combine_chunks()
    actual = pc.list_value_length(ids).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    claimed = t.column("num_tokens").to_numpy().astype(np.int64)
    wrong = np.flatnonzero(actual != claimed)
    if wrong.size:
        r = int(wrong[0])
        problems.append(f"{name}: doc_id {t.column('doc_id')[r].as_py()} holds {actual[r]} tokens, num_tokens says "
                        f"{claimed[r]} ({wrong.size} such document(s)); rerun pretokenize, pack and gate")
    top = pc.max(pc.list_flatten(ids)).as_py()
    return max_id if top is None else max(max_id, int(top))


def _check_row_groups(path: Path, name: str, problems: list[str], max_id: int) -> int | None:
    f = pq.ParquetFile(path)
    meta = f.metadata
    leaf = _leaf_column(meta, "input_ids")
    claimed = f.read(columns=["num_tokens"]).column("num_tokens").to_numpy().astype(np.int64)
    start = 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        n = int(claimed[start:start + rg.num_rows].sum())
        col = rg.column(leaf) if leaf is not None else None
        # one leaf value per token (an empty list would add one null level; documents are never empty)
        if col is None or col.num_values != n:
            problems.append(f"{name}: row group {g} (rows {start}..{start + rg.num_rows - 1}) holds "
                            f"{None if col is None else col.num_values} input_ids values, num_tokens sum to {n}; "
                            "rerun pretokenize, pack and gate")
        stats = col.statistics if col is not None else None
        if stats is None or not stats.has_min_max:
            max_id = None if n else max_id
        elif max_id is not None:
            max_id = max(max_id, int(stats.max))
        start += rg.num_rows
    return max_id


def load_inputs(config: dict, pretokenized: str | Path, plan_dir: str | Path, checkpoint_dir: Path) -> GateInputs:
    pretokenized, plan_dir = Path(pretokenized), Path(plan_dir)
    plan, _ = _read_json(plan_dir / "plan.json", "plan", "pack")
    manifest, manifest_raw = _read_json(pretokenized / "manifest.json", "pretokenized manifest", "pretokenize")
    for key in ("world_size", "seq_len", "micro_batch_size", "grad_accum", "epochs", "steps_per_epoch"):
        if not isinstance(plan.get(key), int):
            raise InputError(f"{plan_dir / 'plan.json'}: missing or non-integer '{key}'; rerun pack")
    if not isinstance(plan.get("stats", {}), dict):
        raise InputError(f"{plan_dir / 'plan.json'}: 'stats' is not a JSON object; rerun pack")
    packs_path = plan_dir / "packs.parquet"
    packs = read_packs(packs_path)
    doc_tokens, doc_loss = read_doc_columns(pretokenized, manifest)
    content = verify_shards(pretokenized, manifest)
    return GateInputs(
        config=config,
        plan=plan,
        packs=packs,
        manifest=manifest,
        doc_tokens=doc_tokens,
        doc_loss_tokens=doc_loss,
        packs_sha256=sha256_file(packs_path),
        manifest_sha256=hashlib.sha256(manifest_raw).hexdigest(),
        checkpoint_dir=checkpoint_dir,
        content=content,
        **dict(zip(("prefix", "prefix_problems"), read_prefix(plan_dir, plan))),
    )


def concat_packs(parts: list[PackRows]) -> PackRows:
    """Rows of several plans as one PackRows (doc lists re-offset)."""
    base = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
    offsets = np.concatenate([[0]] + [p.offsets[1:] + b for p, b in zip(parts, base)])
    return PackRows(**{f: np.concatenate([getattr(p, f) for p in parts])
                       for f in ("epoch", "step", "micro", "rank", "slot", "num_tokens", "doc_ids", "doc_lengths")},
                    offsets=offsets, length_offsets=offsets)


def consumed_rows(packs: PackRows, steps: int) -> PackRows:
    """The rows of a segment's first `steps` optimizer steps in run order."""
    key = packs.epoch * (int(packs.step.max()) + 1) + packs.step
    _, ordinal = np.unique(key, return_inverse=True)
    keep = ordinal < steps
    entry_keep = np.repeat(keep, packs.docs_per_row)
    offsets = np.concatenate([[0], np.cumsum(packs.docs_per_row[keep])])
    return PackRows(**{f: getattr(packs, f)[keep] for f in ("epoch", "step", "micro", "rank", "slot", "num_tokens")},
                    doc_ids=packs.doc_ids[entry_keep], doc_lengths=packs.doc_lengths[entry_keep], offsets=offsets,
                    length_offsets=offsets)


def read_prefix(plan_dir: Path, plan: dict) -> tuple[PackRows | None, tuple]:
    """The consumed steps of every earlier segment of a continued plan, and what is wrong with their archives."""
    segments = plan.get("segments") or []
    parts, problems = [], []
    for k, seg in enumerate(segments[:-1]):
        path = plan_dir / str(seg.get("packs", ""))
        if not path.is_file():
            problems.append(f"segment {k}: {path} is missing (pack keeps it under history/; rerun pack)")
            continue
        if sha256_file(path) != seg.get("packs_sha256"):
            problems.append(f"segment {k}: {path} does not hash to plan.json's packs_sha256")
            continue
        parts.append(consumed_rows(read_packs(path), int(seg["end_step"]) - int(seg["first_step"])))
    return (concat_packs(parts) if parts else None), tuple(problems)

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
from wattgate.errors import InputError


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


def _read_json(path: Path, what: str) -> tuple[dict, bytes]:
    try:
        raw = path.read_bytes()
        return json.loads(raw), raw
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: invalid JSON in {what} ({exc.msg})") from None


def _read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot read ({str(exc).splitlines()[0]})") from None


def read_doc_columns(pretokenized: Path, manifest: dict) -> tuple[np.ndarray, np.ndarray]:
    """num_tokens and num_loss_tokens of every document, indexed by doc_id."""
    n = int(manifest.get("num_docs", 0))
    tokens = np.full(n, -1, dtype=np.int64)
    loss = np.zeros(n, dtype=np.int64)
    for name in manifest.get("shards", []):
        path = pretokenized / name
        names = pq.read_schema(path).names if path.exists() else []
        has_loss = "num_loss_tokens" in names
        t = _read_parquet(path, ["doc_id", "num_tokens", "num_loss_tokens" if has_loss else "loss_mask"])
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


def load_inputs(config: dict, pretokenized: str | Path, plan_dir: str | Path, checkpoint_dir: Path) -> GateInputs:
    pretokenized, plan_dir = Path(pretokenized), Path(plan_dir)
    plan, _ = _read_json(plan_dir / "plan.json", "plan")
    manifest, manifest_raw = _read_json(pretokenized / "manifest.json", "pretokenized manifest")
    for key in ("world_size", "seq_len", "micro_batch_size", "grad_accum", "epochs", "steps_per_epoch"):
        if not isinstance(plan.get(key), int):
            raise InputError(f"{plan_dir / 'plan.json'}: missing or non-integer '{key}'; rerun pack")
    packs_path = plan_dir / "packs.parquet"
    packs = PackRows.from_table(_read_parquet(packs_path))
    doc_tokens, doc_loss = read_doc_columns(pretokenized, manifest)
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
    )

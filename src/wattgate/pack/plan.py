"""The pack stage: pretokenized manifest -> plan.json + packs.parquet (see ARCHITECTURE.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path, canonical_json, sha256_file
from wattgate.config import world_size
from wattgate.errors import InputError
from wattgate.pack.assign import Layout, assign_ranks, assign_uneven, pack_costs, rank_cost_ratios
from wattgate.pack.remainder import DROP_REASON_REMAINDER, Packs, apply_remainder

FORMAT_VERSION = 1

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


def read_manifest(pretokenized: Path) -> tuple[dict, str]:
    path = pretokenized / "manifest.json"
    try:
        raw = path.read_bytes()
        manifest = json.loads(raw)
    except OSError as exc:
        raise InputError(f"{path}: cannot read pretokenized manifest ({exc.strerror}); run pretokenize first") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    for key in ("format_version", "num_docs", "shards"):
        if key not in manifest:
            raise InputError(f"{path}: missing key '{key}'; rerun pretokenize")
    return manifest, hashlib.sha256(raw).hexdigest()


def read_doc_lengths(pretokenized: Path, manifest: dict) -> np.ndarray:
    """Token count of every document, indexed by doc_id (which must be dense 0..n-1)."""
    ids, lengths = [], []
    for name in manifest["shards"]:
        path = pretokenized / name
        try:
            t = pq.read_table(path, columns=["doc_id", "num_tokens"])
        except (OSError, pa.ArrowInvalid) as exc:
            raise InputError(f"{path}: cannot read shard ({exc}); rerun pretokenize") from None
        ids.append(t.column("doc_id").to_numpy())
        lengths.append(t.column("num_tokens").to_numpy())
    doc_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    n = manifest["num_docs"]
    if len(doc_ids) != n or not np.array_equal(doc_ids, np.arange(n)):
        raise InputError(f"{pretokenized}: shards hold {len(doc_ids)} doc_ids, manifest says {n} dense ids; rerun pretokenize")
    return np.concatenate(lengths).astype(np.int64)


def plan_stats(placement, lengths, tokens, costs, layout: Layout, seq_len: int, dropped_docs) -> dict:
    W = layout.world_size
    per_rank_tokens = np.bincount(placement.rank, weights=tokens[placement.pack], minlength=W).astype(np.int64)
    per_rank_packs = np.bincount(placement.rank, minlength=W)
    epochs = int(placement.epoch.max()) + 1
    micro_key = (placement.step * (int(placement.micro.max()) + 1) + placement.micro)
    per_rank_micro, per_rank_steps = [], []
    for r in range(W):
        sel = placement.rank == r
        per_rank_micro.append(
            [int(len(np.unique(micro_key[sel & (placement.epoch == e)]))) for e in range(epochs)]
        )
        per_rank_steps.append(
            [int(len(np.unique(placement.step[sel & (placement.epoch == e)]))) for e in range(epochs)]
        )
    stats = {
        "num_docs": int(len(lengths)),
        "num_tokens": int(lengths.sum()),
        "packs_per_epoch": int(len(tokens)),
        "efficiency": float(tokens.sum() / (len(tokens) * seq_len)),
        "per_rank_tokens": per_rank_tokens.tolist(),
        "per_rank_packs": per_rank_packs.tolist(),
        "per_rank_micro_batches_per_epoch": per_rank_micro,
        "per_rank_steps_per_epoch": per_rank_steps,
        "dropped": {},
        "dropped_doc_ids": [int(d) for d in dropped_docs],
    }
    if len(dropped_docs):
        stats["dropped"][DROP_REASON_REMAINDER] = {"docs": int(len(dropped_docs)), "tokens": int(lengths[dropped_docs].sum())}
    stats.update(rank_cost_ratios(placement, costs, W))
    return stats


def plan_packs(lengths: np.ndarray, seq_len: int, layout: Layout, remainder: str, epochs: int, seed: int,
               attn_weight: float):
    """Pure core of the stage: (packs, placement, tokens per pack, cost per pack)."""
    packs = apply_remainder(lengths, seq_len, remainder, layout.world_size, layout.packs_per_step)
    tokens = packs.sum_per_pack(lengths)
    sum_sq = packs.sum_per_pack(lengths**2)
    costs = pack_costs(tokens, sum_sq, attn_weight)
    if packs.rank_of_pack is not None:
        placement = assign_uneven(packs.rank_of_pack, layout, epochs, seed)
    else:
        placement = assign_ranks(costs, layout, epochs, seed)
    return packs, placement, tokens, costs


def build_plan(config: dict, pretokenized: str | Path, out: str | Path) -> dict:
    pretokenized, out = Path(pretokenized), Path(out)
    manifest, manifest_sha = read_manifest(pretokenized)
    lengths = read_doc_lengths(pretokenized, manifest)
    train, pack = config["train"], config["pack"]
    seq_len = train["seq_len"]
    if len(lengths) and lengths.max() > seq_len:
        worst = int(np.argmax(lengths))
        raise InputError(
            f"{pretokenized}: doc_id {worst} has {lengths[worst]} tokens > train.seq_len {seq_len}; "
            "rerun pretokenize with pretokenize.max_tokens <= seq_len"
        )
    layout = Layout(world_size(config), train["micro_batch_size"], train["grad_accum"])
    packs, placement, tokens, costs = plan_packs(
        lengths, seq_len, layout, pack["remainder"], train["epochs"], pack["seed"], pack["attn_weight"]
    )

    stats = plan_stats(placement, lengths, tokens, costs, layout, seq_len, packs.dropped_docs)
    plan = {
        "format_version": FORMAT_VERSION,
        "world_size": layout.world_size,
        "seq_len": seq_len,
        "micro_batch_size": layout.micro_batch_size,
        "grad_accum": layout.grad_accum,
        "epochs": train["epochs"],
        "steps_per_epoch": int(placement.step.max()) + 1,
        "strategy": STRATEGY[pack["remainder"]],
        "remainder": pack["remainder"],
        "seed": pack["seed"],
        "attn_weight": pack["attn_weight"],
        "pretokenized_manifest_sha256": manifest_sha,
        "packs_sha256": None,  # set from the written file in publish_plan
        "stats": stats,
    }
    return publish_plan(out, plan, lambda tmp: write_packs_table(tmp, placement, packs, lengths, tokens))


def publish_plan(out: Path, plan: dict, write_packs_to) -> dict:
    """Publish packs.parquet and plan.json as one set: plan.json is the commit record.

    Both are written in full under temporary names first. Then the old plan.json is removed,
    packs.parquet is renamed into place, and plan.json (carrying packs_sha256) last. A kill at
    any point leaves the old pair, or no plan.json (the stage reads as not run: rerun pack), or
    the new pair: never a plan.json beside packs it does not describe. The folder itself is not
    swapped, since it also holds files that are not pack's (Snakemake's pack.log, written while
    pack runs).
    """
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    with atomic_path(plan_path) as plan_tmp:
        with atomic_path(out / "packs.parquet") as packs_tmp:
            write_packs_to(packs_tmp)
            plan = dict(plan, packs_sha256=sha256_file(packs_tmp))
            plan_tmp.write_bytes(canonical_json(plan).encode())
            plan_path.unlink(missing_ok=True)  # retire the old commit record before its packs change
        # packs.parquet is in place here; plan.json follows as this block ends
    return plan


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

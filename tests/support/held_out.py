"""An independent reference for the validation pass's per-source losses: one process, each held-out document
scored alone (no packing, no ranks) by a model's own forward, grouped by the shards' `source` column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from wattgate.data.split import read_validation_ids
from wattgate.train.data import IGNORE, DocStore


def held_out_sources(pretokenized: Path) -> dict[int, str]:
    """doc_id -> source of every held-out document, read straight from the shards."""
    manifest = json.loads((pretokenized / "manifest.json").read_text())
    held = set(read_validation_ids(pretokenized, manifest).tolist())
    out = {}
    for shard in manifest["shards"]:
        t = pq.read_table(pretokenized / shard, columns=["doc_id", "source"]).to_pydict()
        out.update({d: s for d, s in zip(t["doc_id"], t["source"]) if d in held})
    return out


def scored_alone_by_source(model, pretokenized: Path) -> dict[str, tuple[float, int]]:
    """source -> (summed next-token loss over its held-out documents' loss tokens, those tokens), each document
    alone through `model` in float64 cross-entropy."""
    store, totals = DocStore(pretokenized), {}
    with torch.no_grad():
        for doc, source in sorted(held_out_sources(pretokenized).items()):
            ids, mask = store.get(doc)
            labels = np.where(mask.astype(bool), ids, IGNORE)
            labels[0] = IGNORE
            logits = model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False).logits[0]
            target = torch.from_numpy(labels[1:].astype(np.int64))
            loss = float(F.cross_entropy(logits[:-1].double(), target, ignore_index=IGNORE, reduction="sum"))
            total, tokens = totals.get(source, (0.0, 0))
            totals[source] = (total + loss, tokens + int((target != IGNORE).sum()))
    return totals


def exported_model_scores(final: Path, pretokenized: Path) -> dict[str, tuple[float, int]]:
    """scored_alone_by_source with a run's final/ loaded by transformers itself (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True, attn_implementation="eager")
    return scored_alone_by_source(model, pretokenized)

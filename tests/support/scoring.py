"""References computed by transformers itself, outside wattgate: the loss of a model's own forward on documents
scored one by one (no packing, no ranks), for the tests that check what wattgate reports and exports: the
whole held-out split, per source (the shards' `source` column), and one step's gradient norm."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from wattgate.data.split import read_validation_ids
from wattgate.run_files import read_manifest
from wattgate.train.data import IGNORE, DocStore


def document_loss(model, ids: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, int]:
    """One document alone through `model`'s own forward: its summed next-token loss over the loss-bearing tokens
    (the mask; never the document's first token, which nothing predicts) and how many there are."""
    labels = np.where(mask.astype(bool), ids, IGNORE)
    labels[0] = IGNORE
    logits = model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False).logits[0]
    target = torch.from_numpy(labels[1:].astype(np.int64))
    loss = F.cross_entropy(logits[:-1].double(), target, ignore_index=IGNORE, reduction="sum")
    return loss, int((target != IGNORE).sum())


def exported_model(final: Path):
    """A run's final/ loaded by transformers itself, eager attention, in float32 (as wattgate validates on CPU: a
    bf16 export's weights are upcast, not computed in bf16)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(final), local_files_only=True, attn_implementation="eager", dtype=torch.float32
    )


def scored_by_transformers(final: Path, pretokenized: Path) -> float:
    """The exported model's loss over the held-out documents, each scored alone by its own forward."""
    model = exported_model(final)
    manifest, _ = read_manifest(pretokenized)
    store, total, tokens = DocStore(pretokenized), 0.0, 0
    with torch.no_grad():
        for doc in read_validation_ids(pretokenized, manifest).tolist():
            loss, count = document_loss(model, *store.get(doc))
            total, tokens = total + float(loss), tokens + count
    return total / tokens


def held_out_sources(pretokenized: Path) -> dict[int, str]:
    """doc_id -> source of every held-out document, read straight from the shards."""
    manifest, _ = read_manifest(pretokenized)
    held = set(read_validation_ids(pretokenized, manifest).tolist())
    out = {}
    for shard in manifest.shards:
        t = pq.read_table(pretokenized / shard, columns=["doc_id", "source"]).to_pydict()
        out.update({d: s for d, s in zip(t["doc_id"], t["source"]) if d in held})
    return out


def scored_alone_by_source(model, pretokenized: Path) -> dict[str, tuple[float, int]]:
    """source -> (summed next-token loss over its held-out documents' loss tokens, those tokens), each document
    alone through `model` in float64 cross-entropy."""
    store, totals = DocStore(pretokenized), {}
    with torch.no_grad():
        for doc, source in sorted(held_out_sources(pretokenized).items()):
            loss, count = document_loss(model, *store.get(doc))
            total, tokens = totals.get(source, (0.0, 0))
            totals[source] = (total + float(loss), tokens + count)
    return totals


def exported_model_scores(final: Path, pretokenized: Path) -> dict[str, tuple[float, int]]:
    """scored_alone_by_source with a run's final/ loaded by transformers itself."""
    return scored_alone_by_source(exported_model(final), pretokenized)


def reference_grad_norm(folder: Path, pretokenized: Path, doc_ids: list[int]) -> float:
    """The gradient norm of one optimizer step over `doc_ids` in a single process: the model in `folder` in
    float32, each document alone through its own forward, the summed loss over the step's loss tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True, attn_implementation="eager", dtype=torch.float32
    )
    store, losses, tokens = DocStore(pretokenized), [], 0
    for doc in doc_ids:
        loss, count = document_loss(model, *store.get(doc))
        losses.append(loss)
        tokens += count
    (torch.stack(losses).sum() / tokens).backward()
    grads = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm())

"""References computed by transformers itself, outside wattgate: the loss of a model's own forward on documents
scored one by one (no packing), for the tests that check what wattgate reports and exports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from wattgate.data.split import read_validation_ids
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


def scored_by_transformers(final: Path, pretokenized: Path) -> float:
    """The exported model loaded by transformers itself, each held-out document scored alone by its own forward
    (in float32, as wattgate validates on CPU: a bf16 export's weights are upcast, not computed in bf16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(final), local_files_only=True, attn_implementation="eager", dtype=torch.float32
    )
    manifest = json.loads((pretokenized / "manifest.json").read_text())
    store, total, tokens = DocStore(pretokenized), 0.0, 0
    with torch.no_grad():
        for doc in read_validation_ids(pretokenized, manifest).tolist():
            loss, count = document_loss(model, *store.get(doc))
            total, tokens = total + float(loss), tokens + count
    return total / tokens


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

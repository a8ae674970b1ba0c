"""Run under torchrun (4 gloo ranks on CPU) by tests/test_context_parallel.py: context-parallel loss and gradients
against one rank holding the whole rows, for several dense families, at C = 2 (two groups of two ranks) and C = 4.

Every rank builds the same float32 model (same seed) and the same packed rows: short documents, one that crosses
chunk boundaries, assistant-style spans without loss, and a row whose last chunk is only padding (labels IGNORE,
position_ids continuing the padding block as build_batch lays it out). Rank 0 computes the reference (sdpa, the whole
rows: loss_sum of the model's own logits) and broadcasts its loss and gradients; each rank compares its group's
all-reduced shard losses and gradients with them. A leak control (every token in one document) shows the comparison
sees a wrong mask. Rank 0 writes argv[1] (JSON): per family and C, the losses and the largest differences."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from wattgate.train.context_parallel import (
    ContextAttention,
    context_loss_sum,
    shard_rows,
    use_context_attention,
)
from wattgate.train.data import IGNORE
from wattgate.train.loss import forward_logits, loss_sum

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.architectures import tiny_config  # noqa: E402

FAMILIES = ("qwen3", "llama", "gemma3_text")  # gemma3_text: sliding layers (window 8), query_pre_attn_scalar
CONTEXTS = (2, 4)
SEQ_LEN = 4096  # 2C chunks of 1024 (C = 2) and 512 (C = 4)
PADDED_FROM = 3000  # row 1's documents end here: its last chunk at either C is padding only


def packed_row(lengths: list[int], g: torch.Generator, vocab: int) -> dict[str, torch.Tensor]:
    """One row as build_batch makes it: documents of `lengths`, then a padding block (pad id 0, no loss, positions
    counting on from 0); each document's first token and a random prompt span carry no loss."""
    ids = torch.zeros(SEQ_LEN, dtype=torch.int64)
    labels = torch.full((SEQ_LEN,), IGNORE, dtype=torch.int64)
    positions = torch.zeros(SEQ_LEN, dtype=torch.int64)
    start = 0
    for n in lengths:
        ids[start : start + n] = torch.randint(3, vocab, (n,), generator=g)
        prompt = int(torch.randint(1, max(2, n // 3), (1,), generator=g))
        labels[start + prompt : start + n] = ids[start + prompt : start + n]
        positions[start : start + n] = torch.arange(n)
        start += n
    positions[start:] = torch.arange(SEQ_LEN - start)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def rows(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows: row 0 filled to the end (1- and 2-token documents, one of 1700 over several chunk boundaries),
    row 1 documents up to PADDED_FROM then padding."""
    g = torch.Generator().manual_seed(7)
    first = [1, 2, 5, 300, 1700, 3, 90]
    first += torch.randint(20, 400, (4,), generator=g).tolist()
    first.append(SEQ_LEN - sum(first))
    second = torch.randint(1, 600, (6,), generator=g).tolist()
    second.append(PADDED_FROM - sum(second))
    assert min(first) > 0 and min(second) > 0
    built = [packed_row(first, g, vocab), packed_row(second, g, vocab)]
    return {k: torch.stack([r[k] for r in built]) for k in built[0]}


def build_model(family: str):
    cfg = dict(tiny_config(family, layers=2), max_position_embeddings=SEQ_LEN)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def reference(model, batch: dict[str, torch.Tensor], owner: int) -> torch.Tensor:
    """[loss, gradients...] of the whole rows on one rank (`owner`: the families' references run on different
    ranks at once), broadcast to every rank."""
    numel = sum(p.numel() for p in model.parameters())
    out = torch.empty(1 + numel)
    if dist.get_rank() == owner:
        loss = loss_sum(forward_logits(model, batch), batch["labels"])
        loss.backward()
        out = torch.cat([loss.detach().reshape(1), flat_grads(model)])
        model.zero_grad(set_to_none=True)
    dist.broadcast(out, owner)
    return out


def context_run(model, batch, group) -> torch.Tensor:
    """[loss, gradients...] summed over `group`'s shards."""
    shard = shard_rows(batch, dist.get_world_size(group), dist.get_rank(group))
    loss = context_loss_sum(model, shard, group)
    loss.backward()
    out = torch.cat([loss.detach().reshape(1), flat_grads(model)])
    model.zero_grad(set_to_none=True)
    dist.all_reduce(out, group=group)
    return out


def leaking_loss(model, batch, group) -> float:
    """The loss with every token of a row in one document (a wrong mask): what a leak would measure."""
    shard = shard_rows(batch, dist.get_world_size(group), dist.get_rank(group))
    ctx = ContextAttention(group, shard["query_index"], shard["key_index"], torch.zeros_like(shard["doc_ids"]))
    with torch.no_grad():
        inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"], "use_cache": False}
        logits = model(**inputs, wattgate_context=ctx).logits
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), shard["targets"].flatten(), ignore_index=IGNORE, reduction="sum"
        ).reshape(1)
    dist.all_reduce(loss, group=group)
    return float(loss)


def worst(values: list[float]) -> float:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.max())


def grad_differences(model, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """The largest gradient difference, absolute and relative to its own parameter's largest reference gradient
    (so a small parameter's wrong gradient does not hide under a large one's scale)."""
    absolute, relative, start = 0.0, 0.0, 1
    for p in model.parameters():
        d = float((got[start : start + p.numel()] - ref[start : start + p.numel()]).abs().max())
        scale = float(ref[start : start + p.numel()].abs().max())
        absolute, relative = max(absolute, d), max(relative, d / max(scale, 1e-30))
        start += p.numel()
    return absolute, relative


def compare(model, batch, ref: torch.Tensor, group) -> dict:
    got = context_run(model, batch, group)
    absolute, relative = grad_differences(model, got, ref)
    return {
        "loss": float(got[0]),
        "loss_diff": worst([abs(float(got[0] - ref[0]))]),
        "grad_max_diff": worst([absolute]),
        "grad_max_rel_diff": worst([relative]),
        "grad_max": float(ref[1:].abs().max()),
    }


def main() -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 4, "run with --nproc-per-node=4"
    pair, _ = dist.new_subgroups(2)  # C = 2: ranks {0, 1} and {2, 3}, each a context group over the same rows
    groups = {2: pair, 4: dist.group.WORLD}
    started = time.perf_counter()
    models = {family: build_model(family) for family in FAMILIES}
    batch = rows(min(m.config.vocab_size for m in models.values()))
    refs = {family: reference(m, batch, owner=i % 4) for i, (family, m) in enumerate(models.items())}
    report: dict = {"seq_len": SEQ_LEN, "reference_seconds": time.perf_counter() - started, "families": {}}
    for family, model in models.items():
        ref = refs[family]
        use_context_attention(model)
        entry = {"loss": float(ref[0]), "loss_tokens": int((batch["labels"][:, 1:] != IGNORE).sum())}
        for c in CONTEXTS:
            tick = time.perf_counter()
            entry[str(c)] = compare(model, batch, ref, groups[c])
            entry[str(c)]["seconds"] = time.perf_counter() - tick
        entry["leak_loss_diff"] = worst([abs(leaking_loss(model, batch, groups[2]) - float(ref[0]))])
        report["families"][family] = entry
    report["seconds"] = time.perf_counter() - started
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Run under torchrun by tests/test_loss.py: the sharded model (FSDP2, as the train stage builds it) takes
one optimizer step's gradients with each loss kind over two micro-batches (gradient sync on the last only,
as train_step does); rank 0 writes both kinds' summed losses and every parameter's full gradient
differences, and whether the head was resharded after backward and after a no-grad forward."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from wattgate.config import run_config, validate_config
from wattgate.train.data import IGNORE
from wattgate.train.distributed import setup_rank
from wattgate.train.loss import summed_token_loss
from wattgate.train.model import load_sharded_model

config = validate_config(yaml.safe_load(Path(sys.argv[1]).read_text()))
out = Path(sys.argv[2])
train = run_config(config).train
rank, world, device = setup_rank(60, out)
model, _ = load_sharded_model(config["model"], train, init_device_mesh("cpu", (world,)), device)
vocab, seq, mbs = model.config.vocab_size, train.seq_len, train.micro_batch_size


def micro_batch(k: int) -> dict[str, torch.Tensor]:
    """Rank- and micro-specific packed rows: two documents per row, an assistant-style mask on the first."""
    g = torch.Generator().manual_seed(100 * rank + k)
    ids = torch.randint(0, vocab, (mbs, seq), generator=g)
    cut = seq // 3
    position_ids = torch.cat([torch.arange(cut), torch.arange(seq - cut)]).repeat(mbs, 1)
    labels = ids.clone()
    labels[:, : cut // 2] = IGNORE  # the "prompt" of the first document carries no loss
    labels[:, 0] = labels[:, cut] = IGNORE  # nothing precedes a document's first token
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


def step_grads(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    total = 0.0
    for k in range(2):
        model.set_requires_gradient_sync(k == 1)
        loss = summed_token_loss(model, micro_batch(k), kind, 7)  # 7: chunks that do not divide the rows
        (loss * world).backward()  # FSDP averages over ranks: x world makes it the sum
        total += float(loss.detach())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    totals = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals), grads


def head_sharded() -> bool:
    return isinstance(model.get_output_embeddings().weight, DTensor)


full_loss, full = step_grads("full")
chunked_loss, chunked = step_grads("chunked")
resharded_after_backward = head_sharded()
with torch.no_grad():
    no_grad_loss = float(summed_token_loss(model, micro_batch(0), "chunked", 7))
    no_grad_full = float(summed_token_loss(model, micro_batch(0), "full", 7))
resharded_after_no_grad = head_sharded()
if rank == 0:
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "world": world,
        "tied": bool(model.config.tie_word_embeddings),
        "full_loss": full_loss,
        "chunked_loss": chunked_loss,
        "no_grad_chunked": no_grad_loss,
        "no_grad_full": no_grad_full,
        "max_grad_delta": max((full[n] - chunked[n]).abs().max().item() for n in full),
        "max_grad": max(g.abs().max().item() for g in full.values()),
        "resharded_after_backward": resharded_after_backward,
        "resharded_after_no_grad": resharded_after_no_grad,
    }
    (out / "loss-probe.json").write_text(json.dumps(report))
dist.barrier()
dist.destroy_process_group()

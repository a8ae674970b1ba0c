"""Run under torchrun (2 gloo ranks) by tests/test_moe.py: a tiny Qwen3-MoE, sharded as training shards it
(train/model.py parallelize), takes one step's gradients with its routing skewed so that rank 1 sends no token to
the last expert while rank 0 does (the router excludes that expert on rank 1).

argv: config.yaml, out folder, then one or more cases `<layout>:<construction>`:
- layout `fused`: transformers 5's experts, one 3-D parameter per projection (as wattgate trains them);
  `per_expert`: transformers 4's layout, one MLP module per expert, a loop over the experts that got tokens (as
  custom model code and older checkpoints have it): an expert without a token there has no gradient on rank 1;
- construction `on`: train/moe.py's (every FSDP2 unit reduce-scatters all its parameters); `off`: disabled here.

Per case rank 0 writes <out>/<layout>-<construction>.json: the tokens each rank routed to each expert of layer 0,
the summed loss, and the largest difference of every parameter's reduced gradient from a single-process reference
that runs both ranks' micro-batches with the same routing. A case whose ranks' collectives differ never gets there:
gloo aborts the rank ("Received data size doesn't match expected size"), NCCL would hang or mix up gradients.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import wattgate.train.moe as moe
from wattgate.config import run_config, validate_config
from wattgate.train.data import IGNORE
from wattgate.train.distributed import setup_rank
from wattgate.train.loss import summed_token_loss
from wattgate.train.model import build_meta_model, layer_container, parallelize
from wattgate.train.weights import materialize

config = validate_config(yaml.safe_load(Path(sys.argv[1]).read_text()))
out = Path(sys.argv[2])
cases = [c.split(":") for c in sys.argv[3:]]
train = run_config(config).train
out.mkdir(parents=True, exist_ok=True)
rank, world, device = setup_rank(60, out)
mesh = init_device_mesh("cpu", (world,))
construction = moe.reduce_every_parameter


class PerExpertExperts(torch.nn.Module):
    """transformers 4's Qwen3-MoE experts: a ModuleList of MLPs, run only for the experts that got tokens."""

    def __init__(self, config):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

        super().__init__()
        self.num_experts = config.num_experts
        mlp = [Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(self.num_experts)]
        self.experts = torch.nn.ModuleList(mlp)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            top_k_pos, token_idx = torch.where(mask[e])
            if token_idx.numel() == 0:  # no token: this expert's parameters get no gradient
                continue
            out = self.experts[e](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final = final.index_add(0, token_idx, out.to(final.dtype))
        return final


def skewed_router(router, exclude: bool, counts: list):
    """Qwen3MoeTopKRouter's forward, the last expert excluded when `exclude`; each call's per-expert token counts
    appended to `counts`."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden_states, router.weight)
        masked = logits
        if exclude:
            masked = logits.masked_fill(torch.arange(router.num_experts) == router.num_experts - 1, float("-inf"))
        probs = torch.softmax(masked, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        counts.append(torch.bincount(index.flatten(), minlength=router.num_experts).tolist())
        return logits, top.to(logits.dtype), index

    return forward


def build(layout: str, sharded: bool, exclude: bool, counts: list):
    model = build_meta_model(config["model"], "sdpa")
    for layer in layer_container(model):
        if layout == "per_expert":
            with torch.device("meta"):
                layer.mlp.experts = PerExpertExperts(model.config)
        layer.mlp.gate.forward = skewed_router(layer.mlp.gate, exclude, counts)
    if sharded:
        parallelize(model, mesh, False, False, False)
    materialize(model, device, config["model"], train.seed)  # seeded per name: the same values sharded or not
    return model.train()


def micro_batch(r: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + r)
    ids = torch.randint(3, model_vocab, (2, 32), generator=g)
    position_ids = torch.cat([torch.arange(12), torch.arange(20)]).repeat(2, 1)
    labels = ids.clone()
    labels[:, 0] = labels[:, 12] = IGNORE
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


model_vocab = int(config["model"]["config"]["vocab_size"])
loss_keys = ("chunked", 16)  # train.loss and its chunk size
batches = [micro_batch(r) for r in range(world)]
tokens = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)
for layout, switch in cases:
    moe.reduce_every_parameter = construction if switch == "on" else (lambda model: False)
    counts: list = []
    model = build(layout, True, rank == 1, counts)
    summed = summed_token_loss(model, batches[rank], *loss_keys)
    (summed * world / tokens).backward()  # FSDP2 averages over ranks: the sum over ranks / all loss tokens
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    routed = [None] * world
    dist.all_gather_object(routed, counts[0])  # layer 0's routing on each rank
    losses = [None] * world
    dist.all_gather_object(losses, float(summed.detach()))
    if rank == 0:
        ref_counts: list = []
        reference = {}
        total = torch.zeros(())
        for r in range(world):  # both ranks' micro-batches in one process, each with its rank's routing
            ref = build(layout, False, r == 1, ref_counts)
            loss = summed_token_loss(ref, batches[r], *loss_keys) / tokens
            loss.backward()
            total += loss.detach() * tokens
            for n, p in ref.named_parameters():
                reference[n] = reference.get(n, 0) + (p.grad if p.grad is not None else torch.zeros_like(p))
        delta = max((grads[n] - reference[n]).abs().max().item() for n in reference)
        last = f"{layout}-{switch}.json"
        (out / last).write_text(
            json.dumps(
                {
                    "routed": routed,
                    "loss": sum(losses),
                    "reference_loss": float(total),
                    "max_grad_delta": delta,
                    "max_grad": max(g.abs().max().item() for g in reference.values()),
                    "reduces_every_parameter": moe.every_parameter_reduced(model),
                }
            )
        )
    dist.barrier()
dist.destroy_process_group()

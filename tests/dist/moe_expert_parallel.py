"""Run under torchrun (gloo) by tests/test_expert_parallel.py: a tiny random-init MoE trained a few AdamW steps,
sharded as training shards it (train/mesh.py, train/model.py parallelize), once per expert-parallel degree.

argv: cases.json, out folder, then the degrees (e.g. 1 2). cases.json lists the cases one process group runs in
turn (torchrun's start-up once): each a `name`, a `config` (a config file's path) and a `routing`: `free`, the
model's own router; `one_sided`, the last rank's router never picks the first rank's experts (it sends that peer
zero rows); `starved`, no rank's router picks the first rank's experts (the first rank receives no row at all).

Rank 0 writes <out>/<name>/ep<E>.json per case and degree: every step's summed loss over ranks, the first step's
reduced gradient norm, the first step's full gradients and the final parameters (lists), so the test compares the
degrees.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.distributed.tensor import DTensor

from wattgate.config import run_config, validate_config
from wattgate.train.data import IGNORE
from wattgate.train.distributed import setup_rank
from wattgate.train.loss import summed_token_loss
from wattgate.train.mesh import data_parallel_mesh
from wattgate.train.attention import resolve_attn_implementation
from wattgate.train.model import causal_lm_class, clip_grad_norm, layer_container, meta_model_of, model_hf_config
from wattgate.train.model import parallelize
from wattgate.train.weights import materialize

STEPS = 3
cases = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
degrees = [int(d) for d in sys.argv[3:]]
out.mkdir(parents=True, exist_ok=True)
rank, world, device = setup_rank(120, out)


def excluded_router(router, exclude: list[int]):
    """Qwen3MoeTopKRouter's forward with the experts `exclude` never picked (their probability zero)."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden_states, router.weight)
        masked = logits.masked_fill(torch.isin(torch.arange(router.num_experts), torch.tensor(exclude)), -torch.inf)
        probs = torch.softmax(masked, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    return forward


def build(config: dict, routing: str, degree: int):
    hf_config = model_hf_config(config["model"])
    # what `auto` picks on CPU: sdpa, or eager where transformers has no sdpa for the class (GPT-OSS)
    model = meta_model_of(hf_config, resolve_attn_implementation("auto", "cpu", False, causal_lm_class(hf_config)))
    starve = routing == "starved" or (routing == "one_sided" and rank == world - 1)
    if starve:  # Qwen3-MoE's router (the skewed routings are run on it)
        first_rank_experts = list(range(model.config.num_experts // max(degrees)))
        for layer in layer_container(model):
            layer.mlp.gate.forward = excluded_router(layer.mlp.gate, first_rank_experts)
    mesh = data_parallel_mesh("cpu", world, 1, degree)
    parallelize(model, mesh, False, False, False)
    materialize(model, device, config["model"], run_config(config).train.seed)
    return model.train()


def micro_batch(step: int, r: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + r)
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    labels = ids.clone()
    labels[:, 0] = labels[:, 10] = IGNORE
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


def full(t) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def trained(config: dict, routing: str, degree: int) -> dict:
    """STEPS SGD steps of the case's model at `degree`: what ep<E>.json holds."""
    vocab = int(config["model"]["config"]["vocab_size"])
    model = build(config, routing, degree)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # linear in the gradients: the degrees stay comparable
    losses, first_grads, first_norm = [], {}, 0.0
    for step in range(STEPS):
        batches = [micro_batch(step, r, vocab) for r in range(world)]
        tokens = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)
        summed = summed_token_loss(model, batches[rank], "chunked", 16)
        (summed * world / tokens).backward()  # FSDP2 averages over ranks: the sum over ranks / all loss tokens
        norm = clip_grad_norm(model.parameters(), 1e9)
        gathered = [None] * world
        dist.all_gather_object(gathered, float(summed.detach()))
        losses.append(sum(gathered))
        if step == 0:
            first_norm = float(full(norm))
            first_grads = {n: full(p.grad).tolist() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    params = {n: full(p.detach()).tolist() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norm": first_norm, "grads": first_grads, "params": params}


for case in cases:
    case_config = validate_config(yaml.safe_load(Path(case["config"]).read_text()))
    for degree in degrees:
        record = trained(case_config, case["routing"], degree)
        if rank == 0:
            (out / case["name"]).mkdir(exist_ok=True)
            (out / case["name"] / f"ep{degree}.json").write_text(json.dumps(record))
        dist.barrier()
dist.destroy_process_group()

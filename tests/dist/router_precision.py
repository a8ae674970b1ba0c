"""Run under torchrun (2 gloo ranks) by tests/test_model_objectives.py: a tiny DeepSeek-V3 (model.config from argv[1],
random init), sharded as training shards it under bf16 mixed precision (train/model.py parallelize with the GPU's
policy, here on the CPU), takes one forward and backward. Rank 0 writes argv[2] (JSON): the dtype the router's
and an attention projection's weights had in forward, and the largest difference between the router's logits
there and the same logits from its float32 master weight gathered whole (transformers' own routing)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from wattgate.config import model_config
from wattgate.train.model import build_meta_model, layer_container, parallelize
from wattgate.train.weights import materialize

model_cfg = model_config({"config": json.loads(sys.argv[1])})
dist.init_process_group("gloo")
rank = dist.get_rank()
model = build_meta_model(model_cfg, "eager")
layer = layer_container(model)[-1]  # past first_k_dense_replace: a routed layer
seen: dict = {}


def record(name):
    def hook(module, args, output=None):
        seen[name] = {"dtype": str(module.weight.dtype).removeprefix("torch.")}
        if output is not None:  # the router: its input and logits, for the float32 reference below
            seen["router_io"] = (args[0].detach(), output[0].detach() if isinstance(output, tuple) else output)

    return hook


layer.mlp.gate.register_forward_hook(record("router"))
layer.self_attn.o_proj.register_forward_pre_hook(record("o_proj"))
parallelize(model, init_device_mesh("cpu", (dist.get_world_size(),)), True, True, False)
materialize(model, torch.device("cpu"), model_cfg, 0)
ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(rank))
model(input_ids=ids, labels=ids).loss.backward()
master = layer.mlp.gate.weight.full_tensor()  # the float32 master, gathered whole
hidden, logits = seen.pop("router_io")
reference = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), master.float())
seen["master_dtype"] = str(master.dtype).removeprefix("torch.")
seen["logits_max_difference"] = (logits.reshape(reference.shape).float() - reference).abs().max().item()
if rank == 0:
    Path(sys.argv[2]).write_text(json.dumps(seen))
dist.destroy_process_group()

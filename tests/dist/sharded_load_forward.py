"""Run under torchrun by tests/test_weights.py: load a model the way the train stage does, run a
forward pass on a few tokens, and (rank 0) compare the logits with a plain from_pretrained."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import init_device_mesh

from wattgate.config import run_config, validate_config
from wattgate.train.distributed import setup_rank
from wattgate.train.model import load_sharded_model

config = validate_config(yaml.safe_load(Path(sys.argv[1]).read_text()))
out = Path(sys.argv[2])
train = run_config(config).train
rank, world, device = setup_rank(60, out)
model, _ = load_sharded_model(config["model"], train, init_device_mesh("cpu", (world,)), device)
vocab = model.config.vocab_size
ids = (torch.arange(24) * 7 % vocab)[None]
with torch.no_grad():
    sharded = model(input_ids=ids, use_cache=False).logits
if rank == 0:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(config["model"]["path"], local_files_only=True,
                                                 dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        reference = plain(input_ids=ids, use_cache=False).logits
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({"max_abs_delta": (sharded - reference).abs().max().item(),
                                                "world": world}))
dist.barrier()
dist.destroy_process_group()

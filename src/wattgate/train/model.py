"""Build the model (local folder or config) and shard it with FSDP2 per decoder layer and at the root."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from wattgate.errors import InputError


def build_model(model_cfg: dict, attn_implementation: str, seed: int):
    """A causal LM from `model.path` (pretrained weights) or `model.config` (random init, seeded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_cfg.get("path"):
        path = Path(model_cfg["path"])
        if not (path / "config.json").exists():
            raise InputError(f"{path}: no config.json; model.path must be a local model folder")
        return AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation
        )
    cfg = dict(model_cfg.get("config") or {})
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise InputError("model.config: needs model_type (e.g. qwen3)")
    config = AutoConfig.for_model(model_type, **cfg)
    config.use_cache = False
    torch.manual_seed(seed)  # the same initial weights on every rank and every run
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)


LAYER_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")


def layer_container(model) -> torch.nn.ModuleList:
    """The ModuleList of repeated decoder blocks (model.model.layers for Llama-family models)."""
    for path in LAYER_PATHS:
        module = model
        try:
            for part in path.split("."):
                module = getattr(module, part)
        except AttributeError:
            continue
        return module
    raise InputError(f"{type(model).__name__}: cannot find its decoder layers to shard")


def parallelize(model, mesh, on_cuda: bool, mixed_precision: bool, activation_checkpointing: bool):
    """fully_shard each decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = layer_container(model)
        for i, layer in enumerate(list(layers)):
            layers[i] = checkpoint_wrapper(layer)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if (on_cuda and mixed_precision) else None
    kwargs = {"mesh": mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in layer_container(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())

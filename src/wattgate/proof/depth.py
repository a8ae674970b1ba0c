"""Depth: the proof runs a reduced-depth proxy and scales each step's collectives by the real depth.

Sound when every decoder layer is the same unit (same parameters, shapes and dtypes, the same attention kind):
FSDP2 then issues the same collectives per layer (one all-gather forward, one in backward, one reduce-scatter)
and the root's own around them, so a step's count at depth L is count(d) + (L - d) x per layer. Not sound where
layers differ (mixed attention kinds, dense and sparse layers) or where a layer's collectives follow the data
(MoE all-to-alls whose split sizes come from the router): the check says so and the proof fails.
"""

from __future__ import annotations

import torch

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _layer_signature(layer) -> list[tuple]:
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters()]


def check_identical_layers(model_cfg: dict) -> dict:
    """{identical, layers, why}: whether the model's decoder layers are identical units (built on meta at its
    real depth, so nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    from wattgate.train.model import layer_container, model_hf_config

    config = model_hf_config(model_cfg)
    layers = int(config.num_hidden_layers)
    moe = [k for k in MOE_KEYS if (getattr(config, k, None) or 0) > 0]
    if moe:
        return {"identical": False, "layers": layers, "why": f"mixture of experts ({', '.join(moe)})"}
    kinds = set(getattr(config, "layer_types", None) or [])
    if len(kinds) > 1:
        return {"identical": False, "layers": layers, "why": f"layer types differ ({', '.join(sorted(kinds))})"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    units = list(layer_container(model))
    first = _layer_signature(units[0])
    for i, layer in enumerate(units[1:], 1):
        if type(layer) is not type(units[0]) or _layer_signature(layer) != first:
            return {"identical": False, "layers": layers, "why": f"layer {i} differs from layer 0"}
    return {"identical": True, "layers": layers, "why": f"{layers} identical {type(units[0]).__name__} layers"}


def scaled_count(count: int, per_layer: int | None, depth: dict, proxy_layers: int) -> int | None:
    """A step's collective count at the real depth from the proxy's (None without a per-layer figure)."""
    if per_layer is None:
        return count if depth.get("layers", 0) <= proxy_layers else None
    return count + (depth["layers"] - proxy_layers) * per_layer

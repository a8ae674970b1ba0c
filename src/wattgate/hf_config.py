"""A model's transformers config (model.path's config.json or model.config) and what transformers says of its
layers: which carry a recurrent state.

Below every stage: the pack stage asks it whether rows may hold several documents (pack.documents_per_row auto),
the gate and the trainer build from it. transformers is imported only when asked (its cache classes import torch).
"""

from __future__ import annotations

import os
from pathlib import Path

from wattgate.config import model_config
from wattgate.errors import InputError
from wattgate.records.run_config import ModelConfig


def model_hf_config(model_cfg: ModelConfig | dict):
    """The transformers config of `model.path` (config.json) or `model.config` (a dict), for training."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    try:  # huggingface_hub's config validation (a subclass of Exception only): layer_types vs num_hidden_layers
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # pragma: no cover - older huggingface_hub
        StrictDataclassError = ValueError  # noqa: N806
    model_cfg = model_config(model_cfg)
    if model_cfg.path:
        path = Path(model_cfg.path)
        if not (path / "config.json").exists():
            raise InputError(f"{path}: no config.json; model.path must be a local model folder")
        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError, StrictDataclassError) as exc:
            msg = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise InputError(f"{path}/config.json: not a usable transformers model config ({msg})") from None
    else:
        cfg = dict(model_cfg.config or {})
        model_type = cfg.pop("model_type", None)
        if not model_type:
            raise InputError("model.config: needs model_type (e.g. qwen3)")
        try:
            config = AutoConfig.for_model(model_type, **cfg)
        except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:
            msg = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise InputError(f"model.config: {msg}") from None
    config.use_cache = False  # a cache makes packed documents attend to each other (PITFALLS)
    return config


def recurrent_layers(hf_config) -> tuple[str, ...]:
    """'layer <i> (<type>)' of each decoder layer with a recurrent state (Mamba/SSM, a short convolution, linear
    attention), by transformers' own answer: the cache layer it gives that layer keeps a linear-attention state.
    Such a state runs on from one packed document into the next (gate/isolation_check.py)."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    types = list(getattr(hf_config, "layer_types", None) or [])
    return tuple(
        f"layer {i} ({types[i] if i < len(types) else type(layer).__name__})"
        for i, layer in enumerate(DynamicCache(config=hf_config).layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    )


def context_refusal(hf_config, context: int) -> str | None:
    """Why parallel.context `context` cannot run this model (None: it can): a recurrent state runs through a
    row's tokens in order, so it cannot be split across the ranks that share the row."""
    if context <= 1:
        return None
    layers = recurrent_layers(hf_config)
    if not layers:
        return None
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"parallel.context: {context} cannot split a row across ranks for a model with recurrent-state layers "
        f"({shown}): their state runs through the row in order; give 1"
    )

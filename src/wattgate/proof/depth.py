"""Depth: the proof runs a reduced-depth proxy and scales each step's collectives by whole periods of the layers.

FSDP2 shards every decoder layer as its own unit: a layer adds its own collectives (one all-gather forward, one
in backward, one reduce-scatter) to the root's, and which ones follows from its parameters (names, shapes,
dtypes). The real-depth model is built on meta (nothing allocated) and each layer described by its class, its
parameters and the config's per-layer entries (`layer_types` sliding/full, ...). After a head of h layers that do
not repeat (DeepSeek-V3's dense first layers; h = 0 for most models) the layers repeat with a period p (1 when
they are identical units; Gemma 2 alternates, p = 2; Gemma 3 is 5 sliding + 1 full, p = 6; p = L when nothing
repeats): the pattern with the fewest layers h + p. With L = h + k p + r layers the proxy is the head, one period
and the remainder (d = h + p + r layers: the pattern's first r layers end the real model too), rank 0 also runs
d + p, and a step's count at depth L is count(d) + (k - 1) x (count(d + p) - count(d)). A model at most one
period deeper than the proxy runs at its own depth. A Mixture-of-Experts layer is one unit like any other: which
experts its tokens reach moves no collective once every unit reduce-scatters all its parameters (train/moe.py),
which the proof checks on a skewed routing (proof/experts.py).

The proxy is built from model.path's own config cut to d layers, and reads that folder's tensors for the layers
it holds; the folder is checked whole against the real-depth model (train/weights.py `checkpoint_sources`).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from wattgate.config import model_config
from wattgate.records.gate import Depth
from wattgate.records.run_config import ModelConfig
from wattgate.train.moe import moe_reason

NOT_PER_LAYER = re.compile(r"token_ids?$|^architectures$")  # lists that may have L entries by chance


@functools.lru_cache(maxsize=2)
def _meta_model(key: str):
    from transformers import AutoModelForCausalLM

    from wattgate.train.model import model_hf_config

    config = model_hf_config(json.loads(key)["model"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]  # as train/model.py names it (refusals quote it)
    return model


def meta_model(model_cfg: ModelConfig | dict):
    """The real-depth model on the meta device (no memory), built once per model config in this process: the
    gate's weights check and the proof's layer pattern read the same one. Read it, never change it."""
    model_cfg = model_config(model_cfg)
    key: dict[str, object] = {"model": model_cfg.to_json()}
    if model_cfg.path:  # a folder whose config.json was rewritten is another model
        try:
            key["config.json"] = (Path(model_cfg.path) / "config.json").read_text()
        except (OSError, UnicodeDecodeError):
            pass  # model_hf_config names the problem
    return _meta_model(json.dumps(key, sort_keys=True, default=str))


def model_label(model_cfg: ModelConfig | dict, config) -> str:
    """How a refusal names the model: its folder or model.config, with the transformers model type."""
    where = model_config(model_cfg).path or "model.config"
    return f"{where} ({config.model_type})"


def per_layer_keys(config) -> list[str]:
    """The config's per-layer entries: its lists with one entry per decoder layer (`layer_types`, ...)."""
    layers = int(config.num_hidden_layers)
    return sorted(
        k
        for k, v in config.to_dict().items()
        if isinstance(v, (list, tuple)) and len(v) == layers and not NOT_PER_LAYER.search(k)
    )


def truncate_layers(config, depth: int) -> None:
    """`config` at `depth` decoder layers, its per-layer entries cut to match (the proxy's own pattern)."""
    keys = per_layer_keys(config)
    config.num_hidden_layers = depth
    for k in keys:
        setattr(config, k, list(getattr(config, k))[:depth])


def _layer_signature(layer, entries: tuple) -> tuple:
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
    return (type(layer).__name__, params, entries)


def pattern_of(signatures: list) -> tuple[int, int]:
    """(h, p): the fewest layers h + p (then the smaller head) with every layer i >= h equal to layer
    h + (i - h) mod p."""
    n = len(signatures)
    for size in range(1, n + 1):
        for h in range(size):
            p = size - h
            if all(signatures[i] == signatures[h + (i - h) % p] for i in range(h, n)):
                return h, p
    return 0, n


def layer_pattern(model_cfg: ModelConfig | dict) -> Depth:
    """gate.json `collectives.depth`: {layers, period, pattern (one period's layer kinds), identical (period 1),
    moe (why, or null), model, why, recurrent (layers with a recurrent state; left out when none), params (its
    parameters counted)}, from the real-depth model on meta."""
    from wattgate.train.model import layer_container, param_census, recurrent_layers

    model = meta_model(model_cfg)
    config = model.config
    layers = int(config.num_hidden_layers)
    label = model_label(model_cfg, config)
    moe = moe_reason(config, model)
    keys = per_layer_keys(config)
    units = list(layer_container(model))
    sigs = [_layer_signature(u, tuple(str(getattr(config, k)[i]) for k in keys)) for i, u in enumerate(units)]
    head, period = pattern_of(sigs) if sigs else (0, 1)

    def kind(i: int) -> str:
        return "/".join([type(units[i]).__name__, *(str(getattr(config, k)[i]) for k in keys)])

    kinds = [kind(i) for i in range(head, head + period)]
    if head + period == layers and period > 1 or not layers:
        why = f"{layers} layers without a repeating pattern: the proof runs them all" if layers else "no decoder layers"
    elif period == 1:
        why = f"{layers - head} identical {kinds[0]} layers"
    else:
        why = f"{layers - head} layers repeating every {period} ({', '.join(kinds)})"
    if head and head + period < layers:
        why = f"{head} first layer(s) unlike the rest ({', '.join(kind(i) for i in range(head))}), then {why}"
    recurrent = recurrent_layers(config) or None
    return Depth(
        layers=layers,
        period=period,
        pattern=tuple(kinds),
        identical=period == 1 and head == 0,
        moe=moe,
        model=label,
        why=why,
        recurrent=recurrent,
        params=param_census(model),
        head=head,
    )


def proxy_depths(depth: Depth) -> tuple[int, int | None]:
    """(layers every rank's dry run builds, layers of rank 0's second run or None): one period plus the
    remainder, and one period more; a model no deeper than that runs at its own depth, unscaled."""
    layers, period, head = depth.layers, depth.period, depth.head
    proxy = head + period + (layers - head) % period
    if layers <= proxy + period:
        return layers, None
    return proxy, proxy + period


def scaled_count(count: int, per_period: int | None, depth: Depth, proxy_layers: int) -> int | None:
    """A step's collective count at the real depth from the proxy's (None without a per-period figure)."""
    if per_period is None:
        return count if depth.layers <= proxy_layers else None
    return count + (depth.layers - proxy_layers) // depth.period * per_period

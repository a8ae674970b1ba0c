"""Build the model on the meta device and shard it with FSDP2 per decoder layer and at the root.

No rank ever materializes the whole model: the module tree is built on the meta device
(no memory), fully_shard turns every parameter into a DTensor sharded on dim 0, and only
then does train/weights.py allocate and fill each rank's local shard.
"""

from __future__ import annotations

from typing import Any

import torch

from wattgate.errors import InputError
from wattgate.hf_config import model_hf_config
from wattgate.hf_config import recurrent_layers as recurrent_layers  # the proof's depth record asks it here
from wattgate.records.gate import ParamCensus
from wattgate.records.run_config import ModelConfig, TrainConfig
from wattgate.train.checkpoint_layout import float32_kept, keep_conversion_mapping
from wattgate.train.packed_masks import install_packed_masks


def causal_lm_class(config):
    """The transformers class AutoModelForCausalLM builds for `config` (without building it)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise InputError(
            f"model: {type(config).__name__} ({config.model_type}) has no causal-LM class in transformers; "
            "wattgate trains decoder language models"
        ) from None


def build_meta_model(model_cfg: ModelConfig | dict, attn_implementation: str):
    """The model's module tree on the meta device (no parameter memory), in fp32 master dtype."""
    return meta_model_of(model_hf_config(model_cfg), attn_implementation)


def meta_model_of(config, attn_implementation: str):
    """build_meta_model from a transformers config (the proof's, cut to fewer layers, comes this way)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=attn_implementation
            )
    except (ValueError, AssertionError) as exc:  # an attention kernel the model does not run, a pad id past vocab
        msg = " ".join(str(exc).split())[:300]
        kind = config.model_type
        raise InputError(f"model: transformers cannot build {kind} with {attn_implementation} ({msg})") from None
    # FSDP2 renames the class (FSDPQwen3ForCausalLM); the export names the real one, the load maps by it
    model.config.architectures = [type(model).__name__]
    keep_conversion_mapping(model)
    install_packed_masks(model)  # a decoder whose masks ignore position_ids (GPT-OSS) gets them from here
    return model


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


def param_census(model) -> ParamCensus:
    """`model`'s parameters counted (on the meta device: no memory): in all, in its largest decoder layer, outside
    its layers, and their distinct shapes."""
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layer_container(model)]
    total = sum(p.numel() for p in model.parameters())  # a tied parameter once
    return ParamCensus(
        total=total,
        largest_layer=max(per_layer, default=0),
        root=total - sum(per_layer),
        shapes=tuple(sorted({tuple(p.shape) for p in model.parameters()})),
    )


def apply_activation_checkpointing(model) -> None:
    """Wrap each decoder layer so backward recomputes it (the wrapper keeps parameter names)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = layer_container(model)
    for i, layer in enumerate(list(layers)):
        layers[i] = checkpoint_wrapper(layer)


def compile_layers(model) -> None:
    """torch.compile each decoder layer in place, as torchtitan does: one small graph reused by every
    layer, and Module.compile keeps the parameter names (torch.compile(module) would prefix _orig_mod.)."""
    for layer in layer_container(model):
        layer.compile()


def float32_modules(model) -> list[torch.nn.Module]:
    """The modules whose own parameters transformers holds in float32 in a bf16 model (`_keep_in_fp32_modules_strict`:
    DeepSeek-V3's and GLM-4.5's routers)."""
    kept = float32_kept(model, torch.bfloat16)
    modules = []
    for name, module in model.named_modules():
        own = [f"{name}.{n}" if name else n for n, _ in module.named_parameters(recurse=False)]
        if own and all(kept(n) for n in own):
            modules.append(module)
    return modules


def parallelize(
    model, mesh, on_cuda: bool, mixed_precision: bool, activation_checkpointing: bool, compile: bool = False
):
    """fully_shard each decoder layer, then the root (embeddings, final norm, head); on a Mixture-of-Experts model
    every unit then reduce-scatters all its parameters, zeros for one no token reached (train/moe.py).

    Under bf16 mixed precision, a module transformers keeps in float32 (a DeepSeek-V3 router) is a unit of its own
    that all-gathers in float32, so its forward is the model's own: a bf16 router weight would route tokens
    differently from the model the user fine-tunes.

    The chunked loss (train/loss.py) runs as a forward method of the root, so the head weight is
    gathered with the root's parameters.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mixed = on_cuda and mixed_precision
    float32_units = float32_modules(model) if mixed else []  # found before wrappers rename the layers
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        compile_layers(model)
    from wattgate.train.mesh import CONTEXT_DIM, EXPERT_DIM, dense_mesh

    if CONTEXT_DIM in (mesh.mesh_dim_names or ()):  # parallel.context > 1: attention across the context group
        use_context_parallel_attention(model, mesh.size(mesh.mesh_dim_names.index(CONTEXT_DIM)))
    kwargs: dict[str, Any] = {"mesh": dense_mesh(mesh)}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if EXPERT_DIM in (mesh.mesh_dim_names or ()):  # parallel.expert > 1: experts sharded over their own groups
        from wattgate.train.expert_parallel import parallelize_experts

        parallelize_experts(model, mesh, kwargs.get("mp_policy", MixedPrecisionPolicy()))
    for module in float32_units:
        fully_shard(module, mesh=kwargs["mesh"], mp_policy=MixedPrecisionPolicy(torch.float32, torch.float32))
    for layer in layer_container(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # Mixture-of-Experts: every unit reduce-scatters all its parameters whatever the router sent where (train/moe.py)
    from wattgate.train.moe import reduce_every_parameter

    reduce_every_parameter(model)
    return model


def use_context_parallel_attention(model, context: int) -> None:
    """Switch `model` to the context-parallel attention (train/context_parallel.py), whatever train.attn_implementation
    asked: the rows' keys and values are gathered over the context group there. A model whose layers carry a recurrent
    state is refused in one line (hf_config.context_refusal)."""
    from wattgate.hf_config import context_refusal
    from wattgate.train.context_parallel import use_context_attention

    line = context_refusal(model.config, context)
    if line:
        raise InputError(line)
    use_context_attention(model)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over `parameters`; when their gradients are DTensors on more than one mesh (the
    experts' and the others' under EP, which torch cannot stack together), each mesh's norm is reduced on its own
    mesh first and the total is their 2-norm, the same number."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    meshes = {id(g.device_mesh): g.device_mesh for g in grads if isinstance(g, DTensor)}
    if len(meshes) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    parts = []
    for key in meshes:
        norm = torch.nn.utils.get_total_norm([g for g in grads if isinstance(g, DTensor) and id(g.device_mesh) == key])
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:
        parts.append(torch.nn.utils.get_total_norm(plain))
    total = torch.linalg.vector_norm(torch.stack(parts))
    for key in meshes:  # scaled mesh by mesh: torch's foreach scaling cannot mix meshes either
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in params if isinstance(p.grad, DTensor) and id(p.grad.device_mesh) == key], max_norm, total
        )
    plain_params = [p for p in params if not isinstance(p.grad, DTensor)]
    if plain_params:
        torch.nn.utils.clip_grads_with_norm_(plain_params, max_norm, total)
    return total


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def bf16_mixed_precision(train: TrainConfig) -> bool:
    """train.mixed_precision bf16: bf16 compute over fp32 master weights, where the model runs on GPUs."""
    return train.mixed_precision == "bf16"


def load_sharded_model(
    model_cfg: ModelConfig | dict, train: TrainConfig, mesh, device: torch.device, fill: bool = True
):
    """Meta build -> fully_shard -> local shards on `device` -> filled; returns (model, where values came from).

    `train` gives the attention kernel, mixed precision, activation checkpointing, compile and the init seed.
    fill=False when a checkpoint will overwrite every parameter (resume).
    """
    from wattgate.train.attention import resolve_attn_implementation
    from wattgate.train.weights import materialize

    on_cuda = device.type == "cuda"
    model_class = causal_lm_class(model_hf_config(model_cfg))
    mixed = bf16_mixed_precision(train)
    attn = resolve_attn_implementation(train.attn_implementation, device.type, on_cuda and mixed, model_class)
    model = build_meta_model(model_cfg, attn)
    parallelize(model, mesh, on_cuda, mixed, train.activation_checkpointing, train.compile)
    source = materialize(model, device, model_cfg, train.seed, fill=fill)
    return model, source


def build_unsharded_model(model_cfg: ModelConfig | dict, attn_implementation: str, seed: int, device: str = "cpu"):
    """The whole model in one process, with the same weights the sharded loader gives every rank.

    For references and baselines (tests, benches) only: it holds the whole model in fp32.
    """
    from wattgate.train.weights import materialize

    model = build_meta_model(model_cfg, attn_implementation)
    materialize(model, torch.device(device), model_cfg, seed)
    return model

"""Peak memory per GPU of an FSDP2 (ZeRO-3) full fine-tune, and checkpoint size, from a model config.

The estimate is a sum of named terms (printed in gate.md) so an operator can
see which one does not fit. Byte counts per parameter follow FSDP2 with a bf16
MixedPrecisionPolicy: sharded parameters, gradients and AdamW moments stay in
fp32 (4 + 4 + 8 bytes, divided by the world size); each layer is all-gathered
in bf16 for compute, the current and the prefetched one at a time, and its
gradient is reduce-scattered in fp32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from wattgate.errors import InputError

GIB = 1 << 30

# Usable device memory (GiB) of known accelerators; cluster.gpu_mem_gib overrides.
GPU_MEMORY_GIB = {
    "A100-40GB": 40,
    "A100-80GB": 80,
    "A100": 80,
    "H100": 80,
    "H200": 141,
    "B200": 180,
    "B300": 288,
}

# What no formula below covers: on a GPU the CUDA context, NCCL buffers and
# allocator slack; on a CPU rank the interpreter and torch (~0.75 GB measured).
RUNTIME_OVERHEAD_BYTES = {"gpu": 3 * GIB, "cpu": 3 * GIB // 4}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a dense or MoE decoder, enough to count parameters and activations."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    num_experts: int = 0
    expert_intermediate_size: int = 0

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str) -> "ModelSpec":
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                expert_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{source}: model config lacks a decoder shape ({exc}); cannot estimate memory") from None

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 2 * self.head_dim
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.expert_intermediate_size + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size  # SwiGLU: gate, up, down
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.hidden_size

    def activation_elements_per_token_layer(self) -> int:
        """bf16 tensors autograd keeps per token in one decoder layer (flash/sdpa attention: no s^2 term).

        Norm inputs and outputs (4h), the layer input to each projection block
        (2h), q/k/v before and after norm+rope (2 x (q + 2kv)), attention output
        and o_proj input (2q), and in the MLP gate, up, act(gate), their product
        (4 x intermediate).
        """
        inter = self.expert_intermediate_size if self.num_experts else self.intermediate_size
        return 6 * self.hidden_size + 2 * (self.q_dim + 2 * self.kv_dim) + 2 * self.q_dim + 4 * inter


def load_model_spec(config: dict) -> ModelSpec:
    model = config["model"]
    if model.get("path"):
        path = Path(model["path"]) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: cannot read model config ({exc})") from None
        return ModelSpec.from_hf_config(cfg, str(path))
    if model.get("config"):
        return ModelSpec.from_hf_config(model["config"], "model.config")
    raise InputError("config: set model.path (a local model folder) or model.config (a transformers config)")


@dataclass(frozen=True)
class FitSettings:
    world_size: int
    tokens_per_micro_batch: int
    activation_checkpointing: bool
    mixed_precision: bool  # bf16 compute with fp32 master weights; False: fp32 throughout
    on_gpu: bool = True


def estimate_memory(spec: ModelSpec, s: FitSettings) -> dict[str, int]:
    """Peak bytes per GPU, term by term."""
    compute = 2 if s.mixed_precision else 4
    per_layer_act = spec.activation_elements_per_token_layer() * compute
    tokens = s.tokens_per_micro_batch
    if s.activation_checkpointing:
        activations = tokens * spec.num_layers * spec.hidden_size * compute + tokens * per_layer_act
    else:
        activations = tokens * spec.num_layers * per_layer_act
    return {
        "sharded_params_fp32": spec.num_params * 4 // s.world_size,
        "sharded_grads_fp32": spec.num_params * 4 // s.world_size,
        "sharded_adam_state_fp32": spec.num_params * 8 // s.world_size,
        # two layers gathered (current + prefetched) and the root's embedding/head, in compute dtype
        "gathered_params": (2 * spec.layer_params + spec.embedding_params) * compute,
        "unsharded_grads_fp32": (spec.layer_params + spec.embedding_params) * 4,
        "activations": activations,
        # logits in compute dtype, their fp32 upcast for the loss, and its gradient
        "logits": tokens * spec.vocab_size * (compute + 8),
        "runtime_overhead": RUNTIME_OVERHEAD_BYTES["gpu" if s.on_gpu else "cpu"],
    }


def checkpoint_bytes(spec: ModelSpec) -> int:
    """One DCP checkpoint: fp32 parameters plus the two AdamW moments."""
    return spec.num_params * 12


def device_memory_bytes(config: dict) -> tuple[int, str]:
    """Memory one rank may use, and where that number came from."""
    cluster = config["cluster"]
    if cluster["gpu_mem_gib"]:
        return int(cluster["gpu_mem_gib"] * GIB), "cluster.gpu_mem_gib"
    model = cluster["gpu_model"]
    if model.lower() == "cpu":
        import os

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return host // cluster["gpus_per_node"], f"host memory / {cluster['gpus_per_node']} processes"
    key = next((k for k in GPU_MEMORY_GIB if k.lower() == model.lower()), None)
    if key is None:
        raise InputError(
            f"config: cluster.gpu_model '{model}' is not in the memory table ({', '.join(GPU_MEMORY_GIB)}); "
            "set cluster.gpu_mem_gib"
        )
    return GPU_MEMORY_GIB[key] * GIB, f"{key} table entry"

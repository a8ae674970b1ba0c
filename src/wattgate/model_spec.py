"""The model spec: a decoder's shapes from a transformers config (model.path's config.json or model.config),
its parameter count and dtype, and final/'s export dtype.

Below every stage: the gate sizes memory and checkpoints from it, train builds and exports the model it
describes, and the forecast counts its FLOPs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from wattgate.errors import InputError
from wattgate.records.gate import ParamCensus
from wattgate.records.run_config import RunConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
EXPORT_DTYPES = ("bfloat16", "float16", "float32")  # train.export_dtype's choices besides auto
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "double": "float64",
}
# transformers' dtype when a config names none
DEFAULT_CONFIG_DTYPE = "float32"


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a dense or MoE decoder, enough to count parameters and activations. The counts come from
    `census` (the model counted on the meta device) when it is set, else from the shape's formula."""

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
    experts_per_token: int = 0  # the router's top k
    dense_layers: int = 0  # an MoE model's layers with a dense MLP instead (Qwen3-MoE mlp_only_layers, sparse step)
    attention_bias: bool = False  # biases on q, k, v and o (GPT-OSS)
    census: ParamCensus | None = None  # the real model counted (with_census); not part of the shape

    def shape(self) -> dict:
        """The config's shape (the throughput ledger's key for runs of one model), without the census."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "census"}

    def with_census(self, census: ParamCensus | None) -> ModelSpec:
        return replace(self, census=census)

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str) -> ModelSpec:
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
                num_experts=_num_experts(cfg),
                expert_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
                experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
                dense_layers=_dense_layers(cfg),
                attention_bias=bool(cfg.get("attention_bias", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{source}: model config lacks a decoder shape ({exc}); cannot estimate memory") from None

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _attention_params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 2 * self.head_dim
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim + h
        return attn + 2 * h  # and the two norms

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters (the largest one's, counted); for an MoE model every expert of it (FSDP2
        gathers them all), and the router."""
        if self.census is not None:
            return self.census.largest_layer
        h = self.hidden_size
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.expert_intermediate_size + h * self.num_experts
            if self.attention_bias:  # GPT-OSS: its experts and router have biases too
                mlp += self.num_experts * (2 * self.expert_intermediate_size + h) + self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size  # SwiGLU: gate, up, down
        return self._attention_params() + mlp

    @property
    def expert_params(self) -> int:
        """One MoE layer's routed experts: its 3-D weights [num_experts, ...], what parallel.expert splits between
        ranks (0 for a dense model). Summed over the distinct shapes (the counted ones when `census` is set): a
        layout with two expert weights of one shape, or the experts' biases, is counted short, which only leaves
        more of the layer counted as gathered in full."""
        if not self.num_experts:
            return 0
        shapes = self.weight_shapes().values()
        return sum(math.prod(s) for s in shapes if len(s) == 3 and s[0] == self.num_experts)

    @property
    def dense_layer_params(self) -> int:
        """A layer of an MoE model that has a dense MLP (intermediate_size) instead of experts."""
        return self._attention_params() + 3 * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        """The root unit's: embeddings and head (counted: and whatever else is outside the decoder layers)."""
        if self.census is not None:
            return self.census.root
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def num_params(self) -> int:
        if self.census is not None:
            return self.census.total
        layers = (self.num_layers - self.dense_layers) * self.layer_params + self.dense_layers * self.dense_layer_params
        return layers + self.embedding_params + self.hidden_size

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The distinct weight shapes as transformers 5 stores them; FSDP2 shards dim 0.

        MoE experts are one 3-D parameter per projection (Qwen3-MoE, Mixtral), so
        they, not a single expert's matrix, are the candidates for the largest one.
        Counted: every distinct shape the model holds.
        """
        if self.census is not None:
            return {"x".join(map(str, shape)): shape for shape in self.census.shapes}
        h, inter = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens": (self.vocab_size, h),
            "q_proj": (self.q_dim, h),
            "k_proj": (self.kv_dim, h),
            "o_proj": (h, self.q_dim),
        }
        if not self.tied_embeddings:
            shapes["lm_head"] = (self.vocab_size, h)
        if self.num_experts:
            e, ei = self.num_experts, self.expert_intermediate_size
            shapes.update({"experts.gate_up_proj": (e, 2 * ei, h), "experts.down_proj": (e, h, ei)})
        else:
            shapes.update({"mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)})
        return shapes

    def activation_elements_per_token_layer(self) -> int:
        """bf16 tensors autograd keeps per token in one decoder layer (flash/sdpa attention: no s^2 term).

        Norm inputs and outputs (4h), the layer input to each projection block
        (2h), q/k/v before and after norm+rope (2 x (q + 2kv)), attention output
        and o_proj input (2q), and in the MLP gate, up, act(gate), their product
        (4 x intermediate).
        """
        attention = 6 * self.hidden_size + 2 * (self.q_dim + 2 * self.kv_dim) + 2 * self.q_dim
        if not self.num_experts:
            return attention + 4 * self.intermediate_size
        # MoE: each token through its top k experts (grouped_mm keeps the gathered input, gate-up, gate, product and
        # the down projection and weighted output per token and expert) and the router's logits
        k = max(1, self.experts_per_token)
        return attention + k * (4 * self.expert_intermediate_size + 3 * self.hidden_size) + self.num_experts


def _num_experts(cfg: dict) -> int:
    """Routed experts per MoE layer, under each family's key (Qwen, Mixtral/GPT-OSS, DeepSeek/GLM)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def _dense_layers(cfg: dict) -> int:
    """An MoE config's layers whose MLP is dense (Qwen3-MoE / Qwen2-MoE: mlp_only_layers, decoder_sparse_step;
    DeepSeek / GLM: the first first_k_dense_replace)."""
    if not _num_experts(cfg):
        return 0
    layers = int(cfg["num_hidden_layers"])
    only = {int(i) for i in (cfg.get("mlp_only_layers") or [])}
    step = int(cfg.get("decoder_sparse_step") or 1)
    first = int(cfg.get("first_k_dense_replace") or 0)
    return sum(1 for i in range(layers) if i in only or (i + 1) % step != 0 or i < first)


def largest_param(spec: ModelSpec) -> tuple[str, tuple[int, ...]]:
    """Name and shape of the parameter with the most elements (embedding or head, or an MLP matrix)."""
    return max(spec.weight_shapes().items(), key=lambda kv: math.prod(kv[1]))


def local_rows(shape: tuple[int, ...], world_size: int) -> int:
    """Rows of dim 0 the fullest rank holds (FSDP2 pads dim 0 up to a multiple of the world size)."""
    return -(-shape[0] // world_size)


def largest_local_slice(spec: ModelSpec, world_size: int) -> tuple[str, int]:
    """The parameter of which one rank holds the most elements, and that many elements."""
    name, shape = max(spec.weight_shapes().items(), key=lambda kv: local_rows(kv[1], world_size) * math.prod(kv[1][1:]))
    return name, local_rows(shape, world_size) * math.prod(shape[1:])


def read_model_folder_config(model_path: str | Path) -> tuple[dict, Path]:
    """model.path/config.json as a dict, and its path."""
    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise InputError(
            f"{path}: cannot read model config ({exc.strerror}); model.path must be a local model folder"
        ) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: invalid JSON in model config ({exc.msg})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object")
    return cfg, path


def load_model_spec(config: RunConfig) -> ModelSpec:
    model = config.model
    if model.path:
        cfg, path = read_model_folder_config(model.path)
        return expert_checked(ModelSpec.from_hf_config(cfg, str(path)), config.parallel.expert, str(path))
    if model.config:
        spec = ModelSpec.from_hf_config(model.config, "model.config")
        return expert_checked(spec, config.parallel.expert, f"model.config ({model.config.get('model_type')})")
    raise InputError("config: set model.path (a local model folder) or model.config (a transformers config)")


def expert_checked(spec: ModelSpec, expert: int, model: str) -> ModelSpec:
    """`spec`, once parallel.expert is known to fit it: 1, or on a Mixture-of-Experts model a divisor of its
    experts (each rank of an expert group holds the same number of them)."""
    if expert > 1 and spec.num_experts == 0:
        raise InputError(f"parallel.expert: {expert} needs a Mixture-of-Experts model; {model} is dense (give 1)")
    if expert > 1 and spec.num_experts % expert:
        raise InputError(f"parallel.expert: {expert} does not divide the {spec.num_experts} experts of {model}")
    return spec


def config_dtype_name(cfg: dict, source: str) -> str | None:
    """The dtype a transformers config names ('dtype' in transformers 5, 'torch_dtype' before), or None."""
    value = cfg.get("dtype") if cfg.get("dtype") is not None else cfg.get("torch_dtype")
    if value is None or value == "auto":
        return None
    if not isinstance(value, str):
        raise InputError(f"{source}: dtype/torch_dtype must be a string like 'bfloat16', got {value!r}")
    name = value.removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise InputError(f"{source}: unknown dtype '{value}' (known: {', '.join(DTYPE_BYTES)})")
    return name


def export_dtype_name(config: RunConfig) -> str:
    """dtype of final/: train.export_dtype, or for auto the input checkpoint's, else model.config's, else bfloat16."""
    chosen = config.train.export_dtype
    if chosen != "auto":
        return chosen
    model = config.model
    candidates = []
    if model.path:
        cfg, path = read_model_folder_config(model.path)
        candidates.append((cfg, str(path)))
    candidates.append((model.config or {}, "model.config"))
    for cfg, source in candidates:
        name = config_dtype_name(cfg, source)
        if name is None:
            continue
        if name not in EXPORT_DTYPES:
            raise InputError(
                f"{source}: dtype {name} is not an export dtype ({', '.join(EXPORT_DTYPES)}); set train.export_dtype"
            )
        return name
    return "bfloat16"

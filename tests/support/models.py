"""Model configs the tests share: tiny Qwen3s that train on CPU in seconds, Qwen3-32B for estimates, and tiny
Mixture-of-Experts folders (Qwen3-MoE, Mixtral, GPT-OSS) with the helpers that compare an export with its input."""

from support.architectures import MOE, SMALL_VOCAB_IDS, TINY_SHAPE

# the train tests' tiny Qwen3 (also the attention and loss tests'): 2 layers, a 96-token vocabulary
TINY = dict(model_type="qwen3", vocab_size=96, **TINY_SHAPE, max_position_embeddings=128)

# the weights tests' tiny Qwen3: TINY with 3 layers (an odd count, so the ranks' slices are uneven)
TINY_3_LAYERS = dict(TINY, num_hidden_layers=3)

# the gate tests' tiny Qwen3: room for the demo tokenizer's 600 ids
TINY_MODEL = dict(model_type="qwen3", vocab_size=600, **TINY_SHAPE)

QWEN3_32B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
}

# Qwen3-32B on 2 x 8 GPUs, as the memory estimate tests fit it
QWEN3_SETTINGS = dict(world_size=16, tokens_per_micro_batch=8192, activation_checkpointing=True, mixed_precision=True)


def save_hf_model(path, seed: int, dtype=None, shard: str | None = None, **overrides):
    """A transformers checkpoint of TINY_3_LAYERS (with `overrides`) in `path`, seeded; bf16 unless `dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_3_LAYERS, **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if dtype is None else dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(path), **kwargs)
    return path


# Mixture-of-Experts (issue 31, item 3): each tested architecture at 2 layers, 4 experts, top 2, saved in bf16 by
# transformers itself (Qwen3-MoE and Mixtral then hold one tensor per expert and projection on disk, GPT-OSS its
# 3-D stacks); initializer_range 0.2: decisive routing and logits large enough that another objective would show
MOE_BASE = dict(
    vocab_size=96,
    **TINY_SHAPE,
    max_position_embeddings=128,
    **SMALL_VOCAB_IDS,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
MOE_ARCHS = {model_type: adds for model_type, (adds, _, _) in MOE.items()}  # the matrix's (docs/architectures.md)


def moe_config(model_type: str, **overrides) -> dict:
    """model.config of the tiny `model_type` MoE (model_type included)."""
    return dict(MOE_BASE, model_type=model_type, **MOE_ARCHS[model_type], **overrides)


def save_moe_folder(path, model_type: str, seed: int = 0, **overrides):
    """A random-init folder of the tiny `model_type` MoE as transformers saves it (config.json, model.safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = moe_config(model_type, **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(path))
    return path


def folder_headers(folder) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a model folder's safetensors: name -> (shape, dtype code), from the headers."""
    from pathlib import Path

    from wattgate.train.safetensors_io import DTYPE_CODE, read_header

    return {
        name: (info.shape, DTYPE_CODE[info.dtype])
        for f in sorted(Path(folder).glob("*.safetensors"))
        for name, info in read_header(f).items()
    }


def save_header_only_folder(path, cfg: dict, dtype: str = "BF16"):
    """A model folder of `cfg` (config.json keys, model_type included) whose safetensors file has the full header
    (every tensor the model holds, by name, shape and dtype) and no data: the file is sparse, its size what the header
    describes, so a 65 GB model costs the header. Readers of headers (the gate) see the real model's layout."""
    import json
    import math
    import struct
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    item = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    start = 0
    for name, tensor in model.state_dict().items():  # tied weights appear once under their owner's name
        end = start + math.prod(tensor.shape) * item
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [start, end]}
        start = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + start)
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(path))
    return path

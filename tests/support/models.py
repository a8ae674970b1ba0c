"""Model configs the tests share: tiny Qwen3s that train on CPU in seconds, and Qwen3-32B for estimates."""

# the train tests' tiny Qwen3 (also the attention and loss tests'): 2 layers, a 96-token vocabulary
TINY = {
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
}

# the weights tests' tiny Qwen3: TINY with 3 layers (an odd count, so the ranks' slices are uneven)
TINY_3_LAYERS = dict(TINY, num_hidden_layers=3)

# the gate tests' tiny Qwen3: room for the demo tokenizer's 600 ids
TINY_MODEL = {
    "model_type": "qwen3",
    "vocab_size": 600,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}

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

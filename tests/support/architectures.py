"""The architectures wattgate is tested on: a tiny random-init transformers folder of each (bf16, MATRIX_LAYERS
layers), made in the test, and what each one's config adds to make its own behaviour show (a logit scale, a softcap,
sliding layers). docs/architectures.md is generated from this table (scripts/architectures_table.py)."""

from __future__ import annotations

# the shape every tiny decoder of the tests shares: 2 layers, hidden 32, 4 heads of 8 over 2 KV heads
TINY_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
# special token ids inside a small vocabulary (some configs' defaults, 32000 and up, are outside it)
SMALL_VOCAB_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# what every tiny model of the matrix shares: room for the test tokenizer's 600 ids, logits large enough
# (initializer_range 0.5) that a skipped logit scale or softcap moves the loss by tens of percent
TINY_DECODER = dict(vocab_size=600, **TINY_SHAPE, max_position_embeddings=256, **SMALL_VOCAB_IDS, initializer_range=0.5)

# model_type -> (what its config adds, what the test shows about it, a limit users meet (None: none known))
DENSE = {
    "llama": ({}, "the reference decoder", None),
    "mistral": ({}, "sliding-window attention off by default", None),
    "qwen2": ({}, "q/k/v biases", None),
    "qwen3": ({}, "q/k norms; the embedded default's model", None),
    "phi3": ({}, "fused qkv_proj and gate_up_proj tensors", None),
    "olmo2": ({}, "norms after attention and MLP", None),
    # attention_multiplier as the published Granite configs scale it (1 / head_dim; the default 1.0 saturates the
    # softmax of this tiny model's large weights, and its gradient then depends on the kernel's rounding)
    "granite": (
        {"logits_scaling": 8.0, "attention_multiplier": 0.125},
        "logits divided by logits_scaling, in the chunked loss too",
        None,
    ),
    "gemma2": (
        {"final_logit_softcapping": 2.0},
        "final logit softcapping in the chunked loss; buffers from the model's own init",
        "no sdpa in transformers: eager on CPU, flash_attention_2 on GPU (`auto` picks it)",
    ),
    "gemma3_text": (
        {"final_logit_softcapping": 2.0, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
        "sliding and full layers (the proof dry-runs one period of the pattern), softcapping",
        None,
    ),
}

# Mixture-of-Experts (tests/test_moe.py; 4 experts, top 2): model_type -> (what its config adds, what the test
# shows, a limit users meet). Gate with the proof on, 2-rank training, final/ in the input's layout, the validation
# loss of final/'s own forward, each on synthetic data; the skewed-routing negative controls on qwen3_moe
MOE = {
    "qwen3_moe": (
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        "experts stacked in memory from one tensor per expert on disk and exported back per expert; the proof on a "
        "routing where no token reaches any expert (tests/test_moe.py)",
        None,
    ),
    "mixtral": (
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        "as qwen3_moe, with `block_sparse_moe.experts.<e>.w1/w2/w3` renamed to the stacked experts and back "
        "(tests/test_moe.py)",
        None,
    ),
    "gpt_oss": (
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
        },
        "stacked experts with biases, attention sinks, sliding and full layers; packed documents kept apart "
        "(transformers 5.24 builds its masks without position_ids) (tests/test_moe.py)",
        "no sdpa in transformers: eager on CPU; on GPU transformers swaps flash_attention_2 for a hub kernel "
        "(kernels-community/vllm-flash-attn3), untested here",
    ),
}


# Mixture-of-Experts models the matrix alone covers (test_moe.py's deeper checks run on the three above)
MOE_MATRIX_ONLY = {
    "deepseek_v3": (
        {
            "num_key_value_heads": 4,  # multi-head latent attention: a key and value per head
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
        },
        "multi-head latent attention, a shared expert after a dense first layer; the router, which transformers "
        "keeps in float32 in a bf16 model, is exported in float32",
        None,
    ),
}


ARCHITECTURES = {**DENSE, **MOE, **MOE_MATRIX_ONLY}


# The matrix's depth: deeper than the collective proof's proxy for every family, so each one takes the proof's
# scaled path (proof/depth.py): two periods and a remainder layer for the period-2 families (Gemma 2 and 3, GPT-OSS:
# proxy 3 layers, rank 0's second run 5), a head and several periods for DeepSeek-V3 (1 dense layer, then MoE)
MATRIX_LAYERS = 7


def tiny_config(model_type: str, layers: int = MATRIX_LAYERS) -> dict:
    """model.config of the tiny `model_type` at `layers` layers (a `layer_types` pattern repeated to that depth)."""
    cfg = {**TINY_DECODER, "model_type": model_type, **ARCHITECTURES[model_type][0], "num_hidden_layers": layers}
    if "layer_types" in cfg:
        pattern = cfg["layer_types"]
        cfg["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return cfg


def save_tiny_model(path, model_type: str, seed: int = 0, layers: int = MATRIX_LAYERS):
    """A transformers folder of the tiny `model_type`, random init, saved in bf16 as transformers saves it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(model_type, layers)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(path))
    return path

"""The gate's fit check under expert parallelism (parallel.expert): the sharded state per rank is the same bytes,
a rank gathers only its own experts of an MoE layer, each MoE layer's token exchange is counted, and the fit
detail names the degree; parallel.expert 1 estimates exactly as before."""

from __future__ import annotations

import pytest

from wattgate.config import run_config
from wattgate.gate import memory as M
from wattgate.gate.fit_checks import check_fit
from wattgate.gate.run import config_fit_estimate, counted_spec
from wattgate.model_spec import ModelSpec

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8,
)  # fmt: skip
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
    n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_experts_per_tok=8, n_group=8, topk_group=4,
)  # fmt: skip
TOKENS = 8192  # micro-batch 2 x seq_len 4096
SHARDED = ("sharded_params_fp32", "sharded_grads_fp32", "sharded_adam_state_fp32")


def config_at(model: dict, expert: int, gpu_mem_gib: float = 80):
    return run_config(
        {
            "model": {"config": model},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_model": "H100", "gpu_mem_gib": gpu_mem_gib},
            "parallel": {"expert": expert},
            "train": {"micro_batch_size": 2, "seq_len": 4096, "activation_checkpointing": True},
        }
    )


@pytest.mark.parametrize("model", [QWEN3_30B_A3B, DEEPSEEK_V3], ids=["Qwen3-30B-A3B", "DeepSeek-V3"])
def test_the_expert_weights_counted_are_one_moe_layers_experts_modules(model):
    """What EP splits is what transformers' experts modules hold (the router and shared experts stay whole)."""
    from wattgate.proof.depth import meta_model
    from wattgate.train.model import layer_container
    from wattgate.train.moe import experts_modules

    config = config_at(model, 8)
    spec = counted_spec(config, None)
    layer = layer_container(meta_model(config.model))[-1]
    assert spec.expert_params == sum(p.numel() for _, m in experts_modules(layer) for p in m.parameters())
    assert spec.expert_params == spec.num_experts * 3 * spec.hidden_size * spec.expert_intermediate_size
    assert spec.with_census(None).expert_params == spec.expert_params  # the formula's spec agrees


@pytest.mark.parametrize("model", [QWEN3_30B_A3B, DEEPSEEK_V3], ids=["Qwen3-30B-A3B", "DeepSeek-V3"])
def test_ep_8_gathers_an_eighth_of_the_experts_and_holds_the_same_sharded_state(model):
    spec = counted_spec(config_at(model, 8), None)
    settings = dict(world_size=16, tokens_per_micro_batch=TOKENS, activation_checkpointing=True, mixed_precision=True)
    one = M.estimate_phases(spec, M.FitSettings(**settings, nodes=2))
    ep8 = M.estimate_phases(spec, M.FitSettings(**settings, nodes=2, expert=8))
    not_gathered = spec.expert_params * 7 // 8  # the other 7 ranks' experts of the largest MoE layer
    steady1, steady8 = one["steady"], ep8["steady"]
    # E-th of the experts over 16 / E ranks: the same bytes per rank as every expert over 16
    assert [steady8[k] for k in SHARDED] == [steady1[k] for k in SHARDED]
    assert steady1["gathered_params"] - steady8["gathered_params"] == 2 * not_gathered * 2  # two layers, bf16
    assert steady1["unsharded_grads_fp32"] - steady8["unsharded_grads_fp32"] == not_gathered * 4
    exchange = 2 * TOKENS * spec.experts_per_token * spec.hidden_size * 2  # sent and received rows, bf16
    assert "expert_all_to_all" not in steady1 and steady8["expert_all_to_all"] == exchange
    assert sum(steady1.values()) - sum(steady8.values()) == not_gathered * 8 - exchange
    assert {k: v for k, v in steady8.items() if k != "expert_all_to_all"}.keys() == steady1.keys()
    assert (ep8["load"], ep8["export"], ep8["host_per_node"]) == (one["load"], one["export"], one["host_per_node"])


def test_a_moe_run_that_does_not_fit_at_ep_1_fits_at_ep_8_and_the_detail_names_the_degree():
    """Qwen3-30B-A3B on 16 ranks of 48 GiB: the two gathered layers of 128 experts each do not fit; with 16 of them
    per rank they do."""
    fits = {}
    for expert in (1, 8):
        config = config_at(QWEN3_30B_A3B, expert, gpu_mem_gib=48)
        fit = config_fit_estimate(config, counted_spec(config, None))
        fits[expert] = check_fit(fit.phases, fit.budgets, config.gate.memory_headroom, fit.mesh)
    assert not fits[1].passed and fits[1].detail.startswith("steady: estimated peak 44.1 GiB per rank > 43.2 GiB")
    assert "parallel.expert" not in fits[1].detail
    assert fits[8].passed and "steady 40.7" in fits[8].detail
    assert fits[8].detail.endswith(
        "parallel.expert 8: a rank holds and gathers 16 of each MoE layer's 128 experts, sharded over 2 rank(s)"
    )


def test_parallel_expert_1_and_a_dense_model_estimate_as_without_the_key():
    spec = ModelSpec.from_hf_config(QWEN3_30B_A3B, "t")
    settings = dict(world_size=8, tokens_per_micro_batch=TOKENS, activation_checkpointing=False, mixed_precision=True)
    assert M.estimate_phases(spec, M.FitSettings(**settings, expert=1)) == M.estimate_phases(
        spec, M.FitSettings(**settings)
    )
    config = config_at(QWEN3_30B_A3B, 1)
    fit = config_fit_estimate(config, counted_spec(config, None))
    assert fit.mesh == "" and "parallel.expert" not in fit.notes["steady"]
    dense = ModelSpec.from_hf_config(dict(QWEN3_30B_A3B, num_experts=0), "t")
    assert dense.expert_params == 0

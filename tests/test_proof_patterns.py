"""The collective proof over layer-type patterns: layers that repeat with a period (Gemma 2 alternates sliding and
full attention, Gemma 3 is 5 sliding + 1 full), after a head of layers unlike the rest (DeepSeek-V3's dense first
layers), are dry-run as the head, one period and the remainder and scaled by whole periods; a Mixture-of-Experts
model is named by its config (its proof: tests/test_moe.py)."""

import numpy as np
import pytest

from wattgate.proof.depth import layer_pattern, proxy_depths
from wattgate.proof.dryrun import dry_run_rank
from wattgate.proof.prove import prove_collectives
from wattgate.train.rank_inputs import Paths

from conftest import CADENCE, TINY, make_run
from support.architectures import tiny_config

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3 = {  # a tiny Gemma 3 text model: 2 sliding layers then 1 full, repeating
    **TINY,
    "model_type": "gemma3_text",
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sliding_window": 8,
}
# DeepSeek-V3 in miniature: `first_k_dense_replace` dense layers, then Mixture-of-Experts layers
DEEPSEEK = {k: v for k, v in tiny_config("deepseek_v3").items() if k not in ("initializer_range",)}
QWEN3_MOE = {**TINY, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


def types(pattern: list[str], layers: int) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(layers)]


@pytest.mark.parametrize(
    "cfg,head,period,depths",
    [
        (TINY, 0, 1, (2, None)),  # two identical layers: their own depth, nothing to scale
        ({**TINY, "num_hidden_layers": 9}, 0, 1, (1, 2)),
        ({**GEMMA3, "num_hidden_layers": 2, "layer_types": [SLIDING, FULL]}, 0, 2, (2, None)),  # refused before
        ({**GEMMA3, "num_hidden_layers": 26, "layer_types": types([SLIDING] * 5 + [FULL], 26)}, 0, 6, (8, 14)),
        ({**GEMMA3, "num_hidden_layers": 24, "layer_types": types([SLIDING] * 5 + [FULL], 24)}, 0, 6, (6, 12)),
        ({**GEMMA3, "num_hidden_layers": 3, "layer_types": [FULL, SLIDING, SLIDING]}, 1, 1, (3, None)),
        ({**GEMMA3, "num_hidden_layers": 4, "layer_types": [FULL, SLIDING, FULL, FULL]}, 0, 3, (4, None)),
    ],
)
def test_the_layer_pattern_gives_one_period_plus_the_remainder(cfg, head, period, depths):
    depth = layer_pattern({"config": cfg})
    assert depth.period == period and depth.moe is None and depth.layers == cfg["num_hidden_layers"]
    assert len(depth.pattern) == period and proxy_depths(depth) == depths and depth.head == head


@pytest.mark.parametrize(
    "dense,layers,depths",
    [(1, 64, (2, 3)), (3, 64, (4, 5)), (1, 4, (2, 3)), (1, 3, (3, None)), (3, 5, (5, None)), (2, 9, (3, 4))],
)
def test_dense_first_layers_are_a_head_before_the_pattern(dense, layers, depths):
    """DeepSeek-V3 (3 dense layers, then 58 MoE layers) is a head and a period of 1, not 61 layers without a
    pattern: its proxy is the head and one layer, whatever the depth."""
    depth = layer_pattern({"config": {**DEEPSEEK, "num_hidden_layers": layers, "first_k_dense_replace": dense}})
    assert (depth.head, depth.period, depth.identical) == (dense, 1, False) and depth.moe
    assert proxy_depths(depth) == depths and f"{dense} first layer(s)" in depth.why


@pytest.mark.parametrize(
    "cfg",
    [
        {
            **TINY,
            "num_hidden_layers": 7,
            "layer_types": types([SLIDING, FULL], 7),
            "use_sliding_window": True,
            "sliding_window": 8,
        },
        {**GEMMA3, "num_hidden_layers": 10, "layer_types": types([SLIDING, SLIDING, FULL], 10)},
        {**DEEPSEEK, "num_hidden_layers": 7, "first_k_dense_replace": 2},
    ],
    ids=["qwen3-alternating-7", "gemma3-2+1-10", "deepseek-2-dense-then-5-moe"],
)
def test_collectives_scale_by_whole_periods_exactly_as_a_full_depth_dry_run_counts_them(tmp_path, cfg):
    """Every rank runs the head, one period and the remainder, rank 0 also one period more; each class's scaled
    count equals what rank 0 issues when it is dry-run at the real depth (7 = 3 x 2 + 1, 10 = 3 x 3 + 1,
    7 = 2 + 5 x 1)."""
    lengths = np.random.default_rng(5).integers(5, 60, 40).tolist()
    plan, config = make_run(tmp_path, lengths, gpus=2, validation_fraction=0.1, **CADENCE)
    config = config.replace(model=config.model.replace(config=cfg))
    report = prove_collectives(config, tmp_path / "pretokenized", plan).to_json()
    assert report["passed"], report["detail"]
    depth = report["depth"]
    head, period = depth["head"], depth["period"]
    proxy = head + period + (depth["layers"] - head) % period
    assert report["proxy_layers"] == proxy < depth["layers"] and (head, period) in ((0, 2), (0, 3), (2, 1))
    steps = [c["first_step"] - 1 for c in report["classes"]]
    full = dry_run_rank(config, Paths(tmp_path / "pretokenized", plan, tmp_path / "full"), 0, steps, 99)
    assert full.layers == depth["layers"]
    for c in report["classes"]:
        assert c["collectives_at_depth"] == len(full.steps[c["first_step"] - 1]) > c["collectives"], c


@pytest.mark.parametrize(
    "cfg,why",
    [
        (QWEN3_MOE, "num_experts 4"),
        ({**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, "num_experts 4"),
    ],
)
def test_mixture_of_experts_is_named_by_its_config(cfg, why):
    assert layer_pattern({"config": cfg}).moe == why

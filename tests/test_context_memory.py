"""The fit check under context parallelism (parallel.context C): per-token terms per context rank, the gathered
keys/values, the mask and sdpa's copy of it, and the smallest C a row that does not fit would fit at."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wattgate.config import run_config
from wattgate.gate import memory as M
from wattgate.gate.fit_checks import check_fit
from wattgate.gate.run import fit_settings
from wattgate.model_spec import ModelSpec

from support.models import QWEN3_32B

SPEC = ModelSpec.from_hf_config(QWEN3_32B, "t")
SEQ = 65536
CONTEXT_TERMS = ("context_gathered_kv", "context_mask", "context_sdpa_mask_copy")
H100 = M.Budget(80 * M.GIB, "H100 table entry", "rank")
HEADROOM = 0.1


def settings(context: int = 1, seq_len: int = SEQ, **overrides) -> M.FitSettings:
    """Qwen3-32B on 2 x 8 GPUs, one row per micro-batch, checkpointed, validating on one row too."""
    base = dict(world_size=16, nodes=2, tokens_per_micro_batch=seq_len, activation_checkpointing=True)
    base.update(mixed_precision=True, eval_tokens_per_micro_batch=seq_len, context=context, seq_len=seq_len)
    return M.FitSettings(**{**base, **overrides})


def test_c_1_with_seq_len_estimates_exactly_as_without_it():
    before = M.FitSettings(world_size=16, nodes=2, tokens_per_micro_batch=SEQ, activation_checkpointing=True,
                           mixed_precision=True, eval_tokens_per_micro_batch=SEQ)  # fmt: skip
    assert M.estimate_phases(SPEC, settings(1)) == M.estimate_phases(SPEC, before)
    assert M.phase_notes(SPEC, settings(1)) == M.phase_notes(SPEC, before)
    assert M.mesh_note(SPEC, settings(1)) == ""


@pytest.mark.parametrize("context", [2, 4])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_per_token_terms_fall_by_c_and_the_context_terms_are_added(context, checkpointing):
    one = M.estimate_memory(SPEC, settings(1, activation_checkpointing=checkpointing))
    cp = M.estimate_memory(SPEC, settings(context, activation_checkpointing=checkpointing))
    assert cp["activations"] == one["activations"] // context  # exact: SEQ is a multiple of C
    assert cp["logits"] < one["logits"]  # chunked: the chunk stays, the hidden-state gradient falls by C
    same = {k: v for k, v in one.items() if k not in ("activations", "logits")}
    assert {k: cp[k] for k in same} == same  # sharded state, gathered layers, runtime: as at C = 1
    pairs = SEQ // context * SEQ  # one row: the rank's queries x the row's keys
    layers = 1 if checkpointing else SPEC.num_layers
    assert cp["context_mask"] == pairs
    assert cp["context_sdpa_mask_copy"] == 4 * pairs * layers
    # the gathered K/V and their GQA repeat (8 -> 64 heads), bf16, forward and its gradient
    assert cp["context_gathered_kv"] == 2 * SEQ * (2 * SPEC.kv_dim + 2 * SPEC.q_dim) * 2
    assert ("context_kept_kv" in cp) == (not checkpointing)
    if not checkpointing:  # every other layer's repeated K/V, kept by sdpa until the backward
        assert cp["context_kept_kv"] == SEQ * 2 * SPEC.q_dim * 2 * (SPEC.num_layers - 1)
    assert set(CONTEXT_TERMS) <= cp.keys() and not set(CONTEXT_TERMS) & one.keys()


def test_the_validation_micro_batch_is_split_too():
    big_eval = settings(4, eval_tokens_per_micro_batch=4 * SEQ, activation_checkpointing=False)
    validation = M.validation_forward_bytes(SPEC, big_eval)
    assert validation["activations"] == SEQ * SPEC.activation_elements_per_token_layer() * 2  # 4 rows / 4 ranks
    no_graph = M.context_attention_bytes(SPEC, big_eval, 4 * SEQ, with_grad=False)
    assert no_graph["context_mask"] == 4 * SEQ // 4 * SEQ and "context_kept_kv" not in no_graph
    assert M.estimate_memory(SPEC, big_eval)["context_mask"] == no_graph["context_mask"]  # the larger of the two


def test_fit_settings_reads_parallel_context():
    config = run_config(
        {
            "model": {"config": QWEN3_32B},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_model": "H100"},
            "parallel": {"context": 4},
            "train": {"micro_batch_size": 1, "seq_len": SEQ, "activation_checkpointing": True},
        }
    )
    s = fit_settings(config)
    assert (s.context, s.seq_len, s.rank_tokens) == (4, SEQ, SEQ // 4)
    assert M.context_candidates(s) == [8, 16]
    assert s.context_kernel == "flex"  # auto on GPUs
    on_cpu = run_config(config.to_json() | {"cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_model": "cpu"}})
    explicit = run_config(config.to_json() | {"train": config.to_json()["train"] | {"attn_implementation": "sdpa"}})
    assert fit_settings(on_cpu).context_kernel == fit_settings(explicit).context_kernel == "sdpa"


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_flex_kernel_adds_only_the_gathered_keys_and_values(checkpointing):
    sdpa = M.estimate_memory(SPEC, settings(4, activation_checkpointing=checkpointing))
    flex = M.estimate_memory(SPEC, settings(4, activation_checkpointing=checkpointing, context_kernel="flex"))
    # no pair mask, no float copy of it, no heads repeated: the kernel takes the block mask and GQA as they are
    assert flex["context_gathered_kv"] == 2 * SEQ * 2 * SPEC.kv_dim * 2
    assert not {"context_mask", "context_sdpa_mask_copy", "context_kept_kv"} & flex.keys()
    assert {k: v for k, v in flex.items() if not k.startswith("context_")} == {
        k: v for k, v in sdpa.items() if not k.startswith("context_")
    }


def test_a_row_that_does_not_fit_names_the_smallest_context_that_does():
    s = settings(1, seq_len=131072)
    steady = {c: sum(M.estimate_memory(SPEC, replace(s, context=c)).values()) for c in (1, 2, 4, 8, 16)}
    usable = H100.bytes * (1 - HEADROOM)
    smallest = min(c for c, total in steady.items() if total <= usable)
    assert steady[1] > usable and 1 < smallest <= 16  # the case is one CP solves, and not at once
    fit = M.fit_estimate(SPEC, s, H100, M.Budget(None, M.NOT_CHECKED, "node"))
    assert fit.context_steady == {c: steady[c] for c in (2, 4, 8, 16)}
    check = check_fit(fit.phases, fit.budgets, HEADROOM, fit.mesh, fit.context_steady)
    assert not check.passed and "\n" not in check.detail
    assert f"parallel.context {smallest} would fit ({steady[smallest] / M.GIB:.1f} GiB per rank)" in check.detail
    # from a C that does not fit, the suggestion starts above it
    at_2 = replace(s, context=2)
    fit2 = M.fit_estimate(SPEC, at_2, H100, M.Budget(None, M.NOT_CHECKED, "node"))
    assert list(fit2.context_steady) == [4, 8, 16]
    assert fit2.mesh == (
        "parallel.context 2: a rank holds 65,536 of each 131,072-token row and gathers the row's keys and values in "
        "every attention layer"
    )


def test_no_context_fits_says_so_and_a_fitting_run_says_nothing():
    s = settings(1, seq_len=131072, world_size=4, nodes=1)  # 32B over 4 ranks: the sharded state alone is too big
    fit = M.fit_estimate(SPEC, s, H100, M.Budget(None, M.NOT_CHECKED, "node"))
    check = check_fit(fit.phases, fit.budgets, HEADROOM, fit.mesh, fit.context_steady)
    largest = fit.context_steady[4]
    assert f"no parallel.context up to 4 fits (4: {largest / M.GIB:.1f} GiB per rank)" in check.detail
    small = settings(1, seq_len=4096)
    fit = M.fit_estimate(SPEC, small, H100, M.Budget(None, M.NOT_CHECKED, "node"))
    check = check_fit(fit.phases, fit.budgets, HEADROOM, fit.mesh, fit.context_steady)
    assert check.passed and "parallel.context" not in check.detail


def test_no_suggestion_under_expert_parallelism():
    s = settings(1, seq_len=131072, expert=2)
    assert M.context_candidates(s) == []
    fit = M.fit_estimate(SPEC, s, H100, M.Budget(None, M.NOT_CHECKED, "node"))
    check = check_fit(fit.phases, fit.budgets, HEADROOM, fit.mesh, fit.context_steady)
    assert not check.passed and "parallel.context" not in check.detail


def test_context_above_1_needs_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        M.FitSettings(world_size=2, tokens_per_micro_batch=8, activation_checkpointing=True, mixed_precision=True,
                      context=2)  # fmt: skip

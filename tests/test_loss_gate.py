"""The gate's `logits` term follows train.loss: one chunk's logits plus the gradients torch's chunked loss
computes in its forward (chunked), or the whole micro-batch's (full); the validation forward is counted;
gate.md names what the term is."""

from __future__ import annotations

from conftest import QWEN3_32B, QWEN3_SETTINGS

from wattgate.config import run_config
from wattgate.gate import memory as M
from wattgate.model_spec import ModelSpec
from wattgate.gate.report import phase_markdown, phases_json

SPEC = ModelSpec.from_hf_config(QWEN3_32B, "test")
V, H = SPEC.vocab_size, SPEC.hidden_size


def settings(**overrides) -> M.FitSettings:
    return M.FitSettings(**{**QWEN3_SETTINGS, **overrides})


def test_chunked_logits_term_is_one_chunk_and_the_gradients_of_the_loss_forward():
    s = settings()
    tokens = s.tokens_per_micro_batch
    # bf16 on a GPU: fp32 chunk logits and their bf16 copy; hidden and head gradients in bf16
    assert M.estimate_memory(SPEC, s)["logits"] == 1024 * V * 6 + (tokens + V) * H * 2
    # the whole micro-batch's logits are what the full kind holds: tokens x V x (bf16 + fp32 upcast + fp32 grad)
    assert M.estimate_memory(SPEC, settings(loss="full"))["logits"] == tokens * V * 10
    # doubling the micro-batch adds only its hidden-state gradient, not a second tokens x V block
    double = M.estimate_memory(SPEC, settings(tokens_per_micro_batch=2 * tokens))["logits"]
    assert double - M.estimate_memory(SPEC, s)["logits"] == tokens * H * 2
    cpu = settings(mixed_precision=False, on_gpu=False, loss_chunk_tokens=256)
    assert M.estimate_memory(SPEC, cpu)["logits"] == 256 * V * 4 + (tokens + V) * H * 4


def test_a_larger_validation_micro_batch_can_set_the_steady_terms():
    train = M.estimate_memory(SPEC, settings())
    assert M.estimate_memory(SPEC, settings(eval_tokens_per_micro_batch=8192)) == train  # no graph: smaller
    big = M.estimate_memory(SPEC, settings(eval_tokens_per_micro_batch=64 * 8192, loss="full"))
    assert big["logits"] == 64 * 8192 * V * (2 + 4) > train["logits"]
    assert big["activations"] == 64 * 8192 * SPEC.activation_elements_per_token_layer() * 2


def test_validation_tokens_come_from_eval_micro_batch_size_only_when_there_is_a_split():
    train = {"micro_batch_size": 2, "seq_len": 4096, "eval_micro_batch_size": None}
    assert M.validation_tokens_per_micro_batch(run_config({"data": {"validation": {}}, "train": train})) == 0
    config = {"data": {"validation": {"fraction": 0.01}}, "train": train}
    assert M.validation_tokens_per_micro_batch(run_config(config)) == 2 * 4096
    config["train"] = dict(train, eval_micro_batch_size=8)
    assert M.validation_tokens_per_micro_batch(run_config(config)) == 8 * 4096


def test_gate_md_names_the_logits_term():
    for loss, words in (("chunked", "one chunk of 1,024 tokens x 151,936 vocab"), ("full", "train.loss full")):
        s = settings(loss=loss)
        fit = M.fit_estimate(SPEC, s, M.Budget(80 * M.GIB, "t", "rank"), M.Budget(None, "t", "node"))
        markdown = "\n".join(phase_markdown("steady", phases_json(fit, 0.1)["steady"]))
        assert words in markdown and "logits:" in markdown

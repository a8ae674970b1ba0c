"""The gate verifies the tokenizer the export will ship: it passes the tokenizer pretokenize used and fails,
naming the folder, when a file in it changed, went missing or was added after pretokenize, or the folder is gone."""

import shutil

import pytest

from wattgate.config import run_config
from wattgate.records.run_config import RunConfig
from wattgate.data.pretokenize import pretokenize
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan

from conftest import write_jsonl

MODEL = {
    "model_type": "qwen3",
    "vocab_size": 640,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "tie_word_embeddings": True,
}


def gate_config(inputs: list[str]) -> RunConfig:
    return run_config(
        {
            "data": {"inputs": inputs},
            "train": {"seq_len": 512, "micro_batch_size": 1, "grad_accum": 1, "epochs": 1, "warmup_steps": 0},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "gate": {"collectives": False},
            "model": {"config": MODEL},
        }
    )


@pytest.fixture
def tokenized_run(tmp_path, tokenizer_dir, demo_docs):
    """A copy of the test tokenizer, data pretokenized with it and a plan: everything a passing gate needs."""
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    config = gate_config([str(write_jsonl(tmp_path / "c.jsonl", demo_docs[:40]))])
    pretokenize(config, tok, tmp_path / "pt", progress=False)
    build_plan(config, tmp_path / "pt", tmp_path / "plan")
    return config, tok, tmp_path / "pt", tmp_path / "plan"


def tokenizer_check(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "tokenizer")


# ---------------------------------------------------------------- the gate verifies the tokenizer to export


def test_gate_passes_the_tokenizer_pretokenize_used(tokenized_run, tmp_path):
    config, tok, pt, plan = tokenized_run
    report = run_gate(config, pt, plan, tmp_path / "gate").to_json()
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    check = tokenizer_check(report)
    assert check["passed"] and str(tok.resolve()) in check["detail"] and "chat_template.jinja" in check["detail"]


def _edit_config(tok):
    (tok / "tokenizer_config.json").write_text((tok / "tokenizer_config.json").read_text() + "\n")


def _delete_template(tok):
    (tok / "chat_template.jinja").unlink()


def _add_vocab(tok):
    (tok / "vocab.json").write_text("{}")


def _remove_folder(tok):
    shutil.rmtree(tok)


@pytest.mark.parametrize(
    "change, expected",
    [
        (_edit_config, "changed since pretokenize"),
        (_delete_template, "changed since pretokenize"),
        (_add_vocab, "changed since pretokenize"),
        (_remove_folder, "is gone"),
    ],
)
def test_gate_fails_when_the_tokenizer_changed_after_pretokenize(tokenized_run, tmp_path, change, expected):
    config, tok, pt, plan = tokenized_run
    change(tok)
    report = run_gate(config, pt, plan, tmp_path / "gate").to_json()
    check = tokenizer_check(report)
    assert not report["passed"] and not check["passed"]
    assert check["detail"].startswith(f"{tok.resolve()}: ") and expected in check["detail"]
    assert "\n" not in check["detail"]
    assert not (tmp_path / "gate" / "PASSED").exists()
    if change is _delete_template:  # the files it holds now show which one went missing
        assert "(it holds tokenizer.json, tokenizer_config.json)" in check["detail"]


# ---------------------------------------------------------------- a failed gate leaves no old verdict


# ---------------------------------------------------------------- shard lengths pack cannot use


# ---------------------------------------------------------------- the packer's memory follows the bins

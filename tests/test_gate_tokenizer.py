"""Probe findings on the pack stage and the gate: shard lengths pack cannot use, a seq_len the packer's
memory must not follow, the tokenizer the export will verify, and what a failed gate leaves in --out."""

import shutil
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wattgate.config import validate_config
from wattgate.data.pretokenize import pretokenize
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.gate.run import run_gate
from wattgate.pack.bfd import pack_bfd
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
VERDICT_FILES = ("gate.json", "gate.md", "PASSED", "UNENFORCED")


def make_config(inputs: list[str]) -> dict:
    return validate_config(
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
    config = make_config([str(write_jsonl(tmp_path / "c.jsonl", demo_docs[:40]))])
    pretokenize(config, tok, tmp_path / "pt", progress=False)
    build_plan(config, tmp_path / "pt", tmp_path / "plan")
    return config, tok, tmp_path / "pt", tmp_path / "plan"


def tokenizer_check(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "tokenizer")


# ---------------------------------------------------------------- the gate verifies the tokenizer to export


def test_gate_passes_the_tokenizer_pretokenize_used(tokenized_run, tmp_path):
    config, tok, pt, plan = tokenized_run
    report = run_gate(config, pt, plan, tmp_path / "gate")
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
    report = run_gate(config, pt, plan, tmp_path / "gate")
    check = tokenizer_check(report)
    assert not report["passed"] and not check["passed"]
    assert check["detail"].startswith(f"{tok.resolve()}: ") and expected in check["detail"]
    assert "\n" not in check["detail"]
    assert not (tmp_path / "gate" / "PASSED").exists()
    if change is _delete_template:  # the files it holds now show which one went missing
        assert "(it holds tokenizer.json, tokenizer_config.json)" in check["detail"]


# ---------------------------------------------------------------- a failed gate leaves no old verdict


@pytest.fixture
def synthetic_run(tmp_path):
    lengths = np.random.default_rng(2).integers(5, 60, 40)
    pt = write_random_pretokenized(tmp_path / "pt", lengths, vocab=600, seed=4, shard_docs=25)
    config = make_config(["unused.jsonl"])
    build_plan(config, pt, tmp_path / "plan")
    return config, pt, tmp_path / "plan"


def test_a_gate_stopped_by_bad_input_leaves_no_previous_verdict(synthetic_run, tmp_path):
    config, pt, plan = synthetic_run
    out = tmp_path / "gate"
    assert run_gate(config, pt, plan, out)["passed"] and (out / "PASSED").exists()
    (plan / "packs.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError):
        run_gate(config, pt, plan, out)
    assert [name for name in VERDICT_FILES if (out / name).exists()] == []


def test_a_gate_stopped_by_bad_input_does_not_create_its_out(synthetic_run, tmp_path):
    config, pt, plan = synthetic_run
    (plan / "packs.parquet").unlink()
    with pytest.raises(InputError):
        run_gate(config, pt, plan, tmp_path / "gate")
    assert not (tmp_path / "gate").exists()


# ---------------------------------------------------------------- shard lengths pack cannot use


def _zero_lengths(table):
    return table.set_column(
        table.schema.get_field_index("num_tokens"), "num_tokens", pa.array([0] * len(table), pa.int32())
    )


def _null_lengths(table):
    return table.set_column(
        table.schema.get_field_index("num_tokens"), "num_tokens", pa.array([None] * len(table), pa.int32())
    )


def _float_lengths(table):
    values = [float(x) + 0.5 for x in table.column("num_tokens").to_pylist()]
    return table.set_column(table.schema.get_field_index("num_tokens"), "num_tokens", pa.array(values, pa.float64()))


def _no_lengths(table):
    return table.drop(["num_tokens"])


@pytest.mark.parametrize(
    "edit, expected",
    [
        (_zero_lengths, "doc_id 0 has num_tokens 0 (25 document(s) with num_tokens < 1)"),
        (_null_lengths, "column num_tokens has 25 null value(s)"),
        (_float_lengths, "column num_tokens has type double"),
        (_no_lengths, "shard has no num_tokens column"),
    ],
)
def test_pack_refuses_shard_lengths_it_cannot_pack_in_one_line(tmp_path, edit, expected):
    pt = write_random_pretokenized(tmp_path / "pt", [5] * 30, vocab=600, shard_docs=25)
    shard = pt / "shard-00000.parquet"
    pq.write_table(edit(pq.read_table(shard)), shard)
    with pytest.raises(InputError) as err:
        build_plan(make_config(["unused.jsonl"]), pt, tmp_path / "plan")
    message = str(err.value)
    assert message.startswith(f"{shard}: ") and expected in message and message.endswith("rerun pretokenize")
    assert "\n" not in message
    assert not (tmp_path / "plan").exists()


# ---------------------------------------------------------------- the packer's memory follows the bins


def test_bfd_memory_does_not_grow_with_the_capacity():
    capacity = 5_000_000  # a list per possible room would take hundreds of MB here
    lengths = np.array([3_000_000, 2_500_000, 2_000_000, 1_500_000, 7, 7])
    tracemalloc.start()
    try:
        packed = pack_bfd(lengths, capacity)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000
    # best fit: 2.0M joins 3.0M (room 2.0M), 1.5M joins 2.5M (room 2.5M), the 7s take bin 1's 1.0M, the only room left
    assert packed.tolist() == [0, 1, 0, 1, 1, 1]

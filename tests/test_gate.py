"""Each gate check on a plan that breaks exactly its invariant; the memory estimate; the CLI."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import yaml

from wattgate.cli import main
from wattgate.config import validate_config
from wattgate.data.pretokenize import pretokenize
from wattgate.gate import checks as C
from wattgate.gate.inputs import load_inputs
from wattgate.gate.memory import GIB, FitSettings, ModelSpec, estimate_memory
from wattgate.gate.run import run_checks, run_gate
from wattgate.pack.plan import build_plan

from conftest import write_jsonl

TINY_MODEL = {"model_type": "qwen3", "vocab_size": 600, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


@pytest.fixture(scope="module")
def stage_dirs(tmp_path_factory, tokenizer_dir, demo_docs):
    work = tmp_path_factory.mktemp("gate")
    config = validate_config({
        "data": {"inputs": [str(write_jsonl(work / "c.jsonl", demo_docs))]},
        "train": {"seq_len": 256, "micro_batch_size": 2, "grad_accum": 2, "epochs": 2, "warmup_steps": 2,
                  "checkpoint_every": 5},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "model": {"config": TINY_MODEL},
    })
    pretokenize(config, tokenizer_dir, work / "pretokenized", progress=False)
    build_plan(config, work / "pretokenized", work / "plan")
    return config, work


@pytest.fixture
def inputs(stage_dirs, tmp_path):
    config, work = stage_dirs
    return load_inputs(config, work / "pretokenized", work / "plan", tmp_path / "ckpt")


def verdicts(inputs):
    from wattgate.gate.memory import load_model_spec
    from wattgate.gate.run import fit_settings

    spec = load_model_spec(inputs.config)
    return {c.name: c for c in run_checks(inputs, spec, estimate_memory(spec, fit_settings(inputs.config)))}


def failed(inputs):
    return sorted(name for name, c in verdicts(inputs).items() if not c.passed)


def without_rows(packs, rows):
    keep = np.ones(len(packs), dtype=bool)
    keep[rows] = False
    entry_keep = np.repeat(keep, packs.docs_per_row)
    offsets = np.concatenate(([0], np.cumsum(packs.docs_per_row[keep])))
    return dataclasses.replace(
        packs, **{f: getattr(packs, f)[keep] for f in ("epoch", "step", "micro", "rank", "slot", "num_tokens")},
        doc_ids=packs.doc_ids[entry_keep], doc_lengths=packs.doc_lengths[entry_keep], offsets=offsets,
        length_offsets=offsets)


def test_valid_plan_passes_every_check(inputs):
    assert failed(inputs) == []
    assert len(verdicts(inputs)) == 9


def test_equal_steps_names_per_rank_counts_when_a_rank_is_short(inputs):
    p = inputs.packs
    last_of_rank1 = np.flatnonzero((p.epoch == 1) & (p.rank == 1))[-2:]  # its whole last micro-batch
    broken = dataclasses.replace(inputs, packs=without_rows(p, last_of_rank1))
    check = verdicts(broken)["equal_steps"]
    assert not check.passed
    n = int(((p.epoch == 1) & (p.rank == 0)).sum()) // 2
    assert f"epoch 1: ranks differ: micro-batches per rank {{0: {n}, 1: {n - 1}}}" in check.detail
    # its documents are now missing (conservation) and its last step idles (balance); nothing else
    assert failed(broken) == ["balance", "conservation", "equal_steps"]


def test_equal_steps_catches_partial_micro_batches_with_equal_counts(inputs):
    p = inputs.packs
    slot1 = np.flatnonzero((p.epoch == 0) & (p.slot == 1) & (p.step == 0) & (p.micro == 0))
    moved = p.micro.copy()
    moved[slot1] = 7  # same counts per rank, but micro-batch (0, 0) now holds one pack per rank
    check = C.check_equal_steps(dataclasses.replace(p, micro=moved), 2, 2, 2, 2, inputs.plan["steps_per_epoch"])
    assert not check.passed and "pack count other than micro_batch_size" in check.detail


def test_equal_steps_catches_micro_batches_moved_between_steps(inputs):
    p = inputs.packs
    # every rank moves (step 1, micro 1) to (step 0, micro 2): equal totals, but 3 + 1 micro-batches per step
    sel = (p.step == 1) & (p.micro == 1)
    step, micro = p.step.copy(), p.micro.copy()
    step[sel], micro[sel] = 0, 2
    check = C.check_equal_steps(dataclasses.replace(p, step=step, micro=micro), 2, 2, 2, 2, inputs.plan["steps_per_epoch"])
    assert not check.passed
    assert "outside 0..1 (grad_accum)" in check.detail and "micro-batch count other than grad_accum 2" in check.detail


def test_pack_contents_catches_misaligned_length_lists_without_crashing(inputs):
    p = inputs.packs
    shifted = p.length_offsets.copy()
    shifted[1] -= 1  # row 0 lost its last length to row 1
    check = C.check_pack_contents(dataclasses.replace(p, length_offsets=shifted), 256, inputs.doc_tokens,
                                  inputs.doc_loss_tokens)
    assert not check.passed and "doc_ids and doc_lengths lists differ in length" in check.detail
    short = dataclasses.replace(p, doc_lengths=p.doc_lengths[:-1], length_offsets=np.minimum(p.length_offsets, len(p.doc_lengths) - 1))
    assert not C.check_pack_contents(short, 256, inputs.doc_tokens, inputs.doc_loss_tokens).passed


def test_pack_contents_overlong_and_lossless_packs(inputs):
    p = inputs.packs
    tokens = p.num_tokens.copy()
    lengths = p.doc_lengths.copy()
    tokens[0] += 300
    lengths[p.offsets[0]] += 300
    doc = p.doc_ids[p.offsets[0]]
    doc_tokens = inputs.doc_tokens.copy()
    doc_tokens[doc] += 300
    broken = dataclasses.replace(inputs, packs=dataclasses.replace(p, num_tokens=tokens, doc_lengths=lengths),
                                 doc_tokens=doc_tokens)
    check = C.check_pack_contents(broken.packs, 256, broken.doc_tokens, broken.doc_loss_tokens)
    assert not check.passed and "over seq_len 256" in check.detail

    loss = inputs.doc_loss_tokens.copy()
    loss[p.doc_ids[p.offsets[3]:p.offsets[4]]] = 0
    broken = dataclasses.replace(inputs, doc_loss_tokens=loss)
    assert failed(broken) == ["pack_contents"]
    assert "without a loss-bearing token" in verdicts(broken)["pack_contents"].detail


def test_pack_contents_catches_lengths_that_disagree_with_shards(inputs):
    doc_tokens = inputs.doc_tokens.copy()
    doc_tokens[inputs.packs.doc_ids[0]] += 1
    check = C.check_pack_contents(inputs.packs, 256, doc_tokens, inputs.doc_loss_tokens)
    assert not check.passed and "differ from the shards" in check.detail


def test_conservation_duplicate_and_missing_document(inputs):
    p = inputs.packs
    ids = p.doc_ids.copy()
    lengths = p.doc_lengths
    epoch0 = np.repeat(p.epoch, p.docs_per_row) == 0
    # two different documents of equal length: pack contents stay consistent, one doc now appears twice
    first = np.flatnonzero(epoch0)
    a, b = next((i, j) for i in first for j in first if i < j and lengths[i] == lengths[j] and ids[i] != ids[j])
    ids[b] = ids[a]
    broken = dataclasses.replace(inputs, packs=dataclasses.replace(p, doc_ids=ids))
    assert failed(broken) == ["conservation"]
    detail = verdicts(broken)["conservation"].detail
    assert "more than once" in detail and "neither packed nor dropped" in detail


def test_conservation_dropped_without_reason(inputs):
    check = C.check_conservation(inputs.packs, 2, inputs.doc_tokens, int(inputs.manifest["num_tokens"]), [], {"x": {"docs": 3}})
    assert not check.passed and "reasons account for 3" in check.detail


def test_launch_mismatch(inputs):
    config = json.loads(json.dumps(inputs.config))
    config["cluster"]["nodes"] = 2
    broken = dataclasses.replace(inputs, config=config)
    assert "launch" in failed(broken)
    assert "plan world_size 2 != cluster.nodes x cluster.gpus_per_node 4" in verdicts(broken)["launch"].detail


def test_provenance_edited_packs_stale_manifest_and_small_vocab(inputs):
    assert failed(dataclasses.replace(inputs, packs_sha256="0" * 64)) == ["provenance"]
    assert failed(dataclasses.replace(inputs, manifest_sha256="0" * 64)) == ["provenance"]
    check = C.check_provenance(inputs.plan, inputs.packs_sha256, inputs.manifest_sha256, inputs.manifest, 100)
    assert not check.passed and "does not fit the model's vocab_size 100" in check.detail


def test_fit_fails_when_estimate_exceeds_memory():
    check = C.check_fit({"activations": 90 * GIB, "runtime_overhead": 3 * GIB}, 80 * GIB, "H100 table entry", 0.1)
    assert not check.passed and "largest term activations" in check.detail
    assert C.check_fit({"activations": 60 * GIB}, 80 * GIB, "H100", 0.1).passed


def test_checkpoint_space():
    assert not C.check_checkpoint_space(100 * GIB, 2, 10 * GIB, 200 * GIB, "/scratch").passed
    assert C.check_checkpoint_space(10 * GIB, 2, 1 * GIB, 200 * GIB, "/scratch").passed


def test_balance_names_the_worst_step(inputs):
    p = inputs.packs
    check = C.check_balance(p, 2, 1e-5, 1.0)
    assert not check.passed and "worst" in check.detail
    # make one rank's packs heavier in one step: double its tokens there
    tokens = p.num_tokens.copy()
    sel = (p.epoch == 0) & (p.step == 3) & (p.rank == 0)
    tokens[sel] *= 3
    check = C.check_balance(dataclasses.replace(p, num_tokens=tokens), 2, 0.0, 1.1)
    assert not check.passed and "(epoch 0 step 3)" in check.detail


def test_schedule(inputs):
    config = json.loads(json.dumps(inputs.config))
    config["train"]["warmup_steps"] = 10_000
    broken = dataclasses.replace(inputs, config=config)
    assert failed(broken) == ["schedule"]
    config["train"].update(warmup_steps=0, checkpoint_every=10_000)
    assert "no checkpoint" in verdicts(broken)["schedule"].detail


QWEN3_32B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600,
             "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": False}


def test_qwen3_32b_on_2x8_b300_estimate_is_plausible():
    spec = ModelSpec.from_hf_config(QWEN3_32B, "qwen3-32b")
    # per layer: q 5120x8192 + k,v 2x5120x1024 + o 8192x5120 + mlp 3x5120x25600 = 487.6M;
    # x 64 layers = 31.2B, + untied embedding and head 2 x 151936 x 5120 = 1.56B: 32.8B (the model card's 32.8B)
    assert 32.5e9 < spec.num_params < 33.0e9
    with_ac = estimate_memory(spec, FitSettings(16, 8192, activation_checkpointing=True, mixed_precision=True))
    # fp32 params + grads + Adam = 16 B/param / 16 ranks = 32.8 GB; bf16 layer inputs 8192 x 64 x 5120 x 2 = 5.4 GB
    # + one recomputed layer 2.8 GB; logits 8192 x 151936 x 10 B = 12.4 GB; gathered params ~5 GB; ~70 GB total
    assert with_ac["sharded_params_fp32"] + with_ac["sharded_grads_fp32"] + with_ac["sharded_adam_state_fp32"] == pytest.approx(32.8e9, rel=0.01)
    assert 55 * GIB < sum(with_ac.values()) < 85 * GIB
    without = estimate_memory(spec, FitSettings(16, 8192, activation_checkpointing=False, mixed_precision=True))
    # all 64 layers keep ~340 KB per token: 8192 x 64 x 340 KB = 178 GB of activations
    assert 160e9 < without["activations"] < 190e9
    assert sum(without.values()) < 288 * GIB  # fits a B300, but not an H100 or H200
    assert sum(without.values()) > 141 * GIB


def test_gate_cli_fails_with_exit_1_and_names_check(stage_dirs, tmp_path, capsys):
    config, work = stage_dirs
    import pyarrow.parquet as pq

    plan = tmp_path / "plan"
    shutil.copytree(work / "plan", plan)
    # a hand edit after packing: the same rows, rewritten in another order
    table = pq.read_table(plan / "packs.parquet")
    pq.write_table(table.take(list(range(1, table.num_rows)) + [0]), plan / "packs.parquet")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config))
    out = tmp_path / "gate"
    rc = main(["gate", "--config", str(cfg), "--pretokenized", str(work / "pretokenized"), "--plan", str(plan),
               "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAIL provenance: packs.parquet changed since it was planned" in err
    assert "1 check(s) failed: provenance" in err
    assert not (out / "PASSED").exists() and json.loads((out / "gate.json").read_text())["passed"] is False


def test_gate_writes_passed_and_report(stage_dirs, tmp_path):
    config, work = stage_dirs
    report = run_gate(config, work / "pretokenized", work / "plan", tmp_path / "gate")
    assert report["passed"] and (tmp_path / "gate/PASSED").exists()
    md = (tmp_path / "gate/gate.md").read_text()
    assert "# Invariant gate: PASSED" in md and "| sharded_params_fp32 |" in md
    assert report["elapsed_s"] < 5


def test_stale_pass_is_removed_when_the_gate_fails(stage_dirs, tmp_path):
    config, work = stage_dirs
    out = tmp_path / "gate"
    run_gate(config, work / "pretokenized", work / "plan", out)
    bad = json.loads(json.dumps(config))
    bad["train"]["warmup_steps"] = 10_000
    assert not run_gate(bad, work / "pretokenized", work / "plan", out)["passed"]
    assert not (out / "PASSED").exists() and not (out / "UNENFORCED").exists()
    bad["gate"]["enforce"] = False  # the explicit override: a marker downstream rules can wait on
    assert not run_gate(bad, work / "pretokenized", work / "plan", out)["passed"]
    assert "FAILED, not enforced" in (out / "UNENFORCED").read_text() and not (out / "PASSED").exists()


def test_missing_plan_is_exit_2(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    rc = main(["gate", "--config", str(cfg), "--pretokenized", str(tmp_path), "--plan", str(tmp_path / "none"),
               "--out", str(tmp_path / "g")])
    assert rc == 2
    assert "plan.json: cannot read plan" in capsys.readouterr().err

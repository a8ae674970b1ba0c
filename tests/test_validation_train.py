"""Validation passes in real gloo runs: one loss whatever the world size, equal to scoring each held-out
document alone; a mixture's loss per source, equal to each source's documents scored alone; and an uneven
validation plan, with every guard off, really hangs and is killed in `eval`."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from wattgate.config import run_config
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan
from wattgate.train.data import DocStore

from conftest import TINY, fake_pretokenized, make_run, run_train, with_extra_validation_micro_batch
from support.scoring import exported_model_scores, held_out_sources, scored_alone_by_source, scored_by_transformers

# the weights must not move in the one step taken: what is scored is the seeded initial model, the same at
# every world size (sgd at lr 1e-30 changes no fp32 weight of this size)
FROZEN = dict(optimizer="sgd", lr=1e-30, weight_decay=0.0, max_steps=1, checkpoint_every=1, export_dtype="float32")


@pytest.mark.slow
def test_validation_loss_is_the_same_on_1_2_3_ranks_and_equals_each_document_scored_alone(tmp_path):
    lengths = np.random.default_rng(3).integers(5, 60, 120).tolist()
    losses = {}
    for world in (1, 2, 3):
        make_run(tmp_path, lengths, gpus=world, validation_fraction=0.25, micro_batch_size=2, grad_accum=1, **FROZEN)
        run_train(tmp_path, world, tmp_path / f"w{world}")
        rows = pq.read_table(tmp_path / f"w{world}" / "eval.parquet").to_pylist()
        assert [r["step"] for r in rows] == [1]
        losses[world] = rows[0]["loss"]
    ref = scored_by_transformers(tmp_path / "w1" / "final", tmp_path / "pretokenized")
    spread = max(losses.values()) - min(losses.values())
    print(f"validation loss by world size {losses}; spread {spread:.3g}; reference {ref:.9f}")
    assert spread <= 1e-6 * ref  # fp32 token losses summed in fp64: only the reduction order differs
    assert abs(losses[1] - ref) <= 1e-5 * ref  # packed rows vs one document at a time (attention kernels)


@pytest.mark.slow
def test_an_uneven_validation_plan_hangs_in_eval_and_the_watcher_kills_it(tmp_path):
    lengths = np.random.default_rng(4).integers(5, 60, 200).tolist()
    pretok = fake_pretokenized(tmp_path / "pretokenized", lengths, validation_fraction=0.2)
    config = run_config(
        {
            "run_name": "uneven-eval",
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "gate": {"enforce": False},
            "watcher": {"hang_after_s": 5},
            "train": {
                "seq_len": 64,
                "micro_batch_size": 1,
                "grad_accum": 1,
                "epochs": 1,
                "warmup_steps": 0,
                "eval_every": 2,
                "check_planned_counts": False,
                "collective_timeout_s": 600,
                "tensorboard": False,
            },
        }
    )
    plan_dir, gate_dir, out = tmp_path / "plan", tmp_path / "gate", tmp_path / "run"
    build_plan(config, pretok, plan_dir)
    with_extra_validation_micro_batch(plan_dir, rank=1)
    report = run_gate(config, pretok, plan_dir, gate_dir).to_json()
    assert not next(c for c in report["checks"] if c["name"] == "validation_steps")["passed"]
    assert report["failure"]["line"].startswith("would hang in the first validation pass, after step 2 (epoch 0)")
    assert report["failure"]["divergence"]["ranks_with"] == [1] and report["failure"]["divergence"]["phase"] == "eval"
    assert (gate_dir / "UNENFORCED").exists()  # the user chose to run past the gate
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config.to_json()))
    argv = [sys.executable, "-m", "wattgate", "launch", "--config", str(cfg_path), "--pretokenized", str(pretok)]
    argv += ["--plan", str(plan_dir), "--run-dir", str(out), "--gate", str(gate_dir)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=400)
    verdict = json.loads((out / "watcher.json").read_text())
    assert proc.returncode != 0 and not (out / "TRAINED").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert verdict["verdict"] == "deadlock", verdict
    # both ranks stopped in the pass after step 2 (the first eval_every): rank 1 in its extra micro-batch
    assert {v["rank"]: (v["phase"], v["step"]) for v in verdict["ranks"]} == {0: ("eval", 2), 1: ("eval", 2)}
    n = json.loads((plan_dir / "plan.json").read_text())["validation"]["micro_batches_per_rank"]
    assert f"validation after step 2: {n} on rank 0, {n + 1} on rank 1" in verdict["reason"], verdict["reason"]
    # the gate's collective proof (copied beside the run) names the class and where rank 1's collectives parted
    assert verdict["expected"]["1"].startswith(f"rank 1: step 2 (class 1 micro-batch + validation ({n} micro-batches))")
    assert f"eval micro-batch {n + 1}" in verdict["expected"]["1"] and "the proof expects" in verdict["reason"]
    print(f"watcher: {verdict['reason']}")


# a two-source mixture, each source with its own held-out slice (the synthetic shards' `source` column)
MIXTURE = [
    {"path": "alpha.jsonl", "name": "alpha", "weight": 0.7, "docs": 100},
    {"path": "beta.jsonl", "name": "beta", "weight": 0.3, "docs": 60},
]


def tiny_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = dict(TINY)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_token_losses_sum_to_the_summed_loss_and_split_exactly_over_sources(tmp_path):
    """One process, no ranks: a validation micro-batch's per-position losses sum to summed_token_loss (bit for bit
    for the chunked kind), and their per-source sums equal each source's held-out documents scored alone."""
    from wattgate.run_files import EVAL_PACKS
    from wattgate.train.data import build_batch, read_rank_plan
    from wattgate.train.eval_sources import read_eval_sources
    from wattgate.train.loss import summed_token_loss, to_tensors, token_losses

    lengths = np.random.default_rng(7).integers(5, 60, 160).tolist()
    plan, config = make_run(tmp_path, lengths, gpus=1, validation_fraction=0.25, mixture=MIXTURE, micro_batch_size=2)
    pretok = tmp_path / "pretokenized"
    sources = read_eval_sources(pretok)
    assert sources.names == ("alpha", "beta")
    assert set(held_out_sources(pretok).values()) == {"alpha", "beta"}
    model = tiny_model()
    for kind in ("chunked", "full"):
        totals = torch.zeros(sources.size, dtype=torch.float64)
        for m in read_rank_plan(plan, 0, EVAL_PACKS):
            batch = build_batch(DocStore(pretok), m.packs, 64)
            tensors = to_tensors(batch, torch.device("cpu"))
            with torch.no_grad():
                losses = token_losses(model, tensors, kind, 16)
                whole = summed_token_loss(model, tensors, kind, 16)
            if kind == "chunked":
                assert torch.equal(losses.sum(), whole)  # the single-source pass's own figure
            else:
                assert float(losses.sum()) == pytest.approx(float(whole), rel=1e-6)
            sources.add(totals, losses, batch.labels, sources.positions(m.packs, 64))
            totals[1] += batch.num_loss_tokens
        row = sources.row(totals)
        alone = scored_alone_by_source(model, pretok)
        for name, (total, tokens) in alone.items():
            assert row[f"tokens/{name}"] == tokens
            assert row[f"loss/{name}"] == pytest.approx(total / tokens, rel=1e-5)
        assert float(totals[1]) == sum(t for _, t in alone.values())


def test_a_single_held_out_source_adds_no_column(tmp_path):
    """A plain single-source run's eval.parquet keeps its columns: no breakdown of one source."""
    from wattgate.run_tables import EVAL_SCHEMA, EvalTable
    from wattgate.train.eval_sources import read_eval_sources

    pretok = fake_pretokenized(tmp_path / "pretokenized", [20] * 40, validation_fraction=0.25)
    sources = read_eval_sources(pretok)
    assert not sources and sources.size == 2 and sources.row(torch.zeros(2)) == {}
    assert EvalTable(tmp_path / "eval.parquet", [], sources.names).schema == EVAL_SCHEMA


def test_shards_without_a_source_column_are_one_line(tmp_path):
    from wattgate.errors import InputError
    from wattgate.train.eval_sources import read_eval_sources

    sources = [("alpha", 20), ("beta", 20)]
    pretok = fake_pretokenized(tmp_path / "pretokenized", [20] * 40, validation_fraction=0.25, sources=sources)
    shard = pretok / "shard-00000.parquet"
    pq.write_table(pq.read_table(shard).drop_columns(["source"]), shard)
    with pytest.raises(InputError, match=r"shard-00000.parquet: missing column\(s\) source; rerun pretokenize$"):
        read_eval_sources(pretok)


@pytest.mark.slow
def test_a_mixture_on_2_ranks_reports_each_source_loss_as_its_documents_scored_alone(tmp_path):
    """2 gloo ranks, a 2-source mixture: eval.parquet's per-source losses equal one process scoring each source's
    held-out documents alone; the whole is their token-weighted mean; TRAINED and TensorBoard carry them."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lengths = np.random.default_rng(8).integers(5, 60, 160).tolist()
    make_run(
        tmp_path, lengths, gpus=2, validation_fraction=0.25, mixture=MIXTURE, micro_batch_size=2, grad_accum=1, **FROZEN
    )
    out = tmp_path / "run"
    proc = run_train(tmp_path, 2, out)
    table = pq.read_table(out / "eval.parquet")
    assert table.column_names[-4:] == ["loss/alpha", "tokens/alpha", "loss/beta", "tokens/beta"]
    (row,) = table.to_pylist()
    alone = exported_model_scores(out / "final", tmp_path / "pretokenized")
    for name, (total, tokens) in alone.items():
        print(f"{name}: run {row[f'loss/{name}']:.9f}, alone {total / tokens:.9f} over {tokens} tokens")
        assert row[f"tokens/{name}"] == tokens
        assert row[f"loss/{name}"] == pytest.approx(total / tokens, rel=1e-5)  # packed rows vs one document at a time
    assert row["tokens"] == row["tokens/alpha"] + row["tokens/beta"]
    weighted = sum(row[f"loss/{n}"] * row[f"tokens/{n}"] for n in ("alpha", "beta")) / row["tokens"]
    assert row["loss"] == pytest.approx(weighted, rel=1e-12)
    assert f"alpha {row['loss/alpha']:.4f}, beta {row['loss/beta']:.4f}" in proc.stdout
    trained = json.loads((out / "TRAINED").read_text())["validation"]["per_source"]
    assert [(s["name"], s["final_loss"], s["tokens"]) for s in trained] == [
        (n, row[f"loss/{n}"], row[f"tokens/{n}"]) for n in ("alpha", "beta")
    ]
    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    for name in ("alpha", "beta"):
        (event,) = board.Scalars(f"eval/loss/{name}")
        assert event.step == 1 and event.value == pytest.approx(row[f"loss/{name}"], rel=1e-6)

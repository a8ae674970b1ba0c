"""Validation passes in real gloo runs: one loss whatever the world size, equal to scoring each held-out
document alone; and an uneven validation plan, with every guard off, really hangs and is killed in `eval`."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import yaml

from wattgate.config import validate_config
from wattgate.data.split import read_validation_ids
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan
from wattgate.train.data import IGNORE, DocStore

from conftest import TINY, fake_pretokenized, make_run, run_train, with_extra_validation_micro_batch

# the weights must not move in the one step taken: what is scored is the seeded initial model, the same at
# every world size (sgd at lr 1e-30 changes no fp32 weight of this size)
FROZEN = dict(optimizer="sgd", lr=1e-30, weight_decay=0.0, max_steps=1, checkpoint_every=1, export_dtype="float32")


def reference_loss(final, pretokenized) -> float:
    """A single process scoring each held-out document on its own, full logits: summed token loss / tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True, attn_implementation="eager")
    manifest = json.loads((pretokenized / "manifest.json").read_text())
    store, total, tokens = DocStore(pretokenized), 0.0, 0
    with torch.no_grad():
        for doc in read_validation_ids(pretokenized, manifest).tolist():
            ids, mask = store.get(doc)
            labels = np.where(mask.astype(bool), ids, IGNORE)
            labels[0] = IGNORE
            logits = model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False).logits[0]
            target = torch.from_numpy(labels[1:].astype(np.int64))
            total += float(F.cross_entropy(logits[:-1].double(), target, ignore_index=IGNORE, reduction="sum"))
            tokens += int((target != IGNORE).sum())
    return total / tokens


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
    ref = reference_loss(tmp_path / "w1" / "final", tmp_path / "pretokenized")
    spread = max(losses.values()) - min(losses.values())
    print(f"validation loss by world size {losses}; spread {spread:.3g}; reference {ref:.9f}")
    assert spread <= 1e-6 * ref  # fp32 token losses summed in fp64: only the reduction order differs
    assert abs(losses[1] - ref) <= 1e-5 * ref  # packed rows vs one document at a time (attention kernels)


@pytest.mark.slow
def test_an_uneven_validation_plan_hangs_in_eval_and_the_watcher_kills_it(tmp_path):
    lengths = np.random.default_rng(4).integers(5, 60, 200).tolist()
    pretok = fake_pretokenized(tmp_path / "pretokenized", lengths, validation_fraction=0.2)
    config = validate_config(
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
    report = run_gate(config, pretok, plan_dir, gate_dir)
    assert not next(c for c in report["checks"] if c["name"] == "validation_steps")["passed"]
    assert report["failure"]["line"].startswith("would hang in the first validation pass, after step 2 (epoch 0)")
    assert report["failure"]["divergence"]["ranks_with"] == [1] and report["failure"]["divergence"]["phase"] == "eval"
    assert (gate_dir / "UNENFORCED").exists()  # the user chose to run past the gate
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
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

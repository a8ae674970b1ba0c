"""Issue 25, section 5: a smoke run's checkpoint cadence is a note, and a CPU run with no ledger line still gets
a forecast (the host's matmul rate, named), so an uneven plan's 'would hang' line states its cost."""

import json
import time

import numpy as np

from wattgate.forecast.throughput import host_matmul_flops, host_matmul_throughput
from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan

from conftest import TINY, with_extra_validation_micro_batch


def gate_of(tmp_path, remainder="rebin", **train):
    pretok = write_random_pretokenized(tmp_path / "pretokenized", np.random.default_rng(2).integers(8, 60, 80), 96, 0)
    t = {"seq_len": 64, "micro_batch_size": 1, "grad_accum": 2, "epochs": 1, "warmup_steps": 0} | train
    config = run_config(
        {
            "run_name": "t",
            "train": t,
            "pack": {"remainder": remainder},
            "gate": {"enforce": remainder != "none"},
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_model": "cpu"},
            "forecast": {"ledger": str(tmp_path / "no-such-ledger.jsonl")},
        }
    )
    build_plan(config, pretok, tmp_path / "plan")
    return run_gate(config, pretok, tmp_path / "plan", tmp_path / "gate").to_json()


def test_a_smoke_run_checkpoint_cadence_is_a_note_not_a_failure(tmp_path):
    report = gate_of(tmp_path, max_steps=2, checkpoint_every=50)
    schedule = next(c for c in report["checks"] if c["name"] == "schedule")
    assert schedule["passed"], schedule["detail"]  # failed before: the loop checkpoints at the last step anyway
    assert "note: train.checkpoint_every 50 > total steps 2 (train.max_steps 2)" in schedule["detail"]
    assert "the only checkpoint is the one at the last step (2)" in schedule["detail"]


def test_cpu_without_a_ledger_line_forecasts_from_the_host_matmul_and_costs_the_hang(tmp_path):
    report = gate_of(tmp_path, remainder="none")
    fc = report["forecast"]
    assert fc is not None and fc["throughput"]["source"] == "host-matmul"  # None before: no source on CPU
    assert "fp32 matmul measured on this host" in fc["throughput"]["detail"]
    assert "shared by 2 rank(s) per node" in fc["throughput"]["detail"]
    failure = report["failure"]
    assert failure["divergence"] is not None and failure["cost"] is not None
    assert "would hang at epoch" in failure["line"] and "GPU-hours" in failure["line"]
    assert "needs a forecast" not in failure["line"]
    on_disk = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert on_disk["forecast"]["throughput"]["source"] == "host-matmul"


def test_the_host_matmul_takes_under_a_second_and_reads_a_real_rate():
    start = time.perf_counter()
    flops = host_matmul_flops()
    assert time.perf_counter() - start < 1.0
    assert 1e8 < flops < 1e14  # between a tenth of a GFLOP/s and 100 TFLOP/s: a CPU, measured
    tp = host_matmul_throughput(1_000_000, 4, 0.5, flops)
    assert tp.cost_per_s == flops / 4 * 0.5 / 6e6 and tp.source == "host-matmul"


def test_an_uneven_validation_pass_on_cpu_states_its_cost(tmp_path):
    """With the host-matmul forecast the validation failure's cost is computed on CPU too (a KeyError there)."""

    lengths = np.random.default_rng(4).integers(5, 60, 200)
    pretok = write_random_pretokenized(tmp_path / "pretokenized", lengths, 96, 0, validation_fraction=0.2)
    config = run_config(
        {
            "run_name": "t",
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_model": "cpu"},
            "gate": {"enforce": False},
            "train": {"seq_len": 64, "micro_batch_size": 1, "grad_accum": 1, "warmup_steps": 0, "eval_every": 2},
            "forecast": {"ledger": str(tmp_path / "no-such-ledger.jsonl")},
        }
    )
    build_plan(config, pretok, tmp_path / "plan")
    with_extra_validation_micro_batch(tmp_path / "plan", rank=1)
    failure = run_gate(config, pretok, tmp_path / "plan", tmp_path / "gate").to_json()["failure"]
    assert failure["cost"] is not None and failure["divergence"]["phase"] == "eval"
    assert failure["line"].startswith("would hang in the first validation pass, after step 2")
    assert "GPU-hours" in failure["line"] and "needs a forecast" not in failure["line"]

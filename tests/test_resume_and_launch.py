"""Run identity (a checkpoint resumes only the run that wrote it), rank 0's resume choice, the planned-
sequence guard, launch refusing a plan the gate did not pass, and OS errors as one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from wattgate.artifacts import write_json_atomic
from wattgate.cli import main
from wattgate.config import run_config
from wattgate.errors import InputError
from wattgate.gate.run import run_gate
from wattgate.identity import identity_differences, model_identity, run_identity
from wattgate.train.launch import check_gate_marker
from wattgate.train.checkpoint import file_hash

from conftest import final_params, make_run, run_train, save_hf_model, torchrun

REPO = Path(__file__).resolve().parents[1]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


# ---------------------------------------------------------------- run identity


def test_identity_names_what_changed(tmp_path):
    plan, config = make_run(tmp_path, [20] * 30, gpus=1)
    base = run_identity(config, plan, tmp_path / "pretokenized")
    assert identity_differences(base, run_identity(config, plan, tmp_path / "pretokenized")) == []
    changed = config.to_json()
    changed["train"].update(lr=0.5, seed=7, log_every=3, checkpoint_every=5)  # the last two change nothing computed
    differences = identity_differences(base, run_identity(run_config(changed), plan, tmp_path / "pretokenized"))
    assert differences == ["train.lr", "train.seed"]
    assert identity_differences(None, base) == ["run identity (the checkpoint predates it)"]


def test_model_identity_sees_other_weights_of_the_same_shapes(tmp_path):

    a = model_identity({"path": str(save_hf_model(tmp_path / "a", seed=1))})
    b = model_identity({"path": str(save_hf_model(tmp_path / "b", seed=2))})
    assert a.config == b.config and a.weights != b.weights


@pytest.mark.slow
def test_changed_hyperparameters_train_anew_instead_of_resuming_the_old_run(tmp_path):
    lengths = np.random.default_rng(4).integers(5, 60, 60).tolist()
    make_run(tmp_path, lengths, gpus=2, epochs=1, checkpoint_every=2)
    out = tmp_path / "run"
    run_train(tmp_path, 2, out)
    first = json.loads((out / "TRAINED").read_text())
    config_file = tmp_path / "config-2.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["train"].update(lr=5e-3, seed=1)
    config_file.write_text(yaml.safe_dump(config))
    proc = run_train(tmp_path, 2, out)
    second = json.loads((out / "TRAINED").read_text())
    assert second["resumed_from_step"] == 0 and second["tokens_per_s"] > 0, proc.stdout
    assert "differs in train.lr, train.seed" in proc.stderr and "starting from step 0" in proc.stderr
    assert len(list(tmp_path.glob("run/checkpoints.stale-*"))) == 1
    assert second["final_loss"] != first["final_loss"]
    # the same config again resumes its own finished run: nothing to train, same model
    before = final_params(out)
    proc = run_train(tmp_path, 2, out)
    assert json.loads((out / "TRAINED").read_text())["resumed_from_step"] == second["steps"], proc.stdout
    after = final_params(out)
    assert all((before[k] == after[k]).all() for k in before)


@pytest.mark.slow
def test_every_rank_resumes_from_rank_0s_choice(tmp_path):
    identity = {"plan": "p", "pretokenized": "t", "model": {"config": "c", "weights": "w"}, "train": {}}
    from wattgate.identity import RESULT_SETTINGS

    identity["train"] = {k: None for k in RESULT_SETTINGS}
    views = []
    for rank, steps in ((0, (3, 6)), (1, (3,))):  # rank 1's (stale) listing has not seen step-6 yet
        view = tmp_path / f"view-{rank}"
        for step in steps:
            d = view / "checkpoints" / f"step-{step}"
            d.mkdir(parents=True)
            (d / "x.distcp").write_bytes(b"x")
            files = {"x.distcp": {"bytes": 1, "hash": file_hash(d / "x.distcp")}}
            state = {"step": step, "files": files, "hash_algorithm": "xxh3_128", "identity": identity}
            write_json_atomic(d / "state.json", state)
        views.append(view)
    (tmp_path / "identity.json").write_text(json.dumps(identity))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "tests/dist/resume_choice.py"),
        str(views[0]),
        str(views[1]),
        str(tmp_path / "identity.json"),
        str(tmp_path / "choice.json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    choices = json.loads((tmp_path / "choice.json").read_text())
    assert choices == [str(views[0] / "checkpoints" / "step-6")] * 2


# ---------------------------------------------------------------- the planned-sequence guard


@pytest.mark.slow
def test_a_micro_batch_moved_to_the_next_step_is_stopped_before_step_1(tmp_path):
    plan, _ = make_run(tmp_path, [30] * 48, gpus=2, grad_accum=2, micro_batch_size=1)
    packs = pq.read_table(plan / "packs.parquet").to_pandas()
    moved = (packs["rank"] == 0) & (packs["epoch"] == 0) & (packs["step"] == 0) & (packs["micro"] == 1)
    assert moved.sum() == 1
    packs.loc[moved, ["step", "micro"]] = [1, 2]  # totals per rank unchanged
    pq.write_table(
        pa.Table.from_pandas(packs, schema=pq.read_schema(plan / "packs.parquet"), preserve_index=False),
        plan / "packs.parquet",
    )
    proc = subprocess.run(
        torchrun(tmp_path, 2, tmp_path / "out"), capture_output=True, text=True, env=env(), timeout=120
    )
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "planned counts differ across ranks" in text
    assert "first at micro-batch #2 of the run: rank 0: epoch 0 step 2 micro-batch 1" in text
    assert "rank 1: epoch 0 step 1 micro-batch 2" in text
    assert not (tmp_path / "out" / "metrics.parquet").exists()


# ---------------------------------------------------------------- launch needs the gate's marker for this plan


def test_launch_refuses_a_plan_the_gate_did_not_pass(tmp_path):
    plan, config = make_run(tmp_path, [20] * 40, gpus=2, checkpoint_every=2)
    gate = tmp_path / "gate"
    with pytest.raises(InputError, match="no PASSED marker"):
        check_gate_marker(run_config(config), plan, gate)
    report = run_gate(config, tmp_path / "pretokenized", plan, gate).to_json()
    assert report["passed"], report["checks"]
    assert check_gate_marker(run_config(config), plan, gate) == gate / "PASSED"
    # the plan changed after the gate (another pack seed): same files, other bytes
    config = config.replace(pack=config.pack.replace(seed=1))
    from wattgate.pack.plan import build_plan

    build_plan(config, tmp_path / "pretokenized", plan)
    with pytest.raises(InputError, match="the gate checked another plan.json"):
        check_gate_marker(run_config(config), plan, gate)
    rc = main(
        [
            "launch",
            "--config",
            str(tmp_path / "config-2.yaml"),
            "--pretokenized",
            str(tmp_path / "pretokenized"),
            "--plan",
            str(plan),
            "--gate",
            str(gate),
            "--run-dir",
            str(tmp_path / "train"),
        ]
    )
    assert rc == 2 and not (tmp_path / "train").exists()


# ---------------------------------------------------------------- OS errors are one line, exit 2


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root in a namespace that allows it)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("case", ["disk full", "read-only"])
def test_os_errors_are_one_line_naming_the_file(small_tmpfs, tmp_path, case):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"inputs": ["x.jsonl"]}, "demo_corpus": {"num_docs": 2000}}))
    if case == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wattgate",
            "demo-corpus",
            "--config",
            str(config),
            "--out",
            str(small_tmpfs / "corpus.jsonl"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    expected = "No space left on device" if case == "disk full" else "Read-only file system"
    assert lines[0].startswith("wattgate demo-corpus: error: ")
    assert str(small_tmpfs) in lines[0] and expected in lines[0]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_rng_state_is_read_as_tensors_only(tmp_path, monkeypatch):
    import pickle

    import torch

    from wattgate.train.checkpoint import read_rng_state

    good = tmp_path / "rng-rank-0.pt"
    torch.save({"torch": torch.get_rng_state(), "cuda": []}, good)
    assert torch.equal(read_rng_state(good)["torch"], torch.get_rng_state())
    bad = tmp_path / "rng-rank-1.pt"
    bad.write_bytes(pickle.dumps({"torch": _RunsCode()}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="not an RNG state wattgate wrote"):
        read_rng_state(bad)
    assert not (tmp_path / "PWNED").exists()

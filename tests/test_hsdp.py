"""HSDP (parallel.replicate): the key is checked against the world size before any job, one function builds the
mesh (consecutive ranks in one shard group; replicate 1 the 1-D mesh as before), the collective proof records every
collective on its mesh dimension and names the rank and its group when a replica rank skips the replicate
all-reduce, and a checkpoint saved under one mesh resumes under the other, every step once."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import yaml

from wattgate.config import replicate_degree, run_config
from wattgate.errors import InputError
from wattgate.gate import memory as M
from wattgate.gate.run import fit_settings
from wattgate.model_spec import ModelSpec
from wattgate.gate.run import run_gate
from wattgate.proof.prove import prove_collectives
from wattgate.train.mesh import REPLICATE_DIM, SHARD_DIM, data_parallel_mesh, mesh_groups

from conftest import (
    assert_resumed_as_straight,
    assert_trained_as,
    CADENCE,
    QWEN3_32B,
    QWEN3_SETTINGS,
    TINY_3_LAYERS,
    killed_after_first_checkpoint,
    make_run,
    run_train,
)
from support.runs import with_sections


def config_of(replicate, nodes=2, gpus_per_node=2) -> dict:
    return {"cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node}, "parallel": {"replicate": replicate}}


@pytest.mark.parametrize("value", [0, 3, -2, 2.5, "two", True, None])
def test_a_replicate_that_does_not_divide_the_world_is_one_line_naming_the_key(value):
    with pytest.raises(InputError) as err:
        run_config(config_of(value))
    line = str(err.value)
    assert "\n" not in line and "key 'parallel.replicate'" in line and f"{value!r} is not allowed" in line
    assert "a divisor of the world size 4 (cluster.nodes 2 x cluster.gpus_per_node 2): 1, 2, 4; or auto" in line


def test_the_gate_stops_at_the_config_before_any_work_naming_parallel_replicate(tmp_path, capsys):
    from wattgate.cli import main

    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(config_of(3)))
    argv = ["gate", "--config", str(cfg), "--pretokenized", str(tmp_path / "p"), "--plan", str(tmp_path / "plan")]
    assert main([*argv, "--out", str(tmp_path / "gate")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"wattgate gate: error: {cfg}: key 'parallel.replicate': 3 is not allowed") and "\n" not in err
    )
    assert not (tmp_path / "gate").exists()


def test_replicate_defaults_to_1_and_auto_is_one_replica_per_node():
    assert run_config({}).parallel.replicate == 1 and replicate_degree(run_config({})) == 1
    assert replicate_degree(run_config(config_of("auto", nodes=3, gpus_per_node=4))) == 3
    assert replicate_degree(run_config(config_of(4, nodes=1, gpus_per_node=8))) == 4


def mesh_on_fake_group(rank: int, world: int, replicate: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = data_parallel_mesh("cpu", world, replicate)
        return mesh, {dim: ranks for dim, ranks in mesh_groups(mesh).values()}
    finally:
        dist.destroy_process_group()


def test_hsdp_mesh_puts_consecutive_ranks_in_one_shard_group_and_replicate_1_is_the_1d_mesh():
    mesh, groups = mesh_on_fake_group(rank=5, world=8, replicate=2)
    assert mesh.mesh_dim_names == (REPLICATE_DIM, SHARD_DIM) and tuple(mesh.shape) == (2, 4)
    assert groups == {SHARD_DIM: (4, 5, 6, 7), REPLICATE_DIM: (1, 5)}  # a node of 4: its ranks shard together
    mesh, groups = mesh_on_fake_group(rank=5, world=8, replicate=1)
    assert mesh.mesh_dim_names is None and tuple(mesh.shape) == (8,) and groups == {}
    with pytest.raises(InputError, match=r"^parallel.replicate: 3 does not divide the world size 8"):
        data_parallel_mesh("cpu", 8, 3)


# ---------------------------------------------------------------- the gate's fit check

SHARDED = ("sharded_params_fp32", "sharded_grads_fp32", "sharded_adam_state_fp32")


def test_the_fit_check_shards_the_state_over_the_shard_degree_and_gathers_the_same_units():
    spec, n = ModelSpec.from_hf_config(QWEN3_32B, "t"), ModelSpec.from_hf_config(QWEN3_32B, "t").num_params
    flat = M.estimate_memory(spec, M.FitSettings(**QWEN3_SETTINGS, nodes=2))  # 16 ranks, 8 a node
    hsdp = M.estimate_memory(spec, M.FitSettings(**QWEN3_SETTINGS, nodes=2, replicate=2))  # 2 replicas of 8
    assert [flat[k] for k in SHARDED] == [n * 4 // 16, n * 4 // 16, n * 8 // 16]
    assert [hsdp[k] for k in SHARDED] == [n * 4 // 8, n * 4 // 8, n * 8 // 8]
    # 16 bytes a parameter over 8 ranks instead of 16: twice the sharded state, nothing else changes
    more = sum(hsdp[k] - flat[k] for k in SHARDED)
    assert sum(hsdp.values()) - sum(flat.values()) == more == (n * 16 // 8) - (n * 16 // 16)
    assert {k: v for k, v in hsdp.items() if k not in SHARDED} == {k: v for k, v in flat.items() if k not in SHARDED}
    config = run_config({"model": {"config": QWEN3_32B}} | config_of("auto", nodes=2, gpus_per_node=8))
    assert fit_settings(config).replicate == 2 and fit_settings(config).shard_degree == 8


# ---------------------------------------------------------------- the collective proof on the 2-D mesh


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    """(pretokenized, plan, config at replicate 1, config at replicate 2) of 4 ranks at CADENCE, with validation."""
    tmp = tmp_path_factory.mktemp("hsdp-proof")
    lengths = np.random.default_rng(3).integers(5, 60, 160).tolist()
    plan, config = make_run(tmp, lengths, gpus=4, validation_fraction=0.1, **CADENCE)
    hsdp = run_config(config.to_json() | {"parallel": {"replicate": 2}})
    return tmp / "pretokenized", plan, config, hsdp


def groups_of(report: dict) -> set[str]:
    return {s.split(" on group ")[1] for c in report["classes"] for s in c["sequence"]}


def test_the_proof_builds_the_2d_mesh_and_records_shard_and_replicate_collectives_on_their_groups(hsdp_run):
    pretokenized, plan, flat, hsdp = hsdp_run
    one = prove_collectives(flat, pretokenized, plan).to_json()
    two = prove_collectives(hsdp, pretokenized, plan).to_json()
    assert one["passed"] and two["passed"], (one["detail"], two["detail"])
    assert groups_of(one) == {"0"}  # the 1-D mesh: the world's group, as before
    # rank 0's groups, by its mesh dimension (compared) and its ranks (named)
    assert groups_of(two) == {"0", f"{SHARD_DIM} (ranks 0, 1)", f"{REPLICATE_DIM} (ranks 0, 2)"}
    steps = [s for c in two["classes"] for s in c["sequence"]]
    assert any(s.startswith("c10d._reduce_scatter_base_") and SHARD_DIM in s for s in steps)
    assert any(s.startswith("c10d.allreduce_") and REPLICATE_DIM in s for s in steps)  # the replicas' gradients
    assert [c["fingerprint"] for c in one["classes"]] != [c["fingerprint"] for c in two["classes"]]


def test_a_replica_rank_that_skips_the_replicate_all_reduce_fails_the_gate_naming_the_rank_and_group(
    hsdp_run, tmp_path, monkeypatch
):
    pretokenized, plan, _, hsdp = hsdp_run
    real = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        # rank 1 alone leaves its replica group (ranks 1 and 3) without its gradient all-reduce
        if dist.get_rank() == 1 and group is not None and dist.get_process_group_ranks(group) == [1, 3]:
            return None
        return real(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    report = run_gate(hsdp, pretokenized, plan, tmp_path / "gate").to_json()
    check = next(c for c in report["checks"] if c["name"] == "collectives")
    assert not check["passed"] and not report["passed"] and not (tmp_path / "gate" / "PASSED").exists()
    d = report["collectives"]["divergence"]
    assert d["rank"] == 1 and d["group"] == f"{REPLICATE_DIM} (ranks 1, 3)", d
    assert d["rank0"].startswith("c10d.allreduce_") and d["rank0"].endswith(f"{REPLICATE_DIM} (ranks 0, 2)")
    assert check["detail"].startswith("rank 1 diverges from rank 0 at "), check["detail"]
    assert f" in its group {REPLICATE_DIM} (ranks 1, 3): rank 0 issues c10d.allreduce_(" in check["detail"]


# ---------------------------------------------------------------- a checkpoint resumes under the other mesh

# HSDP reduce-scatters over 2 ranks and all-reduces over 2 replicas where the 1-D mesh reduce-scatters over 4: the
# same sums in another order, fp32 on CPU, which Adam magnifies where a second moment is tiny (measured: 1.2e-5
# largest absolute difference after ~9 steps). A lost or repeated step moves parameters by about lr = 1e-2.
PARAM_TOLERANCE = 1e-4


def with_replicate(tmp: Path, replicate: int) -> None:
    with_sections(tmp, 4, parallel={"replicate": replicate})


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-rank run's inputs and its uninterrupted training on the 1-D mesh: what each HSDP run is compared with."""
    root = tmp_path_factory.mktemp("hsdp-straight")
    lengths = np.random.default_rng(5).integers(5, 60, 160).tolist()
    train = dict(grad_accum=1, epochs=1, checkpoint_every=3, export_dtype="float32")
    make_run(root, lengths, gpus=4, validation_fraction=0.1, **train)
    with_replicate(root, 1)
    straight = root / "straight"
    run_train(root, 4, straight)
    return root, straight


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [(1, 2), (2, 1)])
def test_a_checkpoint_saved_under_one_mesh_resumes_under_the_other_every_step_once(
    tmp_path, straight_run, saved, resumed
):
    root, straight = straight_run
    for name in ("pretokenized", "plan-4", "config-4.yaml"):  # the same inputs, this test's own copy
        (shutil.copytree if (root / name).is_dir() else shutil.copy)(root / name, tmp_path / name)
    total = json.loads((straight / "TRAINED").read_text())["steps"]
    assert total >= 6

    out = tmp_path / "moved"
    with_replicate(tmp_path, saved)
    killed_after_first_checkpoint(tmp_path, 4, out)
    with_replicate(tmp_path, resumed)
    proc = run_train(tmp_path, 4, out)
    summary = json.loads((out / "TRAINED").read_text())
    assert 3 <= summary["resumed_from_step"] < total, proc.stdout
    # the data seen exactly once across the change of mesh; final/ the Hugging Face layout whatever the mesh
    assert_resumed_as_straight(out, straight, PARAM_TOLERANCE)


@pytest.mark.slow
def test_an_hsdp_run_trains_as_the_1d_run_and_its_final_folder_scores_as_reported(tmp_path, straight_run):
    """HSDP 2 x 2 on 4 ranks against the 1-D mesh on the same plan: first-step losses and gradient norm, the
    validation loss after 8+ steps, and final/ scored by transformers (support/runs.py for the tolerances)."""
    root, straight = straight_run
    for name in ("pretokenized", "plan-4", "config-4.yaml"):
        (shutil.copytree if (root / name).is_dir() else shutil.copy)(root / name, tmp_path / name)
    with_replicate(tmp_path, 2)
    run_train(tmp_path, 4, tmp_path / "hsdp")
    print(assert_trained_as(tmp_path / "hsdp", straight, tmp_path / "pretokenized"))
    assert json.loads((tmp_path / "hsdp" / "TRAINED").read_text())["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    assert "mesh" not in json.loads((straight / "TRAINED").read_text())  # the 1-D mesh: TRAINED as before


def load_check(tmp: Path, ranks: int, replicate: int) -> Path:
    """`wattgate load-check --export` of TINY_3_LAYERS (seeded init) on `ranks` ranks at `replicate`: its final/."""
    out, cfg = tmp / f"w{ranks}-r{replicate}", tmp / f"w{ranks}-r{replicate}.yaml"
    train = {"export_dtype": "float32", "export_max_shard_gib": 1e-5}
    cluster = {"nodes": 1, "gpus_per_node": ranks}
    config = {"run_name": "t", "model": {"config": TINY_3_LAYERS}, "train": train, "cluster": cluster}
    cfg.write_text(yaml.safe_dump(config | {"parallel": {"replicate": replicate}}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += ["-m", "wattgate", "load-check", "--config", str(cfg), "--out", str(out), "--export"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "load-check.json").read_text())["world_size"] == ranks
    return out / "final"


@pytest.mark.slow
def test_load_check_under_hsdp_loads_and_exports_the_same_hugging_face_folder(tmp_path):
    one, hsdp = load_check(tmp_path, 1, 1), load_check(tmp_path, 4, 2)
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in hsdp.iterdir()) and "model.safetensors.index.json" in files
    for name in files:  # byte for byte: the same weights, gathered from 2 replicas of 2 shards
        assert (one / name).read_bytes() == (hsdp / name).read_bytes(), name

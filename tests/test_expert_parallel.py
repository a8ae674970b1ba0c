"""Expert parallelism (parallel.expert): the config's one-line refusals, and on gloo a tiny random-init Qwen3-MoE
trained at EP 2 (and 4) with the losses, gradients and parameters of EP 1, including routings where a rank sends
a peer no token, or a rank receives none (every all-to-all is still issued, with zero-size splits); Mixtral,
DeepSeek-V3 and GPT-OSS at EP 2 on their own routers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from support.architectures import MOE_MATRIX_ONLY
from support.models import MOE_BASE, moe_config
from wattgate.config import run_config, validate_config
from wattgate.errors import InputError
from wattgate.model_spec import load_model_spec

REPO = Path(__file__).resolve().parents[1]
QWEN3_MOE = moe_config("qwen3_moe")  # 4 experts, top 2
TINY_DENSE = dict(QWEN3_MOE, model_type="qwen3")
for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
    TINY_DENSE.pop(key)


def config(expert, world: int = 4, replicate=1, model: dict | None = None) -> dict:
    return {
        "run_name": "t",
        "model": {"config": model or QWEN3_MOE},
        "cluster": {"nodes": 1, "gpus_per_node": world},
        "parallel": {"replicate": replicate, "expert": expert},
    }


@pytest.mark.parametrize(
    ("expert", "replicate", "says"),
    [
        (0, 1, "key 'parallel.expert': 0 is less than the minimum of 1"),
        ("two", 1, "key 'parallel.expert': 'two' is not of type 'integer'"),
        (3, 1, "key 'parallel.expert': 3 does not divide the shard group size 4"),
        (4, 2, "key 'parallel.expert': 4 does not divide the shard group size 2"),
    ],
)
def test_an_expert_degree_the_mesh_cannot_hold_is_one_line_naming_the_key(expert, replicate, says):
    with pytest.raises(InputError) as err:
        validate_config(config(expert, replicate=replicate))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_default_is_one_and_a_divisor_passes():
    assert validate_config(config(1))["parallel"]["expert"] == 1
    assert validate_config({k: v for k, v in config(1).items() if k != "parallel"})["parallel"]["expert"] == 1
    assert load_model_spec(run_config(validate_config(config(2)))).num_experts == 4


@pytest.mark.parametrize(
    ("expert", "world", "model", "says"),
    [
        (2, 4, TINY_DENSE, "parallel.expert: 2 needs a Mixture-of-Experts model; model.config (qwen3) is dense"),
        (8, 8, QWEN3_MOE, "parallel.expert: 8 does not divide the 4 experts of model.config (qwen3_moe)"),
    ],
)
def test_an_expert_degree_the_model_cannot_hold_is_one_line_naming_the_key_and_the_model(expert, world, model, says):
    with pytest.raises(InputError) as err:
        load_model_spec(run_config(validate_config(config(expert, world, model=model))))
    assert says in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- training at EP E equals EP 1


def torchrun(world: int, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def family(model_type: str) -> dict:
    """The tiny 2-layer, 4-expert top-2 `model_type` (DeepSeek-V3: its first layer dense, its second MoE)."""
    if model_type in MOE_MATRIX_ONLY:
        return dict(MOE_BASE, model_type=model_type, **MOE_MATRIX_ONLY[model_type][0])
    return moe_config(model_type)


def trained(tmp_path: Path, world: int, cases: list[tuple[str, str]], degrees: list[int]) -> dict:
    """Each (model_type, routing) case trained at each degree in one torchrun: {case name: {degree: record}}."""
    listed = []
    for model_type, routing in cases:
        name = f"{model_type}-{routing}"
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config(1, world, model=family(model_type))))
        listed.append({"name": name, "config": str(path), "routing": routing})
    (tmp_path / "cases.json").write_text(json.dumps(listed))
    script = str(REPO / "tests/dist/moe_expert_parallel.py")
    proc = torchrun(world, script, str(tmp_path / "cases.json"), str(tmp_path / "out"), *map(str, degrees))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    return {c["name"]: {d: json.loads((out / c["name"] / f"ep{d}.json").read_text()) for d in degrees} for c in listed}


def assert_same_training(reference: dict, other: dict) -> None:
    for a, b in zip(reference["losses"], other["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (reference["losses"], other["losses"])
    assert abs(reference["grad_norm"] - other["grad_norm"]) <= 1e-5 * reference["grad_norm"]
    for kind in ("grads", "params"):
        assert set(reference[kind]) == set(other[kind])
        for name, value in reference[kind].items():
            torch.testing.assert_close(torch.tensor(other[kind][name]), torch.tensor(value), rtol=1e-5, atol=1e-6)


TWO_RANK_CASES = [
    ("qwen3_moe", "free"),
    ("qwen3_moe", "one_sided"),
    ("qwen3_moe", "starved"),
    ("mixtral", "free"),
    ("deepseek_v3", "free"),
    ("gpt_oss", "free"),
]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """Every two-rank case at EP 1 and 2, in one torchrun (its start-up paid once)."""
    return trained(tmp_path_factory.mktemp("ep-two-ranks"), 2, TWO_RANK_CASES, [1, 2])


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "routing"), TWO_RANK_CASES)
def test_two_ranks_at_ep_2_train_as_at_ep_1(two_rank_runs, model_type, routing):
    """free: the model's router; one_sided: rank 1 sends rank 0 no token (zero-size splits one way); starved: no
    token reaches rank 0's experts from anyone (rank 0's experts run on an empty batch, its backward all-to-alls
    still run). Three SGD steps: the same losses, first-step gradients and final parameters. The other families on
    their own routers: Mixtral, DeepSeek-V3 (grouped router, a shared expert beside the routed ones, a dense first
    layer) and GPT-OSS (expert biases, [experts, in, out] layout)."""
    runs = two_rank_runs[f"{model_type}-{routing}"]
    assert_same_training(runs[1], runs[2])


@pytest.mark.slow
def test_four_ranks_at_ep_2_and_4_train_as_at_ep_1(tmp_path):
    """EP 2 (two expert groups, each expert held by two ranks: FSDP2 shards it over them) and EP 4 (one expert
    per rank), with rank 3 sending rank 0 no token."""
    runs = trained(tmp_path, 4, [("qwen3_moe", "one_sided")], [1, 2, 4])["qwen3_moe-one_sided"]
    assert_same_training(runs[1], runs[2])
    assert_same_training(runs[1], runs[4])

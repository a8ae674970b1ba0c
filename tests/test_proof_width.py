"""The collective proof at a large world: ranks are grouped by everything that can change the collectives they issue
(their plan's step classes and micro-batch rows, their shard of each parameter, rank 0 alone: proof/ranks.py) and
one rank of each group is dry-run, so the proof's time follows the groups, not the world. A rank whose plan differs
in one step is a group of its own, dry-run, caught and named."""

import shutil

import numpy as np
import pytest

from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.pack.plan import build_plan
from wattgate.proof.classes import plans_by_rank
from wattgate.proof.depth import layer_pattern
from wattgate.proof.prove import prove_collectives
from wattgate.proof.ranks import MeshPlaces, rank_groups, shard_dims, shard_kind
from wattgate.run_files import read_plan

from conftest import CADENCE, TINY, train_config, with_micro_batches_changed

WORLD = 1024


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    """A plan for 128 nodes x 8 ranks, two micro-batches a step, and its config."""
    tmp = tmp_path_factory.mktemp("wide")
    lengths = np.random.default_rng(3).integers(20, 60, 16 * WORLD).tolist()
    write_random_pretokenized(tmp / "pretokenized", lengths, 96, 0, shard_docs=2000)
    config = run_config(
        {
            "run_name": "wide",
            "train": train_config(**dict(CADENCE, grad_accum=2, checkpoint_every=1, eval_every=100)),
            "model": {"config": TINY},
            "cluster": {"nodes": WORLD // 8, "gpus_per_node": 8},
        }
    )
    build_plan(config, tmp / "pretokenized", tmp / "plan")
    return tmp / "pretokenized", tmp / "plan", config


def test_shard_kinds_follow_fsdp2s_chunks():
    # 10 rows over 4 ranks: chunks of 3, 3, 3, 1; over 8: 2, 2, 2, 2, 2, then nothing
    assert [shard_kind(10, 4, r) for r in range(4)] == [2, 2, 2, 1]
    assert [shard_kind(10, 8, r) for r in range(8)] == [2, 2, 2, 2, 2, 0, 0, 0]
    assert [shard_kind(1024, 1024, r) for r in (0, 1023)] == [2, 2]


def test_a_ranks_mesh_place_decides_its_shards_of_the_dense_weights_and_of_its_experts():
    # 64 nodes x 8, replicate 64: a rank's replica changes nothing it holds, its place in the node does
    hsdp = MeshPlaces(shard=8)
    assert {hsdp.kinds(r, (10,)) for r in range(0, 512, 8)} == {(2,)}
    assert [hsdp.kinds(r, (10,)) for r in range(8, 16)] == [(2,)] * 5 + [(0,)] * 3
    # expert 2 over a shard group of 8: 12 experts, 6 per expert-group place, sharded over the 4 ranks holding
    # them in chunks of 2: the ranks at places 6 and 7 (expert-shard place 3) hold none of their experts
    ep = MeshPlaces(shard=8, expert=2, experts=12)
    assert [ep.kinds(r, (10,))[1] for r in range(8)] == [2, 2, 2, 2, 2, 2, 0, 0]
    assert [ep.kinds(r, ()) for r in range(8, 16)] == [ep.kinds(r, ()) for r in range(8)]  # the next replica
    # 16 experts over expert 8 with 8 per shard group: every rank holds 2 experts whole, whatever its place
    assert {MeshPlaces(shard=8, expert=8, experts=16).kinds(r, ()) for r in range(64)} == {(2,)}


def test_ranks_of_a_mesh_are_grouped_by_their_place_not_their_number(wide_run):
    _, plan_dir, config = wide_run
    plan, _ = read_plan(plan_dir)
    plans = plans_by_rank(plan, plan_dir, config.train)
    dims = shard_dims(layer_pattern(config.model))
    one_d = rank_groups(plans, dims)
    # replicate 128, expert 8 over shard groups of 8 ranks (a node): the groups no longer grow with the world
    meshed = rank_groups(plans, dims, MeshPlaces(shard=8, expert=8, experts=64))
    assert sorted(r for g in meshed for r in g) == list(range(WORLD)) and meshed[0] == [0]
    assert len(meshed) == 2 < len(one_d)
    assert meshed[1][:3] == [1, 2, 3]


def test_a_balanced_plan_at_world_1024_is_a_few_groups_of_ranks(wide_run):
    _, plan_dir, config = wide_run
    plan, _ = read_plan(plan_dir)
    plans = plans_by_rank(plan, plan_dir, config.train)
    groups = rank_groups(plans, shard_dims(layer_pattern(config.model)))
    assert sorted(r for g in groups for r in g) == list(range(WORLD)) and groups[0] == [0]
    # TINY's dim 0 sizes (8, 16, 32, 64, 96) cut the ranks where they stop holding rows
    assert len(groups) == 7 and [g[0] for g in groups] == [0, 1, 8, 16, 32, 64, 96]


@pytest.mark.slow
def test_one_rank_of_1024_with_one_micro_batch_fewer_is_dry_run_and_named(wide_run, tmp_path):
    pretokenized, plan_dir, config = wide_run
    uneven = tmp_path / "plan"
    shutil.copytree(plan_dir, uneven)
    with_micro_batches_changed(uneven, rank=637, step=1, more=False)
    report = prove_collectives(config, pretokenized, uneven).to_json()
    assert not report["passed"] and report["world_size"] == WORLD
    assert {"rank": 637, "ranks": 1, "last": 637} in report["rank_groups"]
    assert report["ranks_run"] == len(report["rank_groups"]) == 8
    assert report["class_divergence"]["rank"] == 637 and report["class_divergence"]["step"] == 2
    d = report["divergence"]
    assert d["rank"] == 637 and d["step"] == 2 and d["rank0"] != d["this_rank"]
    assert "rank 637 diverges from rank 0 at step 2" in report["detail"]

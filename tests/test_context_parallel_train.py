"""parallel.context end to end: the key is checked before any job (one line each), pack plans for the data-parallel
ranks, and `wattgate train` under torchrun with 2 ranks sharing each row trains as 1 rank holding it: the same
per-step losses and gradient norms, the same validation loss, and final/ scored by transformers' own forward equal
to the validation loss the run reported."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from support.models import TINY
from support.runs import fake_pretokenized, train_config
from support.scoring import scored_by_transformers
from wattgate.config import data_parallel_size, run_config
from wattgate.errors import InputError
from wattgate.run_tables import SOURCE_LOSS_PREFIX

SEQ_LEN = 4096
# a row-long context on a tiny Qwen3 (rotary positions up to seq_len)
MODEL = dict(TINY, max_position_embeddings=SEQ_LEN)


def config_of(context=1, nodes=1, gpus_per_node=2, replicate=1, expert=1, seq_len=SEQ_LEN, **train) -> dict:
    train.setdefault("activation_checkpointing", False)
    return {
        "run_name": "t",
        "model": {"config": MODEL},
        "cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node},
        "parallel": {"replicate": replicate, "expert": expert, "context": context},
        "train": train_config(seq_len=seq_len, **train),
    }


# ---------------------------------------------------------------- the key, before any job


@pytest.mark.parametrize(
    "changes, says",
    [
        (dict(context=3, gpus_per_node=4), "3 does not divide the shard group size 4 (world size / "),
        (dict(context=4, gpus_per_node=4, replicate=2), "4 does not divide the shard group size 2"),
        (dict(context=2, expert=2, gpus_per_node=4), "2 together with parallel.expert 2 is not built yet"),
        (dict(context=2, seq_len=4098), "2 needs train.seq_len divisible by 4 (at least two chunks per rank)"),
        (dict(context=2, attn_implementation="flash_attention_2"), "not flash_attention_2's varlen kernel; set "),
        (dict(context=0), "0 is less than the minimum of 1"),
    ],
)
def test_a_context_degree_that_cannot_run_is_one_line_naming_the_key(changes, says):
    with pytest.raises(InputError) as err:
        run_config(config_of(**changes))
    line = str(err.value)
    assert "\n" not in line and "key 'parallel.context': " in line and says in line, line


def test_context_defaults_to_1_and_pack_plans_for_the_data_parallel_ranks():
    assert run_config({}).parallel.context == 1
    assert data_parallel_size(run_config(config_of(context=2, nodes=2, gpus_per_node=4))) == 4
    assert data_parallel_size(run_config(config_of(context=1, nodes=2, gpus_per_node=4))) == 8


def test_a_model_with_recurrent_state_layers_is_refused_at_pack_in_one_line(tmp_path):
    from wattgate.pack.plan import build_plan

    pretok = fake_pretokenized(tmp_path / "p", [30, 40, 50], vocab=96)
    recurrent = dict(
        model_type="qwen3_next", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=0,
    )  # fmt: skip
    config = run_config(config_of(context=2, seq_len=64) | {"model": {"config": recurrent}})
    with pytest.raises(InputError) as err:
        build_plan(config, pretok, tmp_path / "plan")
    line = str(err.value)
    assert "\n" not in line and line.startswith("parallel.context: 2 cannot split a row across ranks"), line
    assert "recurrent-state layers (layer 0 (linear_attention)" in line and not (tmp_path / "plan").exists()


# ---------------------------------------------------------------- one rank holding each row vs two sharing it

CONTEXTS = (1, 2, 4)  # C = 1 on one rank is the reference
CHECKPOINTED = {4: {"activation_checkpointing": True}}
TRAIN = dict(
    micro_batch_size=1,
    grad_accum=1,
    epochs=1,
    eval_every=2,
    checkpoint_every=100,
    export_dtype="float32",
    loss_chunk_tokens=1000,  # chunks that do not line up with the shard's halves
)


def torchrun(root, ranks: int, context: int, out) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += ["-m", "wattgate", "train", "--config", str(root / f"config-c{context}.yaml")]
    command += ["--pretokenized", str(root / "pretokenized"), "--plan", str(root / f"plan-c{context}")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*command, "--run-dir", str(out)], capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def context_inputs(tmp_path_factory):
    """The root of the pretokenized data, and per C in CONTEXTS its config (C ranks, one data-parallel rank) and
    plan."""
    from wattgate.pack.plan import build_plan

    root = tmp_path_factory.mktemp("context")
    lengths = np.random.default_rng(11).integers(300, 2000, 20).tolist()
    # two sources: the validation pass reports each one's loss too (per-position losses of each shard)
    sources = [("web", 10), ("code", 10)]
    fake_pretokenized(root / "pretokenized", lengths, seed=1, vocab=96, validation_fraction=0.3, sources=sources)
    for context in CONTEXTS:
        # the widest group also recomputes its layers in the backward (activation checkpointing, as users train):
        # the same figures
        config = run_config(config_of(context=context, gpus_per_node=context, **TRAIN, **CHECKPOINTED.get(context, {})))
        build_plan(config, root / "pretokenized", root / f"plan-c{context}")
        (root / f"config-c{context}.yaml").write_text(yaml.safe_dump(config.to_json()))
    return root


@pytest.fixture(scope="module")
def context_runs(context_inputs):
    """(root, {C: the run at C on C ranks} for C in CONTEXTS): the same data, each its own pack of it."""
    root = context_inputs
    for context in CONTEXTS:
        torchrun(root, context, context, root / f"run-c{context}")
    return root, {c: root / f"run-c{c}" for c in CONTEXTS}


def test_pack_plans_the_same_rows_for_one_rank_and_for_a_context_group_of_two(context_inputs):
    root = context_inputs
    one, *others = (json.loads((root / f"plan-c{c}" / "plan.json").read_text()) for c in CONTEXTS)
    assert all(other == one for other in others) and one["world_size"] == 1
    for name in ("packs.parquet", "eval_packs.parquet"):
        for c in CONTEXTS[1:]:
            assert (root / "plan-c1" / name).read_bytes() == (root / f"plan-c{c}" / name).read_bytes()


def step_figures(run) -> dict[int, tuple[float, int, int, float]]:
    """Per step: (the loss over every rank's loss tokens, loss tokens, tokens, gradient norm)."""
    rows = pq.read_table(run / "metrics.parquet").to_pylist()
    out: dict[int, list] = {}
    for r in rows:
        s = out.setdefault(r["step"], [0.0, 0, 0, r["grad_norm"]])
        s[0], s[1], s[2] = s[0] + r["loss"] * r["loss_tokens"], s[1] + r["loss_tokens"], s[2] + r["tokens"]
    return {k: (v[0] / v[1], v[1], v[2], v[3]) for k, v in out.items()}


# fp32 on CPU, the same sums in another order (a row's attention in two halves, the loss in two shards and other
# chunks): measured 5.6e-8 relative on the per-step losses, 2.7e-6 on the gradient norms, 3.4e-8 on the validation
# losses (per source too), 7.4e-10 between final/ scored by transformers and the reported validation loss (5 steps)
STEP_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
VALIDATION_RTOL = 1e-4
SCORED_RTOL = 1e-5


@pytest.mark.parametrize("context", CONTEXTS[1:])
def test_ranks_sharing_each_row_train_as_one_rank_holding_it(context_runs, context):
    root, runs = context_runs
    one, two = runs[1], runs[context]
    mine, theirs = step_figures(two), step_figures(one)
    assert sorted(mine) == sorted(theirs) and len(mine) >= 4
    for step, (loss, loss_tokens, tokens, norm) in mine.items():
        ref = theirs[step]
        assert (loss_tokens, tokens) == ref[1:3], (step, mine[step], ref)  # each token counted once
        assert abs(loss - ref[0]) <= STEP_RTOL * ref[0], (step, loss, ref[0])
        assert abs(norm - ref[3]) <= GRAD_NORM_RTOL * ref[3], (step, norm, ref[3])
    ranks = {r["rank"] for r in pq.read_table(two / "metrics.parquet", columns=["rank"]).to_pylist()}
    assert ranks == set(range(context))
    val, ref_val = (pq.read_table(r / "eval.parquet").to_pylist() for r in (two, one))
    assert [(v["step"], v["tokens"]) for v in val] == [(v["step"], v["tokens"]) for v in ref_val]
    per_source = [k for k in val[0] if k.startswith(SOURCE_LOSS_PREFIX)]
    assert len(per_source) == 2, val[0]  # each source's loss, from each rank's shard of the rows
    for a, b in zip(val, ref_val):
        for k in ("loss", *per_source):
            assert abs(a[k] - b[k]) <= VALIDATION_RTOL * b[k], (k, val, ref_val)
    scored = scored_by_transformers(two / "final", root / "pretokenized")
    assert abs(scored - val[-1]["loss"]) <= SCORED_RTOL * scored, (scored, val[-1])
    trained = json.loads((two / "TRAINED").read_text())
    assert trained["mesh"] == {"dp": 1, "cp": context} and trained["world_size"] == context
    assert "mesh" not in json.loads((one / "TRAINED").read_text())
    worst = max(abs(m[0] - theirs[s][0]) / theirs[s][0] for s, m in mine.items())
    norms = max(abs(m[3] - theirs[s][3]) / theirs[s][3] for s, m in mine.items())
    print(f"context {context} vs 1: worst step loss rel {worst:.2e}, grad norm rel {norms:.2e}, validation rel "
          f"{abs(val[-1]['loss'] - ref_val[-1]['loss']) / ref_val[-1]['loss']:.2e}, scored rel "
          f"{abs(scored - val[-1]['loss']) / scored:.2e}")  # fmt: skip


def test_a_rank_holds_the_same_positions_on_the_host_as_on_the_device():
    from wattgate.train.context_loss import ContextPlace
    from wattgate.train.context_parallel import shard_rows

    from test_context_parallel import packed_rows

    rows = [[30, 2, 9], [64], [5, 5, 5, 40]]
    packs = [types.SimpleNamespace(lengths=np.array(r)) for r in rows]
    batch = packed_rows(64, rows)
    for context in (2, 4):
        for rank in range(context):
            place = ContextPlace(None, context, rank)
            split = place.split(packs, 64)
            device = shard_rows(batch | {"context_positions": torch.from_numpy(split)}, context, rank)
            assert place.local(split).tolist() == device["query_index"].tolist()
            assert device["key_index"].tolist() == split.reshape(len(rows), -1).tolist()


# ---------------------------------------------------------------- the collective proof on the cp mesh


def context_config(root, context: int):
    from wattgate.config import load_run_config

    return load_run_config(root / f"config-c{context}.yaml")


def test_the_proof_dry_runs_each_context_place_and_records_the_key_value_gathers_on_cp(context_inputs):
    from wattgate.proof.prove import prove_collectives

    root = context_inputs
    report = prove_collectives(context_config(root, 2), root / "pretokenized", root / "plan-c2").to_json()
    assert report["passed"], report["detail"]
    assert report["world_size"] == 2 and [g["rank"] for g in report["rank_groups"]] == [0, 1]
    steps = [s for c in report["classes"] for s in c["sequence"]]
    # one data rank: the context group is the whole shard group, one process group named by both dimensions
    gathers = [s for s in steps if "all_gather_into_tensor" in s and " on group cp=dp_shard (ranks 0, 1)" in s]
    assert gathers and not [s for s in steps if " on group dp_shard " in s], steps[:20]


def test_the_proof_covers_context_groups_inside_replicas_of_a_hybrid_sharded_mesh(context_inputs, tmp_path):
    from wattgate.pack.plan import build_plan
    from wattgate.proof.prove import prove_collectives

    root = context_inputs
    # 8 ranks: 2 replicas (HSDP) x 2 data ranks x 2 context ranks; pack plans for the 4 data-parallel ranks
    config = run_config(config_of(context=2, gpus_per_node=8, replicate=2, **TRAIN))
    build_plan(config, root / "pretokenized", tmp_path / "plan")
    report = prove_collectives(config, root / "pretokenized", tmp_path / "plan").to_json()
    assert report["passed"], report["detail"]
    assert report["world_size"] == 8
    steps = [s for c in report["classes"] for s in c["sequence"]]
    assert [s for s in steps if "all_gather_into_tensor" in s and " on group cp " in s], steps[:20]
    assert [s for s in steps if " on group dp_replicate " in s], steps[:20]  # the replicas' gradient all-reduce


def test_a_context_rank_that_skips_its_key_value_gather_fails_the_gate_naming_the_rank_and_cp(
    context_inputs, tmp_path, monkeypatch
):
    import torch
    import torch.distributed as dist

    from wattgate.gate.run import run_gate
    from wattgate.train import context_parallel

    root = context_inputs
    real = context_parallel.gather_sequence

    def gather_sequence(states, group):
        # rank 1 takes its chunks to hold only padding and keeps its keys and values to itself
        if dist.get_rank() == 1:
            return torch.cat([states, states], dim=2)
        return real(states, group)

    monkeypatch.setattr(context_parallel, "gather_sequence", gather_sequence)
    report = run_gate(context_config(root, 2), root / "pretokenized", root / "plan-c2", tmp_path / "gate").to_json()
    check = next(c for c in report["checks"] if c["name"] == "collectives")
    assert not check["passed"] and not report["passed"] and not (tmp_path / "gate" / "PASSED").exists()
    balance = next(c for c in report["checks"] if c["name"] == "context_balance")  # C = 2: the check runs
    assert balance["detail"].startswith("max/mean context-rank attention cost"), balance
    d = report["collectives"]["divergence"]
    assert d["rank"] == 1 and d["group"] == "cp=dp_shard (ranks 0, 1)", d
    assert d["rank0"].startswith("_c10d_functional.all_gather_into_tensor("), d
    assert check["detail"].startswith("rank 1 diverges from rank 0 at "), check["detail"]
    assert " in its group cp=dp_shard (ranks 0, 1): rank 0 issues _c10d_functional.all_gather" in check["detail"]


def test_the_cp_mesh_puts_consecutive_ranks_in_a_context_group_inside_each_shard_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torch.distributed as dist

    from wattgate.train.mesh import data_parallel_mesh, mesh_groups, mesh_layout

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = data_parallel_mesh("cpu", 8, 2, context=2)
        groups = {dim: ranks for dim, ranks in mesh_groups(mesh).values()}
    finally:
        dist.destroy_process_group()
    assert mesh.mesh_dim_names == ("dp_replicate", "dp", "cp") and tuple(mesh.shape) == (2, 2, 2)
    # rank 5 trains data rank 5 // 2 = 2's rows: its dp coordinate in replica 1
    assert groups == {"dp_replicate": (1, 5), "dp": (5, 7), "cp": (4, 5), "dp_shard": (4, 5, 6, 7)}
    assert mesh_layout(8, 2, context=2) == {"dp_replicate": 2, "dp": 2, "cp": 2}


# ---------------------------------------------------------------- the gate's context_balance check


def packs_of(rows: list[list[int]]):
    from wattgate.run_files import PackRows

    n = len(rows)
    lengths = np.array([x for r in rows for x in r], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    tokens = np.array([sum(r) for r in rows], dtype=np.int64)
    return PackRows(
        zeros, zeros, np.arange(n), zeros, zeros, tokens, np.arange(len(lengths)), lengths, offsets, offsets
    )


def brute_costs(rows: list[list[int]], seq_len: int, context: int) -> list[list[int]]:
    """Each rank's causal within-document pairs, counted position by position over the positions the trainer's split
    gives it (padding a document of its own, as the trainer's mask has it)."""
    from wattgate.context_layout import split_rows

    split = split_rows(rows, seq_len, context)
    out = []
    for r, held in zip(rows, split):
        keys = np.zeros(seq_len, dtype=np.int64)  # the keys a query at each position attends
        o = 0
        for n in [*r, seq_len - sum(r)]:
            keys[o : o + n] = np.arange(1, n + 1)
            o += n
        out.append([int(keys[held[c]].sum()) for c in range(context)])
    return out


def test_the_context_cost_counts_each_ranks_causal_pairs_within_documents_and_fails_above_the_bound():
    from wattgate.gate.context_balance_check import check_context_balance, context_rank_costs

    rows = [[64], [10, 20, 30], [7, 1, 40, 13], [33, 31], []]
    for context in (2, 4):
        assert context_rank_costs(packs_of(rows), 64, context).tolist() == brute_costs(rows, 64, context)
    assert len(set(context_rank_costs(packs_of([[64]]), 64, 4)[0].tolist())) == 1  # a row-long document: exact
    # a kernel that skips masked pairs pays the document-aware cost
    passed = check_context_balance(packs_of([[64]]), 64, 2, 1.05, skips_masked_pairs=True)
    assert passed.passed and passed.detail.startswith("max/mean context-rank attention cost over the plan's micro")
    # a 48-token document and 16 of padding in 4 chunks: no split of them evens out the pairs
    failed = check_context_balance(packs_of([[48]]), 64, 2, 1.05, skips_masked_pairs=True)
    assert not failed.passed and "limit 1.050 (gate.max_context_cost_ratio)" in failed.detail, failed.detail
    # the context kernel computes each rank's whole block: the same plan is balanced, and the other figure named
    dense = check_context_balance(packs_of([[48]]), 64, 2, 1.05, skips_masked_pairs=False)
    aware = context_rank_costs(packs_of([[48]]), 64, 2)[0]
    assert dense.passed and "attention cost over the plan's micro-batches: 1.000 " in dense.detail, dense.detail
    assert f"flex attention, skipping masked pairs, would see {aware.max() / aware.mean():.3f}" in dense.detail

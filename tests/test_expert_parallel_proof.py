"""The collective proof under expert parallelism (parallel.expert 2, 4 ranks, Qwen3-MoE with 4 experts): the dry run
builds the EP mesh on the fake process group and records the counts exchange and the token all-to-alls on the
expert group, and the experts' gradient reduce-scatters on the ranks holding the same experts; one process proves
twice with the same result; and the gate fails naming the rank and its group when a rank skips a token all-to-all
or when only the ranks an expert's tokens reached reduce its gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist
import torch.distributed.nn.functional as autograd_collectives

from conftest import CADENCE, make_run
from support.models import moe_config
from wattgate.config import run_config
from wattgate.gate.run import run_gate
from wattgate.proof import prove
from wattgate.proof.prove import prove_collectives
from wattgate.proof.workers import run_tasks
from wattgate.train import moe
from wattgate.train.expert_parallel import ExpertDispatch
from wattgate.train.mesh import EXPERT_DIM, EXPERT_SHARD_DIM, SHARD_DIM

COUNTS = "c10d.alltoall_base_(int64[2,2], int64[2,2])"  # 2 ranks x 2 local experts: the per-expert counts


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """(pretokenized, plan, config at parallel.expert 2) of 4 ranks at CADENCE, with validation."""
    tmp = tmp_path_factory.mktemp("ep-proof")
    lengths = np.random.default_rng(3).integers(5, 60, 160).tolist()
    plan, config = make_run(tmp, lengths, gpus=4, validation_fraction=0.1, **CADENCE)
    cfg = config.to_json() | {"model": {"config": moe_config("qwen3_moe")}, "parallel": {"expert": 2}}
    return tmp / "pretokenized", plan, run_config(cfg)


@pytest.fixture(scope="module")
def ep_report(ep_run) -> dict:
    """The proof with every dry run (rank 0, rank 1, rank 0 starved) in this process, one after another: each
    builds its rank's mesh where the one before built another rank's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prove, "run_tasks", lambda fn, tasks: run_tasks(fn, tasks, processes=1))
        return prove_collectives(ep_run[2], ep_run[0], ep_run[1]).to_json()


def sequence(report: dict) -> list[str]:
    return [s for c in report["classes"] for s in c["sequence"]]


@pytest.mark.slow
def test_the_proof_records_the_counts_exchange_and_the_all_to_alls_on_the_expert_group(ep_report):
    report = ep_report
    assert report["passed"], report["detail"]
    steps = sequence(report)
    groups = {s.split(" on group ")[1] for s in steps}
    assert {
        f"{EXPERT_DIM} (ranks 0, 1)",
        f"{EXPERT_SHARD_DIM} (ranks 0, 2)",
        f"{SHARD_DIM} (ranks 0, 1, 2, 3)",
    } <= groups
    exchanges = [s for s in steps if s.startswith("c10d.alltoall_base_")]
    assert exchanges and all(s.endswith(f"on group {EXPERT_DIM} (ranks 0, 1)") for s in exchanges)
    # per MoE layer and micro-batch: the counts, then the tokens there and back (forward); backward: two more
    assert exchanges[:3] == [f"{COUNTS} on group {EXPERT_DIM} (ranks 0, 1)", *exchanges[1:3]]
    assert not exchanges[1].startswith(COUNTS) and not exchanges[2].startswith(COUNTS)
    # the experts' gradients are reduce-scattered over the ranks holding the same experts
    assert any(s.startswith("c10d._reduce_scatter_base_") and EXPERT_SHARD_DIM in s for s in steps)


@pytest.mark.slow
def test_a_gate_process_proves_twice_with_the_same_result(ep_run, ep_report):
    """Again in the process whose dry runs built rank 0's and rank 1's meshes (its forked workers inherit what they
    left): torch's DTensor caches compare meshes without the rank, and handed rank 1 rank 0's groups."""
    again = prove_collectives(ep_run[2], ep_run[0], ep_run[1]).to_json()
    assert again["passed"], again["detail"]
    assert [c["fingerprint"] for c in again["classes"]] == [c["fingerprint"] for c in ep_report["classes"]]
    assert again["startup"] == ep_report["startup"]


def gate_divergence(ep_run, out) -> tuple[dict, dict]:
    """The gate's report on the EP run (it must fail) and its collectives check."""
    pretokenized, plan, config = ep_run
    report = run_gate(config, pretokenized, plan, out).to_json()
    check = next(c for c in report["checks"] if c["name"] == "collectives")
    assert not check["passed"] and not report["passed"] and not (out / "PASSED").exists()
    return report, check


@pytest.mark.slow
def test_a_rank_that_skips_a_token_all_to_all_fails_the_gate_naming_the_rank_and_the_expert_group(
    ep_run, tmp_path, monkeypatch
):
    real = autograd_collectives.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        # rank 1 routed no token to its peer (rank 0) and leaves the exchange out instead of sending zero rows
        if dist.get_rank() == 1:
            return output
        return real(output, input, output_split_sizes, input_split_sizes, group)

    monkeypatch.setattr(autograd_collectives, "all_to_all_single", all_to_all_single)
    report, check = gate_divergence(ep_run, tmp_path / "gate")
    d = report["collectives"]["divergence"]
    assert d["rank"] == 1 and d["group"] == f"{EXPERT_DIM} (ranks 0, 1)", d
    assert d["rank0"].startswith("c10d.alltoall_base_(float32") and d["rank0"].endswith(f"{EXPERT_DIM} (ranks 0, 1)")
    assert check["detail"].startswith("rank 1 diverges from rank 0 at "), check["detail"]
    assert f" in its group {EXPERT_DIM} (ranks 0, 1): rank 0 issues c10d.alltoall_base_(" in check["detail"]


@pytest.mark.slow
def test_an_expert_gradient_reduced_only_by_ranks_its_tokens_reached_fails_the_gate_naming_the_rank_and_group(
    ep_run, tmp_path, monkeypatch
):
    """Without the two constructions that give every rank a gradient of every expert parameter (FSDP2 reduce-
    scattering unused parameters, train/moe.py; the dispatch's empty product tying the experts' parameters to an
    empty batch, train/expert_parallel.py), rank 0 with no token reaching its experts skips their reduce-scatter
    over the ranks holding the same experts. The all-to-alls stay: the received rows stay in the graph."""
    monkeypatch.setattr(moe, "reduce_every_parameter", lambda model: False)
    monkeypatch.setattr(ExpertDispatch, "_empty_product", lambda self, received: received * 0)
    report, check = gate_divergence(ep_run, tmp_path / "gate")
    d = report["collectives"]["moe"]["divergence"]
    assert report["collectives"]["moe"]["starved_rank"] == 0
    assert d["routed"].startswith("c10d._reduce_scatter_base_"), d
    assert d["routed"].endswith(f"on group {EXPERT_SHARD_DIM} (ranks 0, 2)"), d
    assert "with no token reaching any expert, rank 0 issues " in check["detail"], check["detail"]
    assert "with its tokens routed it issues c10d._reduce_scatter_base_(" in check["detail"]
    assert f"on group {EXPERT_SHARD_DIM} (ranks 0, 2)" in check["detail"]

"""The collective proof under expert parallelism (parallel.expert 2, 4 ranks, Qwen3-MoE with 4 experts): the dry run
builds the EP mesh on the fake process group and records the counts exchange and the token all-to-alls on the
expert group, and the experts' gradient reduce-scatters on the ranks holding the same experts.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CADENCE, make_run
from support.models import moe_config
from wattgate.config import run_config
from wattgate.proof.prove import prove_collectives
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


def sequence(report: dict) -> list[str]:
    return [s for c in report["classes"] for s in c["sequence"]]


@pytest.mark.slow
def test_the_proof_records_the_counts_exchange_and_the_all_to_alls_on_the_expert_group(ep_run):
    report = prove_collectives(ep_run[2], ep_run[0], ep_run[1]).to_json()
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

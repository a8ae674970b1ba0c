"""The collective proof runs torch.distributed.checkpoint's save and load for real on the fake process group, through
storage that keeps no bytes, and dry-runs a resume: DCP's own collectives are recorded as it issues them.

Negative controls change torch (never src/) so that rank 1 alone issues a barrier inside DCP's save, or inside DCP's
load on resume: the gate must fail and name rank 1."""

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from wattgate.gate.run import run_gate
from wattgate.proof.prove import prove_collectives

DCP_SAVE = [  # DCP's planning exchange, its write exchange (torch/distributed/checkpoint/utils.py _DistWrapper)
    "gather_object(dst 0) on group 0",
    "scatter_object_list(src 0) on group 0",
    "gather_object(dst 0) on group 0",
    "broadcast_object_list(1 objects, src 0) on group 0",
]
DCP_LOAD = [
    "gather_object(dst 0) on group 0",
    "scatter_object_list(src 0) on group 0",
    "all_gather_object(2 objects) on group 0",
]


def contains(sequence: list[str], part: list[str]) -> bool:
    return any(sequence[i : i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_dcp_save_and_load_are_recorded_as_they_run_and_a_resume_is_proved(proof_run):
    pretokenized, plan, config = proof_run
    report = prove_collectives(config, pretokenized, plan).to_json()
    assert report["passed"], report["detail"]
    saving = [c for c in report["classes"] if "checkpoint" in c["class"]]
    assert saving and all(contains(c["sequence"], DCP_SAVE) for c in saving)
    assert not any("dcp.save" in s for c in report["classes"] for s in c["sequence"])  # nothing stands in for it
    resume = report["resume"]
    assert resume["step"] == report["class_runs"][-1][1]  # the newest checkpoint: the last step's
    assert resume["collectives"] >= len(DCP_LOAD) + 2 and "a resume" in report["detail"]


def gate_fails_naming_rank_1(proof_run, out) -> dict:
    pretokenized, plan, config = proof_run
    report = run_gate(config, pretokenized, plan, out).to_json()
    check = next(c for c in report["checks"] if c["name"] == "collectives")
    assert not check["passed"] and not report["passed"] and not (out / "PASSED").exists()
    assert check["detail"].startswith("rank 1 diverges from rank 0 at "), check["detail"]
    d = report["collectives"]["divergence"]
    assert d["rank"] == 1 and d["this_rank"] == "barrier() on group 0"
    return d


def test_a_barrier_rank_1_alone_issues_inside_dcp_save_fails_the_gate_naming_rank_1(proof_run, tmp_path, monkeypatch):
    real = dcp.save

    def save(*args, **kwargs):
        if dist.get_rank() == 1:
            dist.barrier()
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save)
    d = gate_fails_naming_rank_1(proof_run, tmp_path / "gate")
    assert "checkpoint" in d["phase"] and d["rank0"] == DCP_SAVE[0]  # rank 0 went on into DCP's planning exchange


def test_a_barrier_rank_1_alone_issues_between_dcp_saves_own_collectives_is_caught(proof_run, monkeypatch):
    """Inside DCP's save proper: after its plan is scattered, before the write results are gathered."""
    real = DefaultSavePlanner.finish_plan

    def finish_plan(self, new_plan):
        if dist.get_rank() == 1:
            dist.barrier()
        return real(self, new_plan)

    monkeypatch.setattr(DefaultSavePlanner, "finish_plan", finish_plan)
    pretokenized, plan, config = proof_run
    report = prove_collectives(config, pretokenized, plan).to_json()
    d = report["divergence"]
    assert not report["passed"] and d["rank"] == 1 and d["this_rank"] == "barrier() on group 0"
    ckpt = next(c for c in report["classes"] if c["class"] == d["phase"])
    assert ckpt["sequence"][d["index"] - 2 : d["index"] + 1] == DCP_SAVE[:3]  # rank 0: DCP's write gather there


def test_a_barrier_rank_1_alone_issues_inside_dcp_load_on_resume_fails_the_gate_naming_rank_1(
    proof_run, tmp_path, monkeypatch
):
    real = dcp.load

    def load(*args, **kwargs):
        if dist.get_rank() == 1:
            dist.barrier()
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", load)
    d = gate_fails_naming_rank_1(proof_run, tmp_path / "gate")
    assert d["phase"] == "resume" and d["rank0"] == DCP_LOAD[0]
    gate_md = (tmp_path / "gate" / "gate.md").read_text()
    assert "rank 1 diverges from rank 0 at resume, collective #" in gate_md
    assert "collectives, fingerprint `" in gate_md.split("\nresume: ", 1)[1].split("(resume from checkpoint step")[0]


def test_a_barrier_rank_1_alone_issues_between_dcp_loads_own_collectives_is_caught(proof_run, monkeypatch):
    """Inside DCP's load proper: after its plan is scattered, before the reads are all-gathered."""
    real = DefaultLoadPlanner.finish_plan

    def finish_plan(self, new_plan):
        if dist.get_rank() == 1:
            dist.barrier()
        return real(self, new_plan)

    monkeypatch.setattr(DefaultLoadPlanner, "finish_plan", finish_plan)
    pretokenized, plan, config = proof_run
    report = prove_collectives(config, pretokenized, plan).to_json()
    d = report["divergence"]
    assert not report["passed"] and d["rank"] == 1 and d["phase"] == "resume"
    assert d["rank0"] == DCP_LOAD[2] and d["this_rank"] == "barrier() on group 0"

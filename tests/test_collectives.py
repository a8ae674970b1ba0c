"""The collective proof (issue 24): the trainer dry-run on the fake process group for every rank, one step of
each class. Negative controls patch the trainer (nothing in src/) and must each be caught and named."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from wattgate.gate.run import run_gate
from wattgate.proof.classes import class_divergence, classes_by_rank, first_steps
from wattgate.proof.dryrun import dry_run_rank
from wattgate.proof.prove import prove_collectives
from wattgate.records.gate import Collectives
from wattgate.run_files import read_plan
from wattgate.train import loop
from wattgate.train.rank_inputs import Paths
from wattgate.train.model import build_meta_model

from conftest import CADENCE, config_for, make_run, with_micro_batches_changed


@pytest.fixture(scope="module")
def clean(proof_run):
    pretokenized, plan, config = proof_run
    return prove_collectives(config, pretokenized, plan).to_json()


def test_step_classes_come_from_the_plan_and_cover_every_kind(proof_run):
    _, plan_dir, config = proof_run
    plan, _ = read_plan(plan_dir)
    classes = classes_by_rank(plan, plan_dir, config.train)
    total = plan.steps_per_epoch
    assert len(classes) == 2 and classes[0] == classes[1] and len(classes[0]) == total > 10
    labels = [c.label for c in classes[0]]
    assert labels[:2] == ["1 micro-batch + log", "1 micro-batch"]
    assert labels[4].startswith("1 micro-batch + validation (") and labels[4].endswith(" + checkpoint")
    assert labels[-1].endswith("checkpoint + epoch end + last") and "log + validation" in labels[-1]
    steps = first_steps(classes)
    assert steps == [0, 1, 4, total - 1] and len(steps) == len(set(classes[0]))
    assert class_divergence(classes) is None


def test_the_clean_plan_is_proved_with_a_fingerprint_per_class(clean):
    assert clean["passed"], clean["detail"]
    assert clean["divergence"] is None and clean["class_divergence"] is None
    kinds = {c["class"]: c for c in clean["classes"]}
    assert sum(c["steps"] for c in clean["classes"]) == len(clean["steps_run"]) + sum(
        c["steps"] - 1 for c in clean["classes"]
    )
    plain = kinds["1 micro-batch"]
    ckpt = next(c for name, c in kinds.items() if "validation" in name and "last" not in name)
    # a step: loss-token all-reduce, 2 x (root + 2 layers) forward all-gathers and 2 x 3 backward ones ... ;
    # a validation pass and a checkpoint add collectives, and each class has its own fingerprint
    assert ckpt["collectives"] > plain["collectives"] >= 10 and ckpt["fingerprint"] != plain["fingerprint"]
    # the training data check's gather, the sequence guard's two all-reduces, rank 0's resume choice
    assert clean["startup"]["collectives"] == 4
    assert clean["end"]["collectives"] > 0 and clean["elapsed_s"] > 0
    assert clean["depth"]["identical"] and clean["proxy_layers"] == 2


def patched(monkeypatch, name, make):
    """Trainer.<name> replaced by make(original): the dry run runs the Trainer itself, so it runs the change."""
    original = getattr(loop.Trainer, name)
    monkeypatch.setattr(loop.Trainer, name, make(original))


def caught(proof_run, expect_rank=1):
    pretokenized, plan, config = proof_run
    report = prove_collectives(config, pretokenized, plan).to_json()
    d = report["divergence"]
    assert not report["passed"] and d is not None, report["detail"]
    assert d["rank"] == expect_rank and d["rank0"] != d["this_rank"]
    assert (
        f"rank {expect_rank} diverges from rank 0" in report["detail"]
        and f"collective #{d['index'] + 1}" in report["detail"]
    )
    return report, d


def test_a_rank_0_only_all_reduce_on_log_steps_is_caught(proof_run, monkeypatch):
    def make(original):
        def run_step(self, g, prefetch):
            original(self, g, prefetch)
            if self.rank == 0 and self.actions(g).log:
                dist.all_reduce(torch.zeros(1))

        return run_step

    patched(monkeypatch, "run_step", make)
    _, d = caught(proof_run)
    assert "log" in d["phase"] and d["step"] == 1
    assert "allreduce_(float32[1], sum)" in d["rank0"]


def test_a_barrier_only_on_rank_0_at_a_checkpoint_is_caught(proof_run, monkeypatch):
    def make(original):
        def save(self, step, epoch, eval_loss):
            if self.rank == 0:
                dist.barrier()
            original(self, step, epoch, eval_loss)

        return save

    patched(monkeypatch, "save", make)
    _, d = caught(proof_run)
    assert "checkpoint" in d["phase"] and d["step"] == 5 and d["rank0"].startswith("barrier()")


def test_an_extra_all_gather_on_one_rank_during_validation_is_caught(proof_run, monkeypatch):
    def make(original):
        def evaluate(self, step, epoch):
            if self.rank == 1:
                dist.all_gather([torch.zeros(3) for _ in range(self.world)], torch.zeros(3))
            return original(self, step, epoch)

        return evaluate

    patched(monkeypatch, "evaluate", make)
    _, d = caught(proof_run)
    assert "validation" in d["phase"] and d["step"] == 5 and "allgather_(float32[3]" in d["this_rank"]


def test_one_rank_skipping_clip_grad_norm_is_caught(proof_run, monkeypatch):
    real = torch.nn.utils.clip_grad_norm_

    def clip(parameters, max_norm, *args, **kwargs):
        if dist.get_rank() == 1:
            return torch.zeros(())  # skipped: no norm reduction on this rank
        return real(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    _, d = caught(proof_run)
    assert d["step"] == 1 and "all_reduce" in d["rank0"] and "all_reduce" not in d["this_rank"]


def test_an_object_collective_only_on_rank_0_is_caught(proof_run, monkeypatch):
    def make(original):
        def export(self):
            if self.rank == 0:
                dist.broadcast_object_list([self.total], src=0)
            original(self)

        return export

    patched(monkeypatch, "export", make)
    _, d = caught(proof_run)
    assert d["phase"] == "export and summary" and d["step"] is None
    assert d["rank0"].startswith("broadcast_object_list(1 objects, src 0)")


def test_one_more_micro_batch_on_one_rank_in_one_step_is_caught_at_the_collective_level(proof_run, tmp_path):
    pretokenized, plan, config = proof_run
    uneven = tmp_path / "plan"
    shutil.copytree(plan, uneven)
    with_micro_batches_changed(uneven, rank=1, step=2, more=True)
    report = prove_collectives(config, pretokenized, uneven).to_json()
    assert not report["passed"]
    assert report["class_divergence"]["rank"] == 1 and report["class_divergence"]["step"] == 3
    assert report["class_divergence"]["class"] == "2 micro-batches"
    d = report["divergence"]  # the extra micro-batch's forward all-gathers where rank 0 goes on to the backward
    assert d["rank"] == 1 and d["step"] == 3 and d["rank0"] != d["this_rank"]
    assert "rank 1 diverges from rank 0 at step 3 (class 2 micro-batches)" in report["detail"]  # rank 1's class


@pytest.mark.slow
def test_the_gate_runs_the_proof_as_its_collectives_check(proof_run, tmp_path, monkeypatch):
    pretokenized, plan, config = proof_run
    report = run_gate(config, pretokenized, plan, tmp_path / "gate").to_json()
    check = next(c for c in report["checks"] if c["name"] == "collectives")
    assert check["passed"], check["detail"]
    on_disk = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert on_disk["collectives"]["classes"] and on_disk["collectives"]["elapsed_s"] > 0
    assert "## Collectives (dry run on the fake process group)" in (tmp_path / "gate" / "gate.md").read_text()

    def make(original):
        def save(self, step, epoch, eval_loss):
            if self.rank == 0:
                dist.barrier()
            original(self, step, epoch, eval_loss)

        return save

    patched(monkeypatch, "save", make)
    failed = run_gate(config, pretokenized, plan, tmp_path / "gate2").to_json()
    assert not failed["passed"] and not (tmp_path / "gate2" / "PASSED").exists()
    check = next(c for c in failed["checks"] if c["name"] == "collectives")
    assert not check["passed"] and "rank 1 diverges" in check["detail"]


def test_collectives_scale_by_depth_exactly_as_a_full_depth_dry_run_counts_them(tmp_path):
    """Four identical layers: every rank runs one, rank 0 also two; the scaled count of each class equals what
    rank 0 issues when it is dry-run at the real depth."""
    lengths = np.random.default_rng(5).integers(5, 60, 60).tolist()
    plan, config = make_run(tmp_path, lengths, gpus=2, validation_fraction=0.1, **CADENCE)
    config = config.replace(model=config.model.replace(config=dict(config.model.config, num_hidden_layers=4)))
    report = prove_collectives(config, tmp_path / "pretokenized", plan).to_json()
    assert report["passed"], report["detail"]
    params = report["depth"].pop("params")  # the real-depth model counted
    assert params["total"] == sum(p.numel() for p in build_meta_model(config.model, "sdpa").parameters())
    assert report["proxy_layers"] == 1 and report["depth"] == {
        "identical": True,
        "layers": 4,
        "period": 1,
        "pattern": ["Qwen3DecoderLayer/full_attention"],
        "moe": None,
        "model": "model.config (qwen3)",
        "why": "4 identical Qwen3DecoderLayer/full_attention layers",
        "head": 0,
    }
    steps = [c["first_step"] - 1 for c in report["classes"]]
    full = dry_run_rank(config, Paths(tmp_path / "pretokenized", plan, tmp_path / "full"), 0, steps, 4)
    for c in report["classes"]:
        assert c["collectives_at_depth"] == len(full.steps[c["first_step"] - 1]) > c["collectives"], c


def test_a_continued_plan_is_proved_from_its_first_step(tmp_path):
    """A plan continuing a 4-rank run on 3 ranks (pack/segments.py) starts at its segment's first step: before,
    the dry run found no checkpoint there and the trainer refused to start ('checkpoint step 0 is before...')."""
    from wattgate.identity import run_identity
    from wattgate.pack.plan import build_plan
    from wattgate.data.synthetic import write_random_pretokenized

    pretok = write_random_pretokenized(tmp_path / "pretokenized", np.random.default_rng(5).integers(8, 60, 97), 96)
    plan = build_plan(config_for(4), pretok, tmp_path / "plan")
    folder = tmp_path / "train" / "t" / "checkpoints" / "step-2"
    folder.mkdir(parents=True)
    position = {"epoch": 0, "step": 2, "plan": plan.packs_sha256}
    identity = run_identity(config_for(4), tmp_path / "plan", pretok)
    (folder / "state.json").write_text(
        json.dumps(
            {"step": 2, "position": position, "files": {}, "hash_algorithm": "xxh3_128", "identity": identity.to_json()}
        )
    )
    continued = build_plan(config_for(3), pretok, tmp_path / "plan")
    first = continued.first_step
    report = prove_collectives(config_for(3), pretok, tmp_path / "plan").to_json()
    assert report["passed"], report["detail"]
    assert report["world_size"] == 3 and report["steps_run"][0] == first + 1 == 3


def test_the_hang_hint_names_a_ranks_step_class_and_the_collective_expected_next(clean):
    from wattgate.collective_hints import hang_hint
    from wattgate.records.heartbeat import Beat

    def beat(rank, step, phase, micro=None):
        return Beat(rank=rank, step=step, phase=phase, time=0.0, micro=micro)

    proof = Collectives.from_json(clean)
    first = hang_hint(proof, 1, beat(1, 0, "train", micro=1))
    assert first.startswith("rank 1: step 1 (class 1 micro-batch + log), train micro-batch 1: the proof expects ")
    assert "collective #2 of the step, c10d._allgather_base_(" in first  # after the loss-token all-reduce
    ckpt = hang_hint(proof, 0, beat(0, 5, "checkpoint"))
    # a checkpoint starts with the all-ranks check that the weights are finite (train/loop.py check_finite_weights)
    assert "step 5 (class 1 micro-batch + validation (" in ckpt
    assert ", c10d.allreduce_(float32[1], min) on group 0, or a later one" in ckpt
    evaluating = hang_hint(proof, 1, beat(1, 5, "eval", micro=1))
    assert "eval micro-batch 1" in evaluating and "_allgather_base_" in evaluating
    assert hang_hint(proof, 1, beat(1, 999, "train")) is None and hang_hint(None, 0, beat(0, 0, "train")) is None


def test_object_collectives_are_recorded_with_torchs_own_keyword_arguments():
    """torch.distributed.checkpoint calls scatter_object_list by keyword: the wrapper must take torch's names."""
    from datetime import timedelta

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from wattgate.proof.record import CollectiveRecorder, object_collectives

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        recorder = CollectiveRecorder()
        with object_collectives(recorder):
            out = [None]
            dist.scatter_object_list(scatter_object_output_list=out, scatter_object_input_list=["a", "b"], src=0)
            dist.barrier(timeout=timedelta(seconds=5))
            gathered = [None, None]
            dist.all_gather_object(gathered, {"x": 1})
        assert out == ["b"] and gathered == [{"x": 1}, {"x": 1}]
        assert [str(c) for c in recorder.collectives] == [
            "scatter_object_list(src 0) on group 0",
            "barrier() on group 0",
            "all_gather_object(2 objects) on group 0",
        ]
    finally:
        dist.destroy_process_group()


def test_the_watchers_verdict_names_the_collective_the_proof_expected_next(clean):
    from wattgate.records.heartbeat import Beat
    from wattgate.records.watcher import Verdict
    from wattgate.telemetry.watch_verdicts import with_expected_collectives

    beats = {
        0: Beat(rank=0, step=5, phase="checkpoint", time=0.0),
        1: Beat(rank=1, step=5, phase="eval", micro=1, time=0.0),
    }
    at = {"stalled_for_s": 60.0, "limit_s": 60.0, "limit_phase": "train"}
    verdict = Verdict(verdict="deadlock", reason="deadlock: no rank advanced", behind=(1,), stuck_ranks=(), **at)
    out = with_expected_collectives(verdict, beats, Collectives.from_json(clean))
    assert set(out.expected) == {"0", "1"} and "eval micro-batch 1" in out.expected["1"]
    assert out.reason.startswith("deadlock: no rank advanced; rank 1: step 5 (")  # the rank behind is named
    assert with_expected_collectives(verdict, beats, None) == verdict

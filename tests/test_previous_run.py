"""One run per run folder: a launch under another run identity moves the earlier run's records aside whole; the
same identity, or a run continued on another world size, keeps them."""

import json

import pytest

from wattgate.errors import InputError

from wattgate.records.checkpoint import ModelIdentity, PlanLink, RunIdentity
from wattgate.run_files import LAUNCH_LOCK, RUN_IDENTITY, claim_output
from wattgate.train.previous_run import earlier_run_differences, record_run_identity, set_aside_earlier_run

TRAIN = {"lr": 3e-4, "seq_len": 256}
IDENTITY = RunIdentity(plan="p1", pretokenized="d1", model=ModelIdentity(config="c", weights="init"), train=TRAIN)


def finished_run(tmp_path):
    run = claim_output(tmp_path / "results" / "train" / "demo", "train")
    for name in ("TRAINED", "metrics.parquet", "watcher.json", "train.log", "train.attempts.log", LAUNCH_LOCK):
        (run / name).write_text(name)
    for folder in ("heartbeat", "telemetry", "checkpoints/step-4", "final"):
        (run / folder).mkdir(parents=True)
        (run / folder / "x").write_text("x")
    (run / ".spare-attempt-outcome.json").write_text(" " * 16)
    record_run_identity(run, IDENTITY, "packs-1")
    return run


def test_a_changed_learning_rate_moves_the_earlier_run_aside_whole(tmp_path):
    run = finished_run(tmp_path)
    changed = IDENTITY.replace(train={**TRAIN, "lr": 1e-4})
    line = set_aside_earlier_run(run, changed)
    [previous] = [p for p in run.parent.iterdir() if p.name.startswith("demo.previous-")]
    assert line.startswith(f"launch: {run} held a run of another configuration (it differs in train.lr")
    assert str(previous) in line and line.endswith("this is a new run")
    # the new run starts from a folder holding only this attempt's lock and hidden files
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [".wattgate-output", ".spare-attempt-outcome.json", LAUNCH_LOCK]
    )
    moved = sorted(p.name for p in previous.iterdir())
    assert moved == sorted(
        [
            "TRAINED",
            "metrics.parquet",
            "watcher.json",
            "train.log",
            "train.attempts.log",
            "heartbeat",
            "telemetry",
            "checkpoints",
            "final",
            RUN_IDENTITY,
        ]
    )
    assert (previous / "checkpoints" / "step-4" / "x").read_text() == "x"


def test_the_same_identity_or_a_run_continued_on_another_world_size_stays(tmp_path):
    run = finished_run(tmp_path)
    before = sorted(p.name for p in run.iterdir())
    assert set_aside_earlier_run(run, IDENTITY) is None
    continued = IDENTITY.replace(plan="p2", links=(PlanLink(packs_sha256="packs-1", end_step=40),))
    assert earlier_run_differences(run, continued) == []
    assert set_aside_earlier_run(run, continued) is None
    assert sorted(p.name for p in run.iterdir()) == before
    other_plan = IDENTITY.replace(plan="p3")  # not a continuation: a new run
    assert earlier_run_differences(run, other_plan) == ["plan"]


def test_a_folder_without_a_recorded_identity_or_a_checkpoint_state_is_left_as_it_is(tmp_path):
    run = finished_run(tmp_path)
    (run / RUN_IDENTITY).unlink()
    assert set_aside_earlier_run(run, IDENTITY.replace(plan="p9")) is None
    (run / RUN_IDENTITY).write_text("[1, 2]")
    with pytest.raises(InputError, match=r"run-identity.json: not a JSON object"):
        set_aside_earlier_run(run, IDENTITY)
    assert json.loads((run / RUN_IDENTITY).read_text()) == [1, 2]


def test_a_folder_from_before_the_identity_file_is_judged_by_its_newest_checkpoint(tmp_path):
    """A run trained before launch recorded run-identity.json: its newest checkpoint's state.json says what it
    computed, so another corpus or plan still moves the whole earlier run aside, not only its checkpoints."""
    run = finished_run(tmp_path)
    (run / RUN_IDENTITY).unlink()
    state = {
        "step": 4,
        "position": {"step": 4, "plan": "packs-1"},
        "files": {},
        "hash_algorithm": "xxh3_128",
        "identity": IDENTITY.to_json(),
    }
    (run / "checkpoints" / "step-4" / "state.json").write_text(json.dumps(state))
    assert earlier_run_differences(run, IDENTITY) == []
    line = set_aside_earlier_run(run, IDENTITY.replace(pretokenized="d2"))
    assert line is not None and "it differs in pretokenized" in line
    assert not (run / "metrics.parquet").exists() and not (run / "checkpoints").exists()

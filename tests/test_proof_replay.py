"""The dry run replays what a rank already ran (issue 31, item 6): a train step's body with the same micro-batch
shapes, and a validation pass, run once per rank with the Trainer's own code and are replayed afterwards. The
replayed record must be exactly what running every one of them records: collectives, heartbeats and classes."""

import dataclasses

import pytest

from wattgate.proof.classes import classes_by_rank, first_steps
from wattgate.proof.dryrun import dry_run_rank
from wattgate.run_files import read_plan
from wattgate.train import loop
from wattgate.train.settings import TrainSettings

from test_collectives import run  # noqa: F401 - the proof tests' plan (a fixture)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_replayed_dry_run_records_what_running_every_step_records(run, tmp_path, rank):  # noqa: F811
    pretokenized, plan_dir, config = run
    plan, _ = read_plan(plan_dir)
    steps = first_steps(classes_by_rank(plan, plan_dir, TrainSettings.from_config(config)))
    records = [
        dry_run_rank(config, loop.Paths(pretokenized, plan_dir, tmp_path / str(replay)), rank, steps, 2, replay)
        for replay in (False, True)
    ]
    ran, replayed = (dataclasses.asdict(r) for r in records)
    assert ran == replayed
    assert len(steps) >= 4 and all(ran["steps"][g] for g in steps) and ran["stop"]

"""Resizing: refuse before launch, never after (issue 25, section 2).

A run on 4 ranks with a checkpoint (state.json as train writes it, with the run identity), then pack for
another world size. No training here: the checkpoint's folder holds only its state.json, which is what
pack reads (pack/segments.py); what train would then do follows from the plan pack wrote.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan
from wattgate.pack.segments import newest_checkpoint
from wattgate.train.checkpoint import is_complete, set_aside_mismatched
from wattgate.identity import run_identity

from conftest import config_for


@pytest.fixture
def run4(tmp_path):
    """results/{pretokenized,plan} of a 4-rank run and a function writing its checkpoint at a step."""
    pretok = write_random_pretokenized(tmp_path / "pretokenized", np.random.default_rng(3).integers(8, 60, 101), 96, 0)
    plan_dir = tmp_path / "plan"
    config = config_for(4)
    plan = build_plan(config, pretok, plan_dir)

    def checkpoint(step: int, config=config, state=None) -> Path:
        folder = tmp_path / "train" / "t" / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        identity = run_identity(config, plan_dir, pretok)
        body = {
            "step": step,
            "position": {"epoch": 0, "step": step, "plan": plan.packs_sha256},
            "files": {},
            "hash_algorithm": "xxh3_128",
        }
        (folder / "state.json").write_text(
            json.dumps(state if state is not None else body | {"identity": identity.to_json()})
        )
        return folder

    return {"pretok": pretok, "plan_dir": plan_dir, "plan": plan, "config": config, "checkpoint": checkpoint}


def test_a_plain_resize_still_continues(run4):
    run4["checkpoint"](3)
    plan = build_plan(config_for(2), run4["pretok"], run4["plan_dir"])
    assert [s.world_size for s in plan.segments] == [4, 2] and plan.resumed_from.step == 3


@pytest.mark.parametrize("changed", [{"lr": 2e-2}, {"grad_accum": 4}])
def test_resize_with_a_changed_result_key_starts_over_naming_the_key(run4, capsys, changed):
    """Before: pack continued, the gate passed, and train set the checkpoints aside and died with
    'checkpoint step 0 is before step 3', on every rerun."""
    folder = run4["checkpoint"](3)
    config = config_for(2, **changed)
    plan = build_plan(config, run4["pretok"], run4["plan_dir"])
    key, value = next(iter(changed.items()))
    before = getattr(run4["config"].train, key)
    out = capsys.readouterr().out
    assert f"the run identity of checkpoint step 3 differs in train.{key} ({before!r} -> {value!r})" in out
    assert "the new plan starts over" in out
    assert plan.segments is None and plan.world_size == 2  # train starts at step 0: nothing to be before
    # ...and train, finding checkpoints of another identity, sets them aside rather than resuming them
    identity = run_identity(config, run4["plan_dir"], run4["pretok"])
    assert set_aside_mismatched(folder.parent, identity) is not None


def test_a_finished_run_resized_says_it_is_complete(run4):
    last = run4["plan"].steps_per_epoch * run4["plan"].epochs
    run4["checkpoint"](last)
    with pytest.raises(InputError, match=f"the run is complete \\(checkpoint step {last} is its last step\\)"):
        build_plan(config_for(2), run4["pretok"], run4["plan_dir"])  # an IndexError in segments.py before


def test_drop_with_a_resize_keeps_every_document_and_passes_conservation(tmp_path):
    pretok = write_random_pretokenized(tmp_path / "pretokenized", np.random.default_rng(5).integers(8, 60, 97), 96, 0)
    plan_dir = tmp_path / "plan"
    config = config_for(4, remainder="drop")
    plan = build_plan(config, pretok, plan_dir)
    assert plan.stats.dropped_doc_ids  # the drop policy dropped its remainder
    folder = tmp_path / "train" / "t" / "checkpoints" / "step-2"
    folder.mkdir(parents=True)
    position = {"epoch": 0, "step": 2, "plan": plan.packs_sha256}
    state = {
        "step": 2,
        "position": position,
        "files": {},
        "hash_algorithm": "xxh3_128",
        "identity": run_identity(config, plan_dir, pretok).to_json(),
    }
    (folder / "state.json").write_text(json.dumps(state))
    config3 = config_for(3, remainder="drop")  # 8 packs per step do not divide over 3 ranks: the rest re-packed
    continued = build_plan(config3, pretok, plan_dir)
    assert "re-packed" in continued.resumed_from.change
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config3.to_json()))
    report = run_gate(config3, pretok, plan_dir, tmp_path / "gate").to_json()
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["conservation"]["passed"], checks["conservation"]["detail"]
    assert checks["equal_steps"]["passed"] and checks["segments"]["passed"]


def test_a_state_json_holding_an_array_is_skipped_not_a_crash(run4, capsys):
    folder = run4["checkpoint"](3, state=[1, 2, 3])
    assert newest_checkpoint(folder.parent) is None  # AttributeError before
    assert "is not a checkpoint state" in capsys.readouterr().out
    plan = build_plan(config_for(2), run4["pretok"], run4["plan_dir"])
    assert plan.segments is None  # nothing to continue from: a fresh plan
    ok, why = is_complete(folder)  # train skips it as well, with the reason
    assert not ok and "not a checkpoint state" in why


def test_4_2_3_segments_check_counts_the_prefix_over_every_segment(run4):
    """Step numbers restart in each segment's packs, so counting the prefix's (epoch, step) keys saw steps 0-5
    of segment 1 as the same steps as segment 0's: the guard 'the prefix is what ran' could not fire."""
    from wattgate.gate.schedule_checks import check_segments
    from wattgate.gate.inputs import concat_packs, consumed_rows, read_prefix
    from wattgate.run_files import read_packs

    pretok, plan_dir = run4["pretok"], run4["plan_dir"]
    run4["checkpoint"](3)
    config2 = config_for(2)
    plan2 = build_plan(config2, pretok, plan_dir)
    folder = plan_dir.parent / "train" / "t" / "checkpoints" / "step-9"
    folder.mkdir()
    position = {"epoch": 0, "step": 9, "plan": plan2.packs_sha256}
    identity = run_identity(config2, plan_dir, pretok)
    (folder / "state.json").write_text(
        json.dumps(
            {"step": 9, "position": position, "files": {}, "hash_algorithm": "xxh3_128", "identity": identity.to_json()}
        )
    )
    config3 = config_for(3)
    plan3 = build_plan(config3, pretok, plan_dir)
    segs = plan3.segments
    assert [s.world_size for s in segs] == [4, 2, 3] and [s.first_step for s in segs] == [0, 3, 9]
    packs = read_packs(plan_dir / "packs.parquet")
    prefix, problems = read_prefix(plan_dir, plan3)
    assert not problems and check_segments(plan3, run_config(config3), packs, prefix, ()).passed
    # segment 1's archive one step short of the 6 steps it claims to have run
    short = [consumed_rows(read_packs(plan_dir / s.packs), s.end_step - s.first_step) for s in segs[:-1]]
    short[1] = consumed_rows(read_packs(plan_dir / segs[1].packs), 5)
    check = check_segments(plan3, run_config(config3), packs, concat_packs(short), ())
    assert (
        not check.passed
        and "the consumed prefix holds 64 packs, but its segments ran 72 before the boundary at step 9" in check.detail
    )

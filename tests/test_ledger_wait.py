"""The time a run lost to waiting for stragglers (issue 34, item 5): the run's report writes it into the run's
throughput-ledger record, and a later run's gate, reading the ledger, says how much of the last run's time went
to waiting. The end-to-end path (a real slowed CPU rank, its report, the gate's line) is in
test_straggler_ranks.py."""

import json

import numpy as np
import pytest

from conftest import TINY_MODEL
from wattgate.config import run_config, world_size
from wattgate.errors import InputError
from wattgate.gate.cost import CostSection, cost_markdown, last_run_wait
from wattgate.ledger import MeasuredSteps, RunShape, StorageWrites, append_ledger, read_ledger, record_wait, run_record
from wattgate.records.ledger import LedgerLine
from wattgate.records.run_config import RunConfig
from wattgate.model_spec import load_model_spec


def config_for(tmp_path) -> RunConfig:
    return run_config(
        {
            "model": {"config": TINY_MODEL},
            "cluster": {"nodes": 1, "gpus_per_node": 4},
            "forecast": {"ledger": str(tmp_path / "throughput.jsonl")},
        }
    )


def record(
    config: RunConfig, run_name: str, steps: int = 40, job_s: float = 3600.0, shape: dict | None = None
) -> LedgerLine:
    """A finished run of the config's model on its world size: job_s seconds of wall time."""
    t = config.train
    return run_record(
        run_name=run_name,
        run=RunShape(
            shape=shape or load_model_spec(config).shape(),
            gpu_model=config.cluster.gpu_model,
            world_size=world_size(config),
            seq_len=t.seq_len,
            micro_batch_size=t.micro_batch_size,
            attn_weight=1e-5,
        ),
        steps=MeasuredSteps(costs=np.full(steps, 1000.0), times=[1.0] * steps, tokens=1000 * steps),
        writes=StorageWrites(checkpoints=0, checkpoint_s=0.0, checkpoint_bytes=0, export_s=0.0, export_bytes=0),
        startup_s=2.0,
        load_s=1.0,
        job_s=job_s,
    )


def test_the_waiting_goes_into_the_runs_newest_record_and_every_other_line_is_kept_byte_for_byte(tmp_path):
    config = config_for(tmp_path)
    ledger = tmp_path / "throughput.jsonl"
    for name in ("other", "demo", "demo", "later"):
        append_ledger(ledger, record(config, name))
    before = ledger.read_text().splitlines()
    rec = record_wait(ledger, "demo", 0.5, "power triage")
    after = ledger.read_text().splitlines()
    assert rec.wait_hours == 0.5 and rec.wait_source == "power triage"
    assert rec.wait_share == pytest.approx(0.5 / (4 * 3600.0 / 3600))  # of world_size x job_s
    assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [2]  # the newest "demo" only
    assert json.loads(after[2]) == rec.to_json() and read_ledger(ledger)[2] == rec  # valid, as the gate reads it
    assert json.loads(after[2]) == json.loads(before[2]) | {
        "wait_hours": 0.5,
        "wait_share": rec.wait_share,
        "wait_source": "power triage",
    }  # nothing else changed


def test_a_rerun_under_the_same_name_gets_the_record_of_its_own_steps(tmp_path):
    config = config_for(tmp_path)
    ledger = tmp_path / "throughput.jsonl"
    append_ledger(ledger, record(config, "demo", steps=40))
    append_ledger(ledger, record(config, "demo", steps=80))
    record_wait(ledger, "demo", 0.1, "power triage", steps=40)
    first, second = read_ledger(ledger)
    assert first.wait_hours == 0.1 and "wait_hours" not in second.to_json()


def test_a_run_the_ledger_does_not_hold_leaves_it_untouched(tmp_path):
    config = config_for(tmp_path)
    ledger = tmp_path / "throughput.jsonl"
    append_ledger(ledger, record(config, "demo"))
    text = ledger.read_bytes()
    assert record_wait(ledger, "elsewhere", 0.5, "power triage") is None
    assert ledger.read_bytes() == text


def test_waiting_no_run_can_have_is_refused_by_name(tmp_path):
    config = config_for(tmp_path)
    ledger = tmp_path / "throughput.jsonl"
    append_ledger(ledger, record(config, "demo"))
    with pytest.raises(InputError, match="wait_hours"):
        record_wait(ledger, "demo", -1.0, "power triage")
    with pytest.raises(InputError, match="not a throughput record"):  # a line the gate could not read either
        ledger.write_text(ledger.read_text() + '{"wait_share": 2}\n')
        record_wait(ledger, "demo", 0.5, "power triage")


def test_the_gate_says_how_much_of_the_last_runs_time_went_to_waiting(tmp_path):
    config = config_for(tmp_path)
    ledger = tmp_path / "throughput.jsonl"
    append_ledger(ledger, record(config, "other model", shape={"layers": 99}))  # not this model: not "the last run"
    append_ledger(ledger, record(config, "demo", job_s=1800.0))
    spec = load_model_spec(config)
    wait = last_run_wait(config, spec)
    assert wait.wait_hours is None and "not recorded" in wait.line

    record_wait(ledger, "demo", 0.25, "power triage")  # 0.25 GPU-hours of 4 GPUs x 0.5 h
    wait = last_run_wait(config, spec)
    assert (wait.run_name, wait.wait_share, wait.unit) == ("demo", 0.125, "GPU-hours")
    line = "Last run in the ledger ('demo', 4 x cpu): time lost to waiting for stragglers: 12.5% of its time, "
    assert wait.line == line + "0.25 GPU-hours (power triage)."
    md = cost_markdown(CostSection(forecast_unavailable="no plan", last_run_wait=wait))
    assert wait.line in md

    record_wait(ledger, "demo", 0.0, "watcher: rank CPU time")
    wait = last_run_wait(config, spec)
    assert wait.unit == "rank-hours" and "no time lost to waiting" in wait.line


def test_a_gate_with_no_earlier_run_of_its_model_says_nothing_of_waiting(tmp_path):
    config = config_for(tmp_path)
    assert last_run_wait(config, load_model_spec(config)) is None  # no ledger at all
    append_ledger(tmp_path / "throughput.jsonl", record(config, "other model", shape={"layers": 99}))
    assert last_run_wait(config, load_model_spec(config)) is None

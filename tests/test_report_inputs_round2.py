"""Report inputs, round two (issue 25, section 3): a metrics.parquet missing columns, or a bad heartbeat line or
file, does not stop the report: it draws what it can and names what is missing."""

import pyarrow.parquet as pq
import pytest
from real_traces import H200_DATA

from wattgate.report import run_report

TRAIN = H200_DATA / "train"


@pytest.fixture
def run(h200_run):
    return h200_run


def _page(out) -> str:
    return (out / "index.html").read_text()


def test_metrics_without_step_time_and_data_wait_still_give_a_report(run, tmp_path):
    table = pq.read_table(run / "metrics.parquet")
    pq.write_table(table.drop_columns(["step_time_s", "data_wait_s"]), run / "metrics.parquet")
    s = run_report(run, tmp_path / "report")
    assert s["tokens"] == int(table.column("tokens").to_numpy().sum())  # what the other columns give is there
    assert any("metrics.parquet: no column(s) step_time_s, data_wait_s" in n for n in s["notes"])
    assert "Phase breakdown" in _page(tmp_path / "report")


def test_metrics_without_a_required_column_are_left_out_and_named(run, tmp_path):
    table = pq.read_table(run / "metrics.parquet")
    pq.write_table(table.drop_columns(["time"]), run / "metrics.parquet")
    s = run_report(run, tmp_path / "report")
    assert any("metrics.parquet: no column(s) time: metrics not used" in n for n in s["notes"])
    assert s["energy"]["kwh"] is not None


def test_a_bad_heartbeat_line_is_skipped_and_named(run, tmp_path):
    events = run / "heartbeat" / "rank-0.events.jsonl"
    good = events.read_text()
    n = len(good.splitlines())
    events.write_text(good + '{"time": "soon", "rank": 0, "phase": "train"}\n[1]\n')
    s = run_report(run, tmp_path / "report")
    reference = run_report(TRAIN, tmp_path / "reference")
    note = f"rank-0.events.jsonl:{n + 1}: not a heartbeat event"
    assert any(note in x and "and 1 more line(s)" in x for x in s["notes"])
    assert s["phases"] == reference["phases"]  # the good lines still place the run's phases


def test_a_garbage_heartbeat_state_is_named_not_fatal(run, tmp_path):
    (run / "heartbeat" / "rank-0.json").write_text("\x00garbage")
    s = run_report(run, tmp_path / "report")
    assert any("rank-0.json: not a heartbeat" in n for n in s["notes"])

"""The report on damaged inputs: rows of metrics.parquet with an absurd step time or repeated, missing
metrics columns, bad heartbeat lines and files, a damaged gate.json and phase labels outside triage's set. It
draws what it can and names what it left out, or refuses in one line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from real_traces import H200_DATA

from wattgate.errors import InputError
from wattgate.power.triage import run_triage
from wattgate.report import ReportSources, run_report, summarize
from wattgate.trace import trace_files

from conftest import set_column

TRAIN = H200_DATA / "train"


@pytest.fixture
def run(h200_run):
    return h200_run


# ---------------------------------------------------------------- metrics rows


def test_report_leaves_out_an_absurd_step_time_and_names_it(run, tmp_path):
    times = pq.read_table(run / "metrics.parquet")["step_time_s"].to_numpy().copy()
    times[2] = 1e30
    set_column(run / "metrics.parquet", "step_time_s", times)
    s = run_report(run, tmp_path / "report").to_json()
    assert any("metrics.parquet: column step_time_s: 1 value(s)" in n for n in s["notes"])
    assert s["run"]["start_utc"] is not None and s["wall_s"] < 86400


def test_report_counts_a_repeated_step_and_rank_once_the_last_row(run):
    table = pq.read_table(run / "metrics.parquet")
    rewritten = table.set_column(
        table.schema.get_field_index("tokens"), "tokens", pa.array(table["tokens"].to_numpy() * 2)
    )
    pq.write_table(pa.concat_tables([table, rewritten]), run / "metrics.parquet")
    s = summarize(run).summary.to_json()
    assert s["tokens"] == 2 * int(table["tokens"].to_numpy().sum())  # the rewrite's rows, once
    assert any("repeat a (step, rank)" in n and "its last row" in n for n in s["notes"])


# ---------------------------------------------------------------- gate.json


def test_report_names_the_damaged_parts_of_gate_json(run, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "gate.json").write_text(json.dumps({"passed": "yes", "checks": "all", "forecast": {"wall_s": 10}}))
    s = run_report(run, tmp_path / "report", ReportSources(gate_dir=gate)).to_json()
    notes = [n for n in s["notes"] if "gate.json" in n]
    assert any("'checks' is 'all'" in n for n in notes) and any("throughput.source" in n for n in notes)
    assert any("'passed' is 'yes'" in n for n in notes)
    assert s["gate"]["passed"] is None and s["gate"]["checks"] == [] and s["forecast"] is None


# ---------------------------------------------------------------- phase labels


def test_report_refuses_phase_labels_outside_triages_set(run, tmp_path):
    power = tmp_path / "power"
    run_triage(trace_files(run / "telemetry"), power, run_dir=run)
    n = pq.read_table(power / "phases.parquet").num_rows
    set_column(power / "phases.parquet", "phase", ["Compute"] * n)
    with pytest.raises(InputError, match=rf"phases.parquet: column 'phase': label\(s\) 'Compute' \({n} window"):
        run_report(run, tmp_path / "report", ReportSources(power_dir=power))


# ---------------------------------------------------------------- missing metrics columns, bad heartbeats


def _page(out) -> str:
    return (out / "index.html").read_text()


def test_metrics_without_step_time_and_data_wait_still_give_a_report(run, tmp_path):
    table = pq.read_table(run / "metrics.parquet")
    pq.write_table(table.drop_columns(["step_time_s", "data_wait_s"]), run / "metrics.parquet")
    s = run_report(run, tmp_path / "report").to_json()
    assert s["tokens"] == int(table.column("tokens").to_numpy().sum())  # what the other columns give is there
    assert any("metrics.parquet: no column(s) step_time_s, data_wait_s" in n for n in s["notes"])
    assert "Phase breakdown" in _page(tmp_path / "report")


def test_metrics_without_a_required_column_are_left_out_and_named(run, tmp_path):
    table = pq.read_table(run / "metrics.parquet")
    pq.write_table(table.drop_columns(["time"]), run / "metrics.parquet")
    s = run_report(run, tmp_path / "report").to_json()
    assert any("metrics.parquet: no column(s) time: metrics not used" in n for n in s["notes"])
    assert s["energy"]["kwh"] is not None


def test_a_bad_heartbeat_line_is_skipped_and_named(run, tmp_path):
    events = run / "heartbeat" / "rank-0.events.jsonl"
    good = events.read_text()
    n = len(good.splitlines())
    events.write_text(good + '{"time": "soon", "rank": 0, "phase": "train"}\n[1]\n')
    s = run_report(run, tmp_path / "report").to_json()
    reference = run_report(TRAIN, tmp_path / "reference").to_json()
    note = f"rank-0.events.jsonl:{n + 1}: not a heartbeat event"
    assert any(note in x and "and 1 more line(s)" in x for x in s["notes"])
    assert s["phases"] == reference["phases"]  # the good lines still place the run's phases


def test_a_garbage_heartbeat_state_is_named_not_fatal(run, tmp_path):
    (run / "heartbeat" / "rank-0.json").write_text("\x00garbage")
    s = run_report(run, tmp_path / "report").to_json()
    assert any("rank-0.json: not a heartbeat" in n for n in s["notes"])

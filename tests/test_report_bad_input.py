"""Probe findings D8-D10, D16 (report, compare, watch, config validation): a mistyped or already judged
watch target, non-finite or overflowing config numbers, damaged metrics rows, a damaged gate.json or
forecast, a zero step time in compare, and phase labels outside triage's set."""

import json
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from real_traces import H200_DATA

from wattgate.config import load_config, validate_config
from wattgate.errors import InputError
from wattgate.experiments import compare
from wattgate.power.triage import run_triage
from wattgate.report import run_report, summarize
from wattgate.telemetry.watch import run_watch
from wattgate.trace import trace_files

TRAIN = H200_DATA / "train"


@pytest.fixture
def run(h200_run):
    return h200_run


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def watch_config() -> dict:
    return validate_config({"data": {"inputs": ["x.jsonl"]}, "watcher": {"poll_s": 0.05}})


def set_column(path, name, values) -> None:
    table = pq.read_table(path)
    i = table.schema.get_field_index(name)
    pq.write_table(table.set_column(i, name, pa.array(values, table.schema.field(name).type)), path)


# ---------------------------------------------------------------- D8: watch


def test_watch_refuses_a_run_folder_that_does_not_exist(tmp_path):
    missing = tmp_path / "no_such_rundir"
    with pytest.raises(InputError, match="no_such_rundir: no such run folder"):
        run_watch(watch_config(), missing, pid=dead_pid())
    assert not missing.exists()


def test_watch_does_not_replace_a_verdict_that_found_a_deadlock(run, tmp_path):
    record = json.loads((run / "watcher.json").read_text())
    record |= {"verdict": "deadlock", "reason": "deadlock: no rank advanced", "action": "kill"}
    (run / "watcher.json").write_text(json.dumps(record))
    before = (run / "watcher.json").read_bytes()
    with pytest.raises(InputError, match=r"verdict 'deadlock' \(the job was killed\).*--out elsewhere"):
        run_watch(watch_config(), run, pid=dead_pid())
    assert (run / "watcher.json").read_bytes() == before
    # elsewhere it may watch, and a quiet record of its own it replaces
    assert run_watch(watch_config(), run, pid=dead_pid(), out=tmp_path / "w.json")["verdict"] == "healthy"
    assert run_watch(watch_config(), run, pid=dead_pid(), out=tmp_path / "w.json")["verdict"] == "healthy"


# ---------------------------------------------------------------- D8: config numbers


@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("watcher: {hang_after_s: .nan}", "watcher.hang_after_s"),
        ("train: {lr: .inf}", "train.lr"),
        ("train: {betas: [0.9, .nan]}", "train.betas.1"),
        ("forecast: {assumed_mfu: .nan}", "forecast.assumed_mfu"),
    ],
)
def test_config_refuses_nan_and_infinity_naming_the_key(tmp_path, yaml_text, key):
    path = tmp_path / "c.yaml"
    path.write_text("data: {inputs: [x.jsonl]}\n" + yaml_text + "\n")
    with pytest.raises(InputError, match=rf"c.yaml: key '{key}': .* is not a finite number"):
        load_config(path)


def test_config_refuses_a_poll_period_that_would_overflow_the_wait(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {inputs: [x.jsonl]}\nwatcher: {poll_s: 1.0e+12}\n")
    with pytest.raises(InputError, match="key 'watcher.poll_s': .* greater than the maximum"):
        load_config(path)


# ---------------------------------------------------------------- D9: metrics rows


def test_report_leaves_out_an_absurd_step_time_and_names_it(run, tmp_path):
    times = pq.read_table(run / "metrics.parquet")["step_time_s"].to_numpy().copy()
    times[2] = 1e30
    set_column(run / "metrics.parquet", "step_time_s", times)
    s = run_report(run, tmp_path / "report")
    assert any("metrics.parquet: column step_time_s: 1 value(s)" in n for n in s["notes"])
    assert s["run"]["start_utc"] is not None and s["wall_s"] < 86400


def test_report_counts_a_repeated_step_and_rank_once_the_last_row(run):
    table = pq.read_table(run / "metrics.parquet")
    rewritten = table.set_column(
        table.schema.get_field_index("tokens"), "tokens", pa.array(table["tokens"].to_numpy() * 2)
    )
    pq.write_table(pa.concat_tables([table, rewritten]), run / "metrics.parquet")
    s = summarize(run).summary
    assert s["tokens"] == 2 * int(table["tokens"].to_numpy().sum())  # the rewrite's rows, once
    assert any("repeat a (step, rank)" in n and "its last row" in n for n in s["notes"])


# ---------------------------------------------------------------- D10: gate.json, compare


def test_report_names_the_damaged_parts_of_gate_json(run, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "gate.json").write_text(json.dumps({"passed": "yes", "checks": "all", "forecast": {"wall_s": 10}}))
    s = run_report(run, tmp_path / "report", gate_dir=gate)
    notes = [n for n in s["notes"] if "gate.json" in n]
    assert any("'checks' is 'all'" in n for n in notes) and any("throughput.source" in n for n in notes)
    assert any("'passed' is 'yes'" in n for n in notes)
    assert s["gate"]["passed"] is None and s["gate"]["checks"] == [] and s["forecast"] is None


def variant(tmp_path, name="shared"):
    folder = tmp_path / name
    shutil.copytree(TRAIN, folder / "train")
    shutil.copy(TRAIN / "config.yaml", folder / "config.yaml")
    return folder


def test_compare_refuses_a_forecast_without_throughput_naming_the_file(tmp_path):
    v = variant(tmp_path)
    (v / "gate").mkdir()
    (v / "gate" / "gate.json").write_text(json.dumps({"forecast": {"wall_s": 10}}))
    with pytest.raises(InputError, match=r"shared/gate/gate.json: forecast has no throughput.source"):
        compare("dataio", [v], tmp_path / "out")


def test_compare_leaves_out_a_step_of_zero_seconds(tmp_path):
    v = variant(tmp_path)
    times = pq.read_table(v / "train" / "metrics.parquet")["step_time_s"].to_numpy().copy()
    times[10] = 0.0
    set_column(v / "train" / "metrics.parquet", "step_time_s", times)
    notes = []
    table = compare("dataio", [v], tmp_path / "out", note=notes.append)
    assert np.isfinite(table["data_wait_share"].to_numpy(dtype=float)).all()
    assert "inf" not in (tmp_path / "out" / "table.csv").read_text()
    assert any("without a positive step_time_s left out" in n for n in notes)
    assert "without a positive step_time_s" in (tmp_path / "out" / "table.md").read_text()


def test_compare_names_the_variants_metrics_when_no_step_is_measured(tmp_path):
    v = variant(tmp_path)
    times = pq.read_table(v / "train" / "metrics.parquet")["step_time_s"].to_numpy()
    set_column(v / "train" / "metrics.parquet", "step_time_s", -np.abs(times))
    with pytest.raises(InputError, match=r"shared/train/metrics.parquet: no measured steps"):
        compare("dataio", [v], tmp_path / "out")


# ---------------------------------------------------------------- D16: phase labels


def test_report_refuses_phase_labels_outside_triages_set(run, tmp_path):
    power = tmp_path / "power"
    run_triage(trace_files(run / "telemetry"), power, run_dir=run)
    n = pq.read_table(power / "phases.parquet").num_rows
    set_column(power / "phases.parquet", "phase", ["Compute"] * n)
    with pytest.raises(InputError, match=rf"phases.parquet: column 'phase': label\(s\) 'Compute' \({n} window"):
        run_report(run, tmp_path / "report", power_dir=power)

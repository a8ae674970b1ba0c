"""Power triage on real H200 traces (tests/data/h200): regression tests for the rules and the tables.

calibration-trace: `wattgate calibrate`'s known phases, 15 s each (idle, compute, data starvation,
checkpoint, deadlock), with the phase that ran at every sample. train/: a real 106-step run of a
small model that is host-bound (~50% utilization, data wait < 1.5% of each step), with its
heartbeats and metrics. See wattgate.testing.trace_scoring for how windows are scored.
"""

import json

import pyarrow.parquet as pq
import pytest
from real_traces import H200_DATA

from wattgate.testing.trace_scoring import PUBLISHED_H200, calibration_agreement, train_agreement, train_parts
from wattgate.triage_tables import shipped_table
from wattgate.power.triage import load_run_info, run_triage, triage
from wattgate.trace import read_trace, trace_meta

TRAIN = H200_DATA / "train"
TABLES = {"calibrated": lambda: shipped_table("h200"), "published": lambda: PUBLISHED_H200}


@pytest.fixture(scope="module")
def calibration():
    return (
        read_trace(H200_DATA / "calibration-trace.parquet"),
        pq.read_table(H200_DATA / "calibration-trace.labels.parquet").to_pandas(),
    )


@pytest.fixture(scope="module")
def train():
    trace = read_trace(TRAIN / "telemetry" / "vm.parquet")
    return trace, load_run_info(TRAIN, [trace_meta(trace)])


def test_shipped_h200_table_is_the_calibrated_one():
    t = shipped_table("h200")
    assert t.provenance["kind"] == "calibrated" and t.phases
    # the real spinning hang and the idle GPU with a context both drew ~119 W: only utilization parts them
    for phase in ("deadlock", "checkpoint", "idle"):
        assert t.phases[phase]["power_w"]["p99"] < t.low_max_w


@pytest.mark.parametrize("which", TABLES)
def test_calibration_phases_agree_with_their_labels(calibration, which):
    """Every measured phase reads as itself in >= 90% of its windows (real: 100%, except deadlock on the
    calibrated table at 14/15: its second window still averages NVML's ramp to 100% utilization, 88%,
    under busy_util_pct 90). A checkpoint on one GPU with no heartbeats reads idle: the GPU sits at
    idle power while the host copies and writes (0-7% utilization) and no peer waits on it."""
    trace, labels = calibration
    agree = calibration_agreement(triage(trace, TABLES[which](), deadlock_after_s=10), labels)
    assert set(agree.index) == {"idle", "compute", "data_starvation", "checkpoint", "deadlock"}
    assert (agree["windows"] >= 12).all(), agree
    assert (agree["agree"] >= 0.9).all(), agree  # checkpoint: idle or checkpoint (trace_scoring.REAL_ACCEPT)


@pytest.mark.parametrize("which", TABLES)
def test_train_run_with_run_info(train, which):
    """Steps whose data wait is small are the step's own work: compute, though the GPU runs at ~50%
    utilization and 290-420 W (host-bound). Checkpoints are checkpoint, init and teardown idle."""
    trace, info = train
    phases = triage(trace, TABLES[which](), run_info=info)
    agree = train_agreement(phases, TRAIN)
    assert agree.loc["steps", "agree"] >= 0.9 and agree.loc["steps", "windows"] >= 25, agree
    for part in ("checkpoint", "init", "teardown"):
        assert agree.loc[part, "agree"] == 1.0, agree
    got = phases.column("phase").to_numpy(zero_copy_only=False)
    assert "deadlock" not in set(got) and "unknown" not in set(got)


@pytest.mark.parametrize("which", TABLES)
def test_train_run_power_only_has_no_deadlock(train, which):
    """Without metrics the host-bound steps read data_starvation (the module docstring says why);
    nothing may read as a hang, and the init before the first step stays idle."""
    trace, _ = train
    phases = triage(trace, TABLES[which]())
    got = phases.column("phase").to_numpy(zero_copy_only=False)
    assert "deadlock" not in set(got)
    assert (got[train_parts(phases, TRAIN)["init"]] == "idle").all()


def test_wattgate_triage_on_the_train_run(tmp_path):
    """The stage end to end: the table detected from the device name, the rank placed by its GPU UUID."""
    result = run_triage([TRAIN / "telemetry" / "vm.parquet"], tmp_path, run_dir=str(TRAIN)).to_json()
    assert result["table"]["gpu_model"] == "H200" and result["table_source"].startswith("detected")
    assert result["signals"] == {"power": True, "util": True, "heartbeats": True, "metrics": True}
    assert result["ranks"] == {"mapped": {"0": {"host": "vm", "gpu": 0}}, "unmapped": []}
    assert "deadlock" not in result["phases"]
    assert result["phases"]["compute"]["share"] > result["phases"].get("data_starvation", {}).get("share", 0.0)
    assert json.loads((tmp_path / "triage.json").read_text()) == result

"""Power-only mode: a trace with no heartbeats or metrics (an imported nvidia-smi log) through triage and report.

The hard case: rank 0 writes a checkpoint every ~2.5 min while the other 7 GPUs wait in a collective at
~100% utilization and near-idle power for 26-38 s, shorter than deadlock_after_s (60 s): checkpoint, not
deadlock and not communication. A wait that never ends is deadlock; a short sync wait stays communication.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from wattgate.cli import main
from wattgate.testing.nvidia_smi_log import write_nvidia_smi_csv
from wattgate.testing.synthetic_trace import TraceSpec, build_trace, gpus_of, job
from wattgate.errors import InputError
from wattgate.power.importers import import_trace, write_trace
from wattgate.triage_tables import shipped_table
from wattgate.power.triage import run_triage, triage
from wattgate.report import ReportSources, run_report

TABLE = shipped_table("h100")
GPUS = gpus_of(1, 8)
CKPT_S = (26, 35, 30, 38)  # within x1.5 of each other: one series
DEVICE = "NVIDIA H100 80GB HBM3"


def twelve_minutes() -> list[tuple]:
    segs = [("idle", 10)]
    for length in CKPT_S:
        segs += [("compute", 120), ("checkpoint", length)]
    used = 10 + sum(120 + c for c in CKPT_S)
    return segs + [("compute", 30), ("deadlock", 720 - used - 30)]


def labels(phases: pa.Table) -> np.ndarray:
    return phases.column("phase").to_numpy(zero_copy_only=False)


def without_gpu(table: pa.Table, gpu: int) -> pa.Table:
    return table.filter(pc.not_equal(table.column("gpu"), gpu))


@pytest.fixture(scope="module")
def synth():
    return build_trace(
        job(GPUS, twelve_minutes(), writer=0, stuck=5), TABLE, seed=11, spec=TraceSpec(device_name=DEVICE)
    )


@pytest.fixture(scope="module")
def imported(synth, tmp_path_factory):
    """The synthetic trace as an nvidia-smi CSV (units, a few [N/A]), imported to a trace file."""
    tmp = tmp_path_factory.mktemp("smi")
    csv = write_nvidia_smi_csv(synth, tmp / "node0.csv", na_every=499)
    text = csv.read_text().splitlines()
    assert text[0] == "timestamp, index, name, power.draw [W], utilization.gpu [%]"
    assert text[1].endswith(" %") and " W, " in text[1] and "[N/A]" in csv.read_text()
    table, meta = import_trace("nvidia-smi", [csv])
    write_trace(table, tmp / "trace.parquet")
    return tmp, table, meta


def check_job(phases: pa.Table, synth, min_share: float = 0.95) -> None:
    got, truth = labels(phases), synth.truth_for(phases)
    ck, dl = truth == "checkpoint", truth == "deadlock"
    assert (got[ck] == "checkpoint").mean() >= min_share, dict(zip(*np.unique(got[ck], return_counts=True)))
    assert not np.isin(got[ck], ["deadlock", "communication"]).any()
    assert (got[dl] == "deadlock").mean() >= min_share, dict(zip(*np.unique(got[dl], return_counts=True)))
    assert not (got[~dl] == "deadlock").any()
    assert (got == truth).mean() >= 0.97


# ---------------------------------------------------------------- triage rules


@pytest.mark.parametrize("stuck", [5, 0, None], ids=["rank5-idle-in-hang", "writer-idle-in-hang", "all-spin"])
def test_periodic_short_checkpoints_are_checkpoint_and_the_endless_wait_deadlock(stuck):
    """Both signs at once: rank 0 idle through each pause, and 4 pauses at a regular interval. The final
    wait looks the same (one rank idle, the rest spinning) but never ends: deadlock."""
    synth = build_trace(
        job(GPUS, twelve_minutes(), writer=0, stuck=stuck), TABLE, seed=1, spec=TraceSpec(device_name=DEVICE)
    )
    phases = triage(synth.table, TABLE)  # deadlock_after_s 60 s: every checkpoint is shorter
    check_job(phases, synth)
    writer = (phases.column("gpu").to_numpy() == 0) & (synth.truth_for(phases) == "checkpoint")
    assert (labels(phases)[writer] == "checkpoint").mean() >= 0.95  # the writer itself, at ~0-10% util


def test_the_idle_rank_alone_makes_a_single_short_pause_a_checkpoint():
    synth = build_trace(job(GPUS, [("compute", 100), ("checkpoint", 25), ("compute", 100)], writer=0), TABLE)
    phases = triage(synth.table, TABLE)
    got, truth = labels(phases), synth.truth_for(phases)
    assert (got[truth == "checkpoint"] == "checkpoint").mean() >= 0.95


def test_periodicity_alone_makes_the_pauses_checkpoints(synth):
    """The writer's GPU is not in the trace (another node's log): 4 regular pauses of similar length still are."""
    trace = without_gpu(synth.table, 0)
    phases = triage(trace, TABLE)
    got, truth = labels(phases), synth.truth_for(phases)
    assert (got[truth == "checkpoint"] == "checkpoint").mean() >= 0.95
    assert (got[truth == "deadlock"] == "deadlock").mean() >= 0.95


def test_neither_sign_leaves_a_single_short_pause_communication():
    """The limit the report states: once, no idle rank in the trace, shorter than deadlock_after_s."""
    synth = build_trace(job(GPUS, [("compute", 100), ("checkpoint", 25), ("compute", 100)], writer=0), TABLE)
    phases = triage(without_gpu(synth.table, 0), TABLE)
    got, truth = labels(phases), synth.truth_for(phases)
    assert (got[truth == "checkpoint"] == "communication").mean() >= 0.95


def test_sync_waits_stay_communication():
    """A straggler (one GPU computing on, the rest waiting 5 s), a 20 s wait with no idle rank, and three
    regular 15 s waits (three are not a series): all communication."""
    segs = [("compute", 60), ("sync_wait", 5), ("compute", 60), ("sync_wait", 20), ("compute", 60)]
    for _ in range(3):
        segs += [("sync_wait", 15), ("compute", 100)]
    sched = job(GPUS, segs)
    straggler = list(sched[GPUS[3]])
    straggler[1] = ("compute", 5)  # it is still computing while the others wait for it
    sched[GPUS[3]] = straggler
    synth = build_trace(sched, TABLE, seed=4)
    phases = triage(synth.table, TABLE)
    got, truth = labels(phases), synth.truth_for(phases)
    assert (got[truth == "communication"] == "communication").mean() >= 0.95
    assert not np.isin(got, ["checkpoint", "deadlock"]).any()


# ---------------------------------------------------------------- nvidia-smi round trip


def test_nvidia_smi_round_trip_gives_the_same_labels(synth, imported):
    tmp, table, meta = imported
    assert table.num_rows == synth.table.num_rows
    assert meta["source"] == "nvidia-smi" and not meta["gpu_index_inferred"]
    assert table.column("power_w").null_count > 0  # the [N/A] rows
    phases = triage(table, TABLE)
    check_job(phases, synth)
    direct = triage(synth.table, TABLE)
    assert (labels(phases) == labels(direct)).mean() >= 0.99


def test_triage_stage_on_the_imported_trace_says_power_only(imported, tmp_path):
    tmp, _, _ = imported
    assert main(["triage", "--trace", str(tmp / "trace.parquet"), "--out", str(tmp_path / "triage")]) == 0
    result = json.loads((tmp_path / "triage" / "triage.json").read_text())
    assert result["table"]["gpu_model"] == "H100" and result["table_source"].startswith("detected")
    assert result["signals"] == {"power": True, "util": True, "heartbeats": False, "metrics": False}
    po = result["power_only"]
    assert po["mode"] == "power only"
    assert [p["kind"] for p in result["pauses"]] == ["checkpoint"] * 4 + ["deadlock"]
    assert [p["open"] for p in result["pauses"]] == [False] * 4 + [True]
    assert all(p["idle"] == ["node0:0"] for p in result["pauses"][:4]) and result["pauses"][4]["idle"] == ["node0:5"]
    md = (tmp_path / "triage" / "triage.md").read_text()
    assert "## Power-only verdict" in md and "Power-only wait rule" in md and "4 checkpoint pause(s)" in md


# ---------------------------------------------------------------- report


def test_report_on_a_bare_trace_states_what_power_alone_could_not_tell(imported, tmp_path):
    tmp, _, _ = imported
    s = run_report(None, tmp_path / "report", ReportSources(trace_paths=[tmp / "trace.parquet"])).to_json()
    assert s["run"]["dir"] is None and s["run"]["traces"] == [str(tmp / "trace.parquet")]
    assert s["gpus"] == 8 and s["energy"]["kwh"] > 0 and s["tokens"] is None
    po = s["power_only"]
    missing = " ".join(po["missing"])
    for signal in ("heartbeats", "metrics", "invariant gate", "watcher", "energy counter"):
        assert signal in missing, signal
    assert "utilization" not in missing  # the log had it
    cannot = " ".join(po["cannot_tell"])
    assert "host-bound step" in cannot and "data-starved" in cannot
    assert "only GPU of a job from idle" in cannot
    assert po["imported"][0]["source"] == "nvidia-smi"
    checkpoints, hang = po["verdict"]
    assert checkpoints.startswith("4 checkpoint pause(s)") and "GPU node0:0 idle" in checkpoints
    assert "every ~2:" in checkpoints and "checkpoint, not a hang" in checkpoints
    assert hang.startswith("Deadlock at +") and "never ended" in hang and "node0:5 idle" in hang
    hangs = [a for a in s["anomalies"] if a["kind"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["duration_s"] >= 60
    page = (tmp_path / "report" / "index.html").read_text()
    for text in (
        "Power-only verdict",
        "Missing signals",
        "What it therefore could not tell apart",
        "Power-only wait rule",
        "never ends",
        "4 checkpoint pause(s)",
        "No run folder",
    ):
        assert text in page, text
    # triage run beforehand (power_dir) gives the same verdict as triage in process
    run_triage([tmp / "trace.parquet"], tmp_path / "power")
    again = run_report(
        None, tmp_path / "again", ReportSources(power_dir=tmp_path / "power", trace_paths=[tmp])
    ).to_json()
    assert again["power_only"]["verdict"] == po["verdict"] and again["pauses"] == s["pauses"]


def test_inferred_gpu_index_is_said(synth, tmp_path):
    """No index column: the importer infers it from burst order, and the report says it could not know."""
    short = build_trace(job(GPUS, [("compute", 60), ("checkpoint", 25), ("compute", 30)], writer=2), TABLE)
    csv = write_nvidia_smi_csv(short, tmp_path / "node0.csv", index=False)
    table, meta = import_trace("nvidia-smi", [csv])
    assert meta["gpu_index_inferred"]
    write_trace(table, tmp_path / "t.parquet")
    s = run_report(None, tmp_path / "report", ReportSources(trace_paths=[tmp_path / "t.parquet"])).to_json()
    assert any("inferred" in c for c in s["power_only"]["cannot_tell"])
    assert "GPU node0:2 idle" in s["power_only"]["verdict"][0]


def test_report_needs_a_run_or_traces(tmp_path):
    with pytest.raises(InputError, match="give a run folder or trace files"):
        run_report(None, tmp_path / "out")
    with pytest.raises(InputError, match="absent.parquet"):
        run_report(None, tmp_path / "out", ReportSources(trace_paths=[tmp_path / "absent.parquet"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no trace files"):
        run_report(None, tmp_path / "out", ReportSources(trace_paths=[tmp_path / "empty"]))


def test_heartbeats_switch_power_only_off(tmp_path):
    """A run folder with heartbeats: no power-only section (the run's own record decides the pauses)."""
    from wattgate.testing.synthetic_trace import write_run_info

    synth = build_trace(job(gpus_of(1, 2), [("compute", 60), ("checkpoint", 20), ("compute", 30)]), TABLE)
    run = tmp_path / "run"
    synth.write(run / "telemetry")
    write_run_info(run, synth)
    s = run_report(run, tmp_path / "out").to_json()
    assert s["power_only"] is None and s["signals"]["heartbeats"]
    assert "Power-only verdict" not in (tmp_path / "out" / "index.html").read_text()


def test_zeus_log_names_no_device_so_the_report_takes_gpu_model(synth, tmp_path):
    """Power only, no utilization, no device name: --gpu-model picks the table; utilization is named missing."""
    df = synth.table.select(["time", "gpu", "power_w"]).to_pandas()
    df["i"] = df.groupby("gpu").cumcount()
    wide = df.pivot(index="i", columns="gpu", values="power_w").dropna()
    times = df[df["gpu"] == 0].set_index("i")["time"].reindex(wide.index)
    lines = ["time," + ",".join(f"gpu{g}" for g in wide.columns)]
    lines += [f"{t:.3f}," + ",".join(f"{w:.2f}" for w in row) for t, row in zip(times, wide.to_numpy())]
    (tmp_path / "zeus.csv").write_text("\n".join(lines) + "\n")
    table, _ = import_trace("zeus", [tmp_path / "zeus.csv"], host="node0")
    write_trace(table, tmp_path / "t.parquet")
    s = run_report(None, tmp_path / "plain", ReportSources(trace_paths=[tmp_path / "t.parquet"])).to_json()
    assert s["phases"]["by_phase"] == {} and any("could not pick a table" in n for n in s["notes"])
    with pytest.raises(InputError, match="v100"):
        run_report(None, tmp_path / "bad", ReportSources(trace_paths=[tmp_path / "t.parquet"], gpu_model="v100"))
    s = run_report(
        None, tmp_path / "out", ReportSources(trace_paths=[tmp_path / "t.parquet"], gpu_model="h100")
    ).to_json()
    assert s["phases"]["table"] == "H100" and "deadlock" in s["phases"]["by_phase"]
    assert any("utilization" in m for m in s["power_only"]["missing"])
    assert any("spinning wait from an idle GPU" in c for c in s["power_only"]["cannot_tell"])
    assert "no utilization in the trace" in s["power_only"]["verdict"][0]

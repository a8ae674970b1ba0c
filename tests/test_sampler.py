"""The sampler (without a GPU: its no-NVML path, wrapper mode, fixed-rate loop), the trace writer,
and calibration's band derivation. The NVML path itself ran on an H200 (bench/gpu_checks.sh)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import REPO
from wattgate.errors import InputError
from wattgate.power.calibrate import PhaseMeasure, derive_table, power_stats
from wattgate.triage_tables import load_table_file, parse_table, resolve_table, shipped_table
from wattgate.telemetry.sampler import StopFlag, sample_loop
from wattgate.trace import TRACE_SCHEMA, TraceWriter, live_segments, read_trace, segment_dir, trace_files

try:
    import pynvml

    pynvml.nvmlInit()
    HAVE_NVML = True
except Exception:  # noqa: BLE001 - any failure means: no GPU here
    HAVE_NVML = False


def wattgate(*args, timeout=60, **kw):
    return subprocess.run(
        [sys.executable, "-m", "wattgate", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, **kw
    )


@pytest.mark.skipif(HAVE_NVML, reason="checks the no-NVML path")
def test_without_nvml_one_line_and_an_empty_trace_with_the_schema(tmp_path):
    proc = wattgate("sample", "--out", str(tmp_path / "{host}.parquet"), "--duration", "1")
    assert proc.returncode == 0
    assert proc.stdout.count("\n") == 1 and "no GPU telemetry on this host" in proc.stdout
    [path] = trace_files(tmp_path)
    table = read_trace(path)
    assert len(table) == 0 and table.schema.names == TRACE_SCHEMA.names


@pytest.mark.skipif(HAVE_NVML, reason="checks the no-NVML path")
def test_wrapper_mode_exits_with_the_command_status(tmp_path):
    proc = wattgate("sample", "--out", str(tmp_path / "t.parquet"), "--", "sh", "-c", "exit 3")
    assert proc.returncode == 3 and (tmp_path / "t.parquet").exists()


def test_wrapper_forwards_sigterm_to_the_command_and_finishes_the_trace(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "wattgate", "sample", "--out", str(tmp_path / "t.parquet"), "--", "sleep", "60"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    # the sampler installs its handlers before it starts the command: once the command runs, SIGTERM is
    # forwarded (a fixed sleep sent it before a cold interpreter on a busy machine had its handlers)
    wait_until(lambda: command_started(proc.pid, "sleep"), "the wrapped command started", timeout_s=120)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # the command died of the forwarded signal
    assert (tmp_path / "t.parquet").exists() and not segment_dir(tmp_path / "t.parquet").exists()


def wait_until(condition, what, timeout_s=60.0):
    """Poll `condition` until it holds or the deadline passes (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def command_started(pid, name):
    """A child of `pid` has exec'd `name` (past fork: its command line is the command's own)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return any(Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[0] == name.encode() for c in children)
    except FileNotFoundError:
        return False


class CountingSource:
    """Each read takes `work_s` (an NVML round trip), and read number `stall_at` takes `stall_s` more."""

    def __init__(self, work_s=0.0, stall_at=None, stall_s=0.0):
        self.times, self.work_s, self.stall_at, self.stall_s = [], work_s, stall_at, stall_s

    def read(self):
        self.times.append(time.monotonic())
        time.sleep(self.work_s + (self.stall_s if len(self.times) == self.stall_at else 0.0))
        return [{"time": time.time(), "host": "h", "gpu": 0, "power_w": 100.0}]


def test_a_wrapped_command_is_sampled_until_it_ends_after_a_stop_signal(tmp_path):
    """A stop signal passed on to the command starts its graceful stop; the power of that stop is part of the run."""
    from wattgate.telemetry.sampler import StopFlag, sample_loop

    writer = RowSink()
    flag = StopFlag()
    flag.adopt(subprocess.Popen(["sleep", "0.6"]))
    flag.stop = True  # as the handler leaves it once it has passed SIGTERM on
    started = time.monotonic()
    n = sample_loop(CountingSource(), writer, 0.05, flag)
    assert flag.child.poll() == 0 and time.monotonic() - started >= 0.5 and n >= 5


class RowSink:
    def __init__(self):
        self.rows = []

    def add(self, row):
        self.rows.append(row)


def test_sample_loop_keeps_a_fixed_rate_without_drift(tmp_path):
    # 20 ms of work per read on a 50 ms grid: a loop that sleeps the interval after its work reads every >= 70 ms.
    # A busy machine only makes single reads late (the next is back on the grid), so the median gap stays 50 ms.
    src = CountingSource(work_s=0.02)
    w = TraceWriter(tmp_path / "t.parquet", {}, flush_every_s=0.2)
    n = sample_loop(src, w, 0.05, StopFlag(), max_samples=40)
    w.close()
    assert n == 40 and len(read_trace(tmp_path / "t.parquet")) == 40
    assert np.median(np.diff(src.times)) < 0.06


def test_sample_loop_skips_the_ticks_it_fell_behind_on_rather_than_burst(tmp_path):
    # read 10 stalls 0.5 s (10 ticks): catching up would fire ~10 reads back to back; skipping fires one at once,
    # then waits for the grid. Reads a busy machine made late add one short gap each, far fewer than 10.
    src = CountingSource(work_s=0.005, stall_at=10, stall_s=0.5)
    w = TraceWriter(tmp_path / "t.parquet", {}, flush_every_s=0.2)
    sample_loop(src, w, 0.05, StopFlag(), max_samples=30)
    w.close()
    gaps = np.diff(src.times)
    assert gaps[9] >= 0.5  # the stall itself
    assert np.count_nonzero(gaps < 0.025) <= 3


def test_writer_merges_segments_and_readers_never_see_a_row_twice(tmp_path):
    path = tmp_path / "t.parquet"
    w = TraceWriter(path, {"host": "h"}, flush_every_s=1e9, merge_every=4)
    for i in range(23):
        w.add({"time": float(i), "host": "h", "gpu": 0, "power_w": float(i)})
        w.flush()
    segs = live_segments(segment_dir(path))
    assert len(segs) < 23  # merged as they piled up
    assert read_trace(path)["time"].to_pylist() == [float(i) for i in range(23)]
    # a merge caught half-way (the merged file written, the small ones not yet deleted) is read once
    import pyarrow as pa

    small = [q for q in segs if q.name.split("-")[1] == q.name.split("-")[2].split(".")[0]]
    assert len(small) == 3
    first, last = small[0].name.split("-")[1], small[-1].name.split("-")[1]
    pq.write_table(pa.concat_tables(pq.read_table(q) for q in small), segment_dir(path) / f"seg-{first}-{last}.parquet")
    assert read_trace(path)["time"].to_pylist() == [float(i) for i in range(23)]
    w.close()
    assert pq.ParquetFile(path).metadata.num_row_groups == 1


def test_reader_errors_name_the_file(tmp_path):
    with pytest.raises(InputError, match="no such trace"):
        read_trace(tmp_path / "nope.parquet")
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(InputError, match="bad.parquet: not a readable Parquet trace"):
        read_trace(bad)
    import pyarrow as pa

    pq.write_table(pa.table({"time": [1.0]}), tmp_path / "foreign.parquet")
    with pytest.raises(InputError, match="missing column.*import-trace"):
        read_trace(tmp_path / "foreign.parquet")


def stats(p, u):
    return PhaseMeasure(power_w=power_stats(np.asarray(p, float)), util_gpu=power_stats(np.asarray(u, float)))


def test_calibration_bands_sit_between_measured_phases():
    rng = np.random.default_rng(0)
    measured = {  # the H200 run's levels (bench/gpu_checks.sh): low phases ~119 W, GEMM ~685 W
        "idle": stats(rng.normal(119, 1, 150), np.zeros(150)),
        "checkpoint": stats(rng.normal(120, 1, 150), rng.uniform(0, 7, 150)),
        "deadlock": stats(rng.normal(120, 1, 150), np.full(150, 100.0)),
        "compute": stats(rng.normal(685, 20, 150), np.full(150, 100.0)),
    }
    t = derive_table("H200", ["H200"], 700, measured, {"kind": "calibrated"})
    assert 125 < t.low_max_w < measured["compute"].power_w.p5
    assert t.low_max_w < t.compute_min_w < measured["compute"].power_w.p5
    assert t.idle_w == pytest.approx(119, abs=1)
    with_comm = dict(measured, communication=stats(rng.normal(330, 15, 150), np.full(150, 100.0)))
    t2 = derive_table("H200", ["H200"], 700, with_comm, {"kind": "calibrated"})
    comm = with_comm["communication"].power_w
    assert measured["deadlock"].power_w.p99 < t2.low_max_w < comm.p5
    assert comm.p95 < t2.compute_min_w < measured["compute"].power_w.p5
    with pytest.raises(InputError, match="need at least the compute phase"):
        derive_table("X", ["X"], 700, {"idle": measured["idle"]}, {})


def test_calibrate_without_a_gpu_says_so():
    if HAVE_NVML:
        pytest.skip("a GPU is present")
    proc = wattgate("calibrate", "--gpu-model", "h200", "--out", "/tmp/never.yaml")
    assert proc.returncode == 2 and "calibrate needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tables_round_trip_detect_and_reject(tmp_path):
    h200 = shipped_table("h200")
    assert h200.provenance["kind"] == "calibrated" and h200.provenance["samples"]["deadlock"] > 100
    for name in ("a100", "h100", "b200", "b300"):
        assert shipped_table(name).provenance["kind"] == "published figures, uncalibrated"
    path = tmp_path / "t.yaml"
    path.write_text(h200.to_yaml())
    assert load_table_file(path) == h200
    assert resolve_table(None, None, ["NVIDIA H100 80GB HBM3"]).gpu_model == "H100"
    assert resolve_table(None, None, ["NVIDIA GB300"]).gpu_model == "B300"
    with pytest.raises(InputError, match="cannot tell the GPU model"):
        resolve_table(None, None, ["Tesla T4"])
    with pytest.raises(InputError, match="low_max_w < compute_min_w"):
        parse_table(dict(gpu_model="X", match=["X"], tdp_w=700, idle_w=70, low_max_w=400, compute_min_w=300), "t")
    with pytest.raises(InputError, match="unknown triage table key"):
        parse_table(
            dict(gpu_model="X", match=["X"], tdp_w=700, idle_w=70, low_max_w=200, compute_min_w=300, lowmax=1), "t"
        )


def test_launch_wraps_each_node_in_its_sampler_and_starts_the_watcher_command():
    from wattgate.train.launch import LaunchSpec, build_launch_command, watcher_command

    local = LaunchSpec(1, 2, "local", 1, None, None)
    argv = build_launch_command(local, ["-m", "wattgate", "train"], python="py", sample=("t/{host}.parquet", 0.1))
    assert argv[:9] == ["py", "-m", "wattgate", "sample", "--out", "t/{host}.parquet", "--interval", "0.1", "--"]
    assert argv[9:12] == ["py", "-m", "torch.distributed.run"]
    slurm = LaunchSpec(2, 8, "slurm", 4, "10.0.0.1", "4242")
    argv = build_launch_command(slurm, ["-m", "wattgate", "train"], python="py", sample=("t/{host}.parquet", 0.1))
    assert argv[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]
    # each node's trace is named after its Slurm node (several slurmd may share one hostname)
    sample = '; exec py -m wattgate sample --out t/"${SLURMD_NODENAME:-$(uname -n)}".parquet --interval 0.1'
    assert sample + " -- py -m torch" in argv[-1]
    assert watcher_command("c.yaml", "out", 77, "4242", python="py")[-4:] == ["--pid", "77", "--slurm-job", "4242"]


def test_a_stop_signal_before_the_command_has_started_still_reaches_it():
    """SIGTERM between the command's start and the flag knowing it: the flag passes it on as it adopts the child."""
    import signal as _signal
    import subprocess as _subprocess

    from wattgate.telemetry.sampler import StopFlag

    flag = StopFlag()
    flag(_signal.SIGTERM, None)  # the launcher's SIGTERM, early
    child = flag.adopt(_subprocess.Popen(["sleep", "60"], start_new_session=True))
    assert child.wait(timeout=30) == -_signal.SIGTERM

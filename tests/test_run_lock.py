"""One trainer per run folder: `wattgate launch` holds launch.lock for its whole job and rank 0 of `wattgate train`
holds train.lock, independent of Snakemake's lock (`snakemake --unlock` let a second train job into a running
folder). A second one is refused with one line naming the folder and the holder, and touches nothing there."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from wattgate.artifacts import claim_stage_output

# a stand-in job: runs until the run folder asks it to stop, then writes STOPPED and exits 0 ("finish": exits 0)
JOB = """
import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
open(os.path.join(out, "job-ready"), "w").close()
print(f"job: ready ({mode})", flush=True)
while mode != "finish" and not os.path.exists(os.path.join(out, "STOP_REQUESTED")):
    time.sleep(0.05)
if mode != "finish":
    print("job: stopping at step 1", flush=True)
    record = {"step": 1, "checkpoint": "c", "reason": "r", "time": time.time()}
    json.dump(record, open(os.path.join(out, "STOPPED"), "w"))
"""
# another trainer's rank 0: holds train.lock (as `wattgate train` does) until killed
HOLDER = """
import sys, time
from pathlib import Path
from wattgate.train.run_lock import hold_run_lock
hold_run_lock(Path(sys.argv[1]), "train.lock", "wattgate train (rank 0)")
print("holding", flush=True)
time.sleep(600)
"""


def job(out: Path, mode: str = "stop") -> list[str]:
    return [sys.executable, "-c", JOB, str(out), mode]


def hold_train_lock(out: Path) -> subprocess.Popen:
    claim_stage_output(out, "train")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_a_second_launch_in_a_running_run_folder_is_refused_and_leaves_the_first_ones_logs_whole(
    tmp_path, fake_launch, wait_until, catches
):
    out = tmp_path / "run"
    first = fake_launch(job(out), out)
    started = (out / "job-ready", out / "watcher.json")  # the job and its watcher (a process of its own) are up
    wait_until(lambda: all(p.exists() for p in started) or first.poll() is not None, what="the first job started")
    assert first.poll() is None, first.communicate()[1][-3000:]
    (out / "heartbeat").mkdir(exist_ok=True)
    beat = out / "heartbeat" / "rank-0.json"
    beat.write_text('{"rank": 0}')  # the running job's heartbeat: a second launch must clear nothing
    second = fake_launch(job(out, "finish"), out)
    try:
        _, err = second.communicate(timeout=120)
    finally:
        second.kill()
    assert second.returncode == 2, err[-3000:]
    line = one_line(err)
    assert line.startswith(f"wattgate launch: error: {out}: another trainer is running in this run folder")
    assert f"wattgate launch, pid {first.pid} on {socket.gethostname()}, started " in line and "launch.lock" in line
    assert beat.read_text() == '{"rank": 0}' and (out / "watcher.json").exists()
    wait_until(lambda: catches(first.pid, signal.SIGTERM), what="the first launch's handlers")
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 75, err[-3000:]
    # launch's own logs, opened only once it holds the folder: the first launch's whole output, nothing of the second
    for name in ("train.log", "train.attempts.log"):
        log = (out / name).read_text()
        assert log.startswith("launch: attempt 1 at ") and "job: ready (stop)" in log, log[-2000:]
        assert "job: stopping at step 1" in log and "launch: stopped at step 1" in log, log[-2000:]
        assert "another trainer is running" not in log and "job: ready (finish)" not in log


def test_rank_0_started_by_hand_is_refused_while_another_trainer_holds_the_folder(tmp_path, make_config):
    out = tmp_path / "run"
    holder = hold_train_lock(out)
    try:
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump(make_config().to_json()))
        before = sorted(p.name for p in out.iterdir())
        argv = [sys.executable, "-m", "wattgate", "train", "--config", str(config)]
        argv += ["--pretokenized", str(tmp_path / "pre"), "--plan", str(tmp_path / "plan"), "--run-dir", str(out)]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}  # by hand: rank 0 of one
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert line.startswith(f"wattgate train: error: {out}: another trainer is running in this run folder")
    assert f"wattgate train (rank 0), pid {holder.pid}" in line and "train.lock" in line
    assert sorted(p.name for p in out.iterdir()) == before  # no failure record written into the other's folder


def test_a_launch_is_refused_while_a_job_whose_launcher_was_killed_still_trains(tmp_path, fake_launch):
    """A launcher killed with -9 leaves its job running (its own session): launch.lock is free, but that job's
    rank 0 still holds train.lock, and a new launch must not clear its heartbeats or start a second job."""
    out = tmp_path / "run"
    holder = hold_train_lock(out)
    try:
        (out / "heartbeat").mkdir()
        (out / "heartbeat" / "rank-0.json").write_text('{"rank": 0}')
        proc = fake_launch(job(out, "finish"), out)
        _, err = proc.communicate(timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, err[-3000:]
    assert f"wattgate train (rank 0), pid {holder.pid}" in one_line(err)
    assert (out / "heartbeat" / "rank-0.json").exists() and not (out / "job-ready").exists()


def test_a_lock_ends_with_its_holder_and_attempts_are_numbered(tmp_path, fake_launch):
    out = tmp_path / "run"
    holder = hold_train_lock(out)
    holder.send_signal(signal.SIGKILL)  # the kernel drops the lock however the holder dies
    holder.wait()
    for attempt in (1, 2):
        proc = fake_launch(job(out, "finish"), out)
        stdout, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        header = stdout.splitlines()[0]
        assert header.startswith(f"launch: attempt {attempt} at ")
        assert header.endswith(f"on {socket.gethostname()}: {out}")
        assert json.loads((out / "launch.lock").read_text())["attempt"] == attempt

"""The launcher's side of a graceful stop, around a stand-in job (the ranks' side is tests of the train loop):
its first SIGTERM/SIGUSR1 becomes STOP_REQUESTED instead of killing the job, the job's processes survive a SIGUSR1
sent to every process of the tree, a second SIGTERM after the grace stops at once, the Slurm time limit requests a
stop ahead of the job's end, and a job that wrote STOPPED makes `wattgate launch` exit 75 with one line."""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from wattgate.errors import EXIT_STOPPED
from conftest import process_tree

# The stand-in rank: notes any SIGUSR1 it receives (a real rank takes it as a stop request), and stops when the run
# folder asks: writes STOPPED as rank 0 does after its stop checkpoint, and exits 0. With "finish" it exits 0 at once
# unless a stop request is there already (a stale one would stop a new attempt before its first step).
RANK = """
import json, os, signal, sys, time
out, mode = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGUSR1, lambda *_: open(os.path.join(out, "rank-got-usr1"), "w").close())
open(os.path.join(out, "rank-ready"), "w").close()
while True:
    if os.path.exists(os.path.join(out, "STOP_REQUESTED")):
        open(os.path.join(out, "rank-saw-stop"), "w").close()
        if mode != "ignore":
            ckpt = os.path.join(out, "checkpoints", "step-3")
            record = {"step": 3, "checkpoint": ckpt, "reason": "STOP_REQUESTED", "time": time.time()}
            with open(os.path.join(out, "STOPPED"), "w") as f:
                json.dump(record, f)
            sys.exit(0)
    if mode == "finish":
        sys.exit(0)
    time.sleep(0.05)
"""
# The stand-in agent: like torchrun, no SIGUSR1 handler of its own; it waits for its rank and exits with its status
AGENT = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1], *sys.argv[2:]]))"


def job(out: Path, mode: str = "stop") -> list[str]:
    return [sys.executable, "-c", AGENT, RANK, str(out), mode]


def finish(proc: subprocess.Popen, timeout_s: float = 120.0) -> tuple[int, str]:
    """(launch's exit status, its stdout and stderr)."""
    try:
        stdout, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in reversed(process_tree(proc.pid)):
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"launch did not end within {timeout_s:.0f} s:\n{err[-3000:]}") from None
    return proc.returncode, stdout + err


def started(proc, out: Path, wait_until, catches, signals=(signal.SIGTERM,)) -> None:
    """The stand-in rank and the watcher run, and launch's handlers exist (a signal before them would take its
    default action)."""
    wait_until(lambda: (out / "rank-ready").exists() or proc.poll() is not None, what="the stand-in rank started")
    wait_until(lambda: (out / "watcher.json").exists() or proc.poll() is not None, what="the watcher started")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    wait_until(lambda: catches(proc.pid, *signals), what="launch's handlers")


def test_sigterm_requests_a_graceful_stop_and_launch_exits_75(tmp_path, fake_launch, wait_until, catches):
    out = tmp_path / "run"
    proc = fake_launch(job(out), out)
    started(proc, out, wait_until, catches)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == EXIT_STOPPED, err[-3000:]
    request = json.loads((out / "STOP_REQUESTED").read_text())
    assert request["signal"] == "SIGTERM" and "wattgate launch" in request["reason"]
    line = f"launch: stopped at step 3 (STOP_REQUESTED); checkpoint {out}/checkpoints/step-3; rerun to resume"
    assert line in err.splitlines(), err[-3000:]
    assert "Traceback" not in err
    verdict = json.loads((out / "watcher.json").read_text())
    assert verdict["verdict"] == "stopped" and verdict["job_end"]["returncode"] == 0


def test_sigusr1_to_every_process_of_the_tree_leaves_the_job_running_until_it_stops(
    tmp_path, fake_launch, wait_until, catches
):
    """Slurm (or a person) may signal every process: the agent and sampler have no USR1 handler and died of it,
    taking their ranks with them. They now start with USR1 ignored, and the rank's own handler still gets it."""
    out = tmp_path / "run"
    proc = fake_launch(job(out), out)
    started(proc, out, wait_until, catches, (signal.SIGTERM, signal.SIGUSR1))
    processes = process_tree(proc.pid)
    assert len(processes) >= 4, processes  # launch, the watcher, the agent, the rank
    for pid in processes:
        os.kill(pid, signal.SIGUSR1)
    rc, err = finish(proc)
    assert rc == EXIT_STOPPED, err[-3000:]
    assert json.loads((out / "STOP_REQUESTED").read_text())["signal"] == "SIGUSR1"
    assert (out / "rank-got-usr1").exists()  # ignored in the agent, not in the rank: its handler overrides
    assert json.loads((out / "watcher.json").read_text())["verdict"] == "stopped"  # the watcher survived it too


def test_a_second_sigterm_within_the_grace_is_the_same_request_and_one_after_it_stops_at_once(
    tmp_path, fake_launch, wait_until, catches
):
    out = tmp_path / "run"
    grace = 6  # cluster.slurm.train.stop_margin_s
    proc = fake_launch(job(out, "ignore"), out, cluster={"slurm": {"train": {"stop_margin_s": grace}}})
    started(proc, out, wait_until, catches)  # a job that never reaches a step boundary
    proc.send_signal(signal.SIGTERM)
    first = time.monotonic()
    wait_until(lambda: (out / "rank-saw-stop").exists(), what="the stop request reached the rank")
    if time.monotonic() - first < grace / 2:  # a loaded machine may take longer: then only the hard stop is checked
        proc.send_signal(signal.SIGTERM)  # scancel signals every process, some twice: the same request
        wait_until(lambda: time.monotonic() - first > grace + 0.5, what="the grace to pass")
        assert proc.poll() is None and not (out / "ABORT_REQUESTED").exists()
    else:
        wait_until(lambda: time.monotonic() - first > grace + 0.5, what="the grace to pass")
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 1, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("wattgate launch: failed: stopped at once by a second SIGTERM")
    assert json.loads((out / "ABORT_REQUESTED").read_text())["reason"] == "a second SIGTERM to wattgate launch"
    verdict = json.loads((out / "watcher.json").read_text())
    assert verdict["verdict"] == "failed" and "stopped at once" in verdict["reason"]


def test_an_earlier_attempts_stop_files_do_not_stop_the_next_attempt(tmp_path, fake_launch, wait_until):
    out = tmp_path / "run"
    out.mkdir()
    (out / "STOP_REQUESTED").write_text("{}")
    (out / "STOPPED").write_text(json.dumps({"step": 1, "checkpoint": "x", "reason": "old"}))
    rc, err = finish(fake_launch(job(out, "finish"), out))
    assert rc == 0, err[-3000:]
    assert not (out / "rank-saw-stop").exists() and not (out / "STOPPED").exists()


@pytest.fixture
def fake_squeue(tmp_path):
    """A `squeue` on PATH that prints the end time the test writes (local time, as squeue prints %e)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    end_file = tmp_path / "end-time"
    script = bin_dir / "squeue"
    script.write_text(f"#!/bin/sh\ncat {end_file}\n")
    script.chmod(0o755)

    def set_end(text: str) -> dict:
        end_file.write_text(text + "\n")
        return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}

    return set_end


def test_the_slurm_time_limit_requests_a_stop_ahead_of_the_jobs_end(tmp_path, fake_launch, fake_squeue):
    out = tmp_path / "run"
    margin, end = 5, time.time() + 20
    env = fake_squeue(datetime.fromtimestamp(end).strftime("%Y-%m-%dT%H:%M:%S"))
    proc = fake_launch(job(out), out, env, cluster={"slurm": {"train": {"stop_margin_s": margin}}})
    rc, err = finish(proc)
    assert rc == EXIT_STOPPED, err[-3000:]
    request = json.loads((out / "STOP_REQUESTED").read_text())
    assert request["signal"] is None and "time limit" in request["reason"]
    assert end - margin - 1.5 <= request["time"] < end, (request, end)  # squeue's time has whole seconds
    assert "launch: Slurm job 4242 ends at" in err


@pytest.mark.parametrize("text", ["N/A", "UNLIMITED", "Unknown", "NONE"])
def test_a_job_without_a_time_limit_gets_no_timer(fake_squeue, monkeypatch, text):
    from wattgate.train.launch_stop import slurm_end_time

    for key, value in fake_squeue(text).items():
        monkeypatch.setenv(key, value)
    end, why = slurm_end_time("4242")
    assert end == float("inf") and "no time limit" in why


def test_torchruns_first_stop_signal_becomes_the_run_folders_request_and_never_replaces_one(tmp_path):
    """torchrun's own handler would pass SIGTERM on to ranks that may have had one from Slurm a moment before; it
    never sees the signal: wattgate's torchrun writes the request every rank polls."""
    from wattgate.train.torchrun import SignalRelay

    relay = SignalRelay(tmp_path, grace_s=300)
    relay.on_signal(signal.SIGUSR1, now=10.0)
    request = json.loads((tmp_path / "STOP_REQUESTED").read_text())
    assert request["signal"] == "SIGUSR1" and request["reason"].startswith("SIGUSR1 to torchrun on ")
    relay.on_signal(signal.SIGTERM, now=20.0)  # the same request again, within the grace
    assert json.loads((tmp_path / "STOP_REQUESTED").read_text()) == request
    launch_first = tmp_path / "launch-first"
    launch_first.mkdir()
    (launch_first / "STOP_REQUESTED").write_text('{"reason": "SIGTERM to wattgate launch"}')
    SignalRelay(launch_first, grace_s=300).on_signal(signal.SIGTERM, now=1.0)
    assert json.loads((launch_first / "STOP_REQUESTED").read_text())["reason"] == "SIGTERM to wattgate launch"

"""The hang watcher: diagnoses from heartbeat and trace files, the kill, and the live trace tail.

Power levels per GPU model are the H100 table's (idle 70 W, low band < 210 W,
compute >= 380 W); a hung H100 read 100% util at 129-152 W, so waits are
written at 140 W / 100% util, compute at 600 W / 100%, an idle rank at 72 W / 0%.
"""

import json
import os
import socket
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from wattgate.config import run_config
from wattgate.errors import InputError
from wattgate.triage_tables import shipped_table
from wattgate.trace import TraceWriter, read_trace, segment_dir
from wattgate.records.heartbeat import Beat
from wattgate.heartbeats import read_heartbeats
from wattgate.records.run_config import RunConfig
from wattgate.telemetry.kill import kill_tree, process_tree, stop_job
from wattgate.telemetry.watch import run_watch, watch
from wattgate.telemetry.watch_inputs import TraceTail
from wattgate.records.watcher import WatcherSettings
from wattgate.telemetry.watch_verdicts import WatchedJob, diagnose, position

from conftest import dead_pid

H100 = shipped_table("h100")
S = WatcherSettings(
    hang_after_s=10,
    checkpoint_after_s=100,
    startup_after_s=50,
    busy_stall_after_s=300,
    action="kill",
    poll_s=0.2,
    kill_grace_s=2,
)
NOW = 1_000_000.0


def job(world, table=None, s=S):
    return WatchedJob(world=world, settings=s, table=table)


def beat(
    rank, step, phase="train", age=0.0, epoch=0, micro=None, micros=None, total=40, epoch_ends=(20, 40), host="n1"
):
    b = {
        "rank": rank,
        "local_rank": rank,
        "gpu": None,
        "host": host,
        "pid": 1,
        "step": step,
        "epoch": epoch,
        "phase": phase,
        "time": NOW - age,
        "total_steps": total,
        "epoch_ends": list(epoch_ends),
    }
    if micro is not None:
        b.update(micro=micro, micros=micros)
    return b


def beats(*bs):
    return {b["rank"]: Beat.from_json(b) for b in bs}


def test_progressing_job_is_healthy():
    assert diagnose(job(2), beats(beat(0, 5, age=1), beat(1, 5, age=1)), NOW, NOW - 60, {}) is None


def test_heartbeat_stall_alone_is_not_a_deadlock_without_power_data():
    # ranks in step, no power data and no rank process readable here: a slow step (issue 25), stopped as
    # train_stalled only past busy_stall_after_s; tests/test_watch_verdicts.py has the CPU-time cases
    assert diagnose(job(2), beats(beat(0, 5, age=11), beat(1, 5, age=12)), NOW, NOW - 60, {}) is None
    v = diagnose(job(2), beats(beat(0, 5, age=301), beat(1, 5, age=302)), NOW, NOW - 600, {})
    assert v.verdict == "train_stalled" and not v.confirmed and "no power data" in v.reason
    assert v.stalled_for_s == pytest.approx(301)


def test_rank_that_left_the_epoch_is_named_as_ahead():
    # rank 1's plan ends epoch 0 at step 18 and it entered the epoch-end checkpoint;
    # rank 0 still has step 19 to go and waits in its first collective
    r0 = beat(0, 18, micro=1, micros=2, age=11, total=38, epoch_ends=(19, 38))
    r1 = beat(1, 18, phase="checkpoint", age=11, total=36, epoch_ends=(18, 36))
    v = diagnose(job(2), beats(r0, r1), NOW, NOW - 60, {})
    assert v.verdict == "deadlock" and v.ran_ahead == (1,) and v.behind == (0,)
    assert v.limit_phase == "train"  # a checkpoint only one rank entered gets the plain hang limit
    assert "rank 1: checkpointing after step 18, the last step of its epoch 0" in v.reason
    assert "rank 0: in step 19, micro-batch 1 of 2" in v.reason


def test_fewer_planned_micro_batches_in_a_step_is_ahead():
    # both ranks are on their last micro-batch of step 18; rank 0 has 1 planned, rank 1 has 2
    r0 = beat(0, 17, micro=1, micros=1, age=11)
    r1 = beat(1, 17, micro=2, micros=2, age=11)
    assert position(Beat.from_json(r0)) > position(Beat.from_json(r1))
    v = diagnose(job(2), beats(r0, r1), NOW, NOW - 60, {})
    assert v.ran_ahead == (0,) and v.behind == (1,)
    assert "micro-batches planned for step 18: 1 on rank 0, 2 on rank 1" in v.reason


def test_checkpoint_every_rank_announced_gets_the_longer_limit():
    all_ckpt = beats(beat(0, 20, "checkpoint", age=50), beat(1, 20, "checkpoint", age=50))
    assert diagnose(job(2), all_ckpt, NOW, NOW - 600, {}) is None
    low = {("n1", 0): (120.0, 0.0, 10.0), ("n1", 1): (140.0, 100.0, 10.0)}  # low power, like a hang
    assert diagnose(job(2, H100), all_ckpt, NOW, NOW - 600, low) is None  # ...and still not called one
    stuck = beats(beat(0, 20, "checkpoint", age=101), beat(1, 20, "checkpoint", age=101))
    v = diagnose(job(2, H100), stuck, NOW, NOW - 600, low)
    assert v.verdict == "checkpoint_stalled" and v.limit_phase == "checkpoint" and v.limit_s == 100
    assert "every rank has been in checkpoint for 101.0 s" in v.reason


def test_busy_gpus_mean_a_slow_step_not_a_hang():
    busy = {("n1", 0): (600.0, 100.0, 10.0), ("n1", 1): (590.0, 100.0, 10.0)}
    stalled = beats(beat(0, 5, age=30), beat(1, 5, age=30))
    assert diagnose(job(2, H100), stalled, NOW, NOW - 600, busy) is None
    very_long = beats(beat(0, 5, age=301), beat(1, 5, age=301))
    v = diagnose(job(2, H100), very_long, NOW, NOW - 600, busy)
    assert v.verdict == "train_stalled" and not v.confirmed and "busy at high power" in v.reason


def test_low_power_hang_names_the_idle_rank_as_stuck():
    # the field report's signature: three ranks spin in NCCL at ~140 W and 100% util, one sits at 0%
    power = {("n1", r): (140.0, 100.0, 10.0) for r in range(3)} | {("n1", 3): (72.0, 0.0, 10.0)}
    stalled = beats(*(beat(r, 7, age=11) for r in range(4)))
    v = diagnose(job(4, H100), stalled, NOW, NOW - 600, power)
    assert v.verdict == "deadlock" and v.stuck_ranks == (3,)
    assert "GPUs in the low power band (< 210 W)" in v.reason
    assert v.ranks[3].util_gpu == 0.0 and v.ranks[0].power_w == 140.0


def test_power_noise_at_the_band_edge_is_averaged_over_the_window():
    # window means just under the edge (noise on single samples does not matter: the tail averages)
    edge = {("n1", 0): (205.0, 100.0, 10.0), ("n1", 1): (209.0, 100.0, 10.0)}
    assert diagnose(job(2, H100), beats(beat(0, 5, age=11), beat(1, 5, age=11)), NOW, NOW - 60, edge)
    above = {("n1", 0): (205.0, 100.0, 10.0), ("n1", 1): (215.0, 100.0, 10.0)}
    assert diagnose(job(2, H100), beats(beat(0, 5, age=11), beat(1, 5, age=11)), NOW, NOW - 60, above) is None


def test_missing_rank_heartbeat_after_startup_limit():
    one = beats(beat(0, 0, "init", age=1))
    assert diagnose(job(2), one, NOW, NOW - 10, {}) is None
    v = diagnose(job(2), one, NOW, NOW - 51, {})
    assert v.verdict == "stuck_ranks" and v.stuck_ranks == (1,)


def test_finished_ranks_are_not_a_hang():
    done = beats(beat(0, 40, "done", age=500), beat(1, 40, "done", age=500))
    assert diagnose(job(2), done, NOW, NOW - 600, {}) is None
    exporting = beats(beat(0, 40, "export", age=40), beat(1, 40, "done", age=40))
    assert diagnose(job(2), exporting, NOW, NOW - 600, {}) is None  # export has the start-up limit


# --- files: heartbeats, live trace segments, a real process tree ---------------------------------


def write_beat(run, b):
    (run / "heartbeat").mkdir(parents=True, exist_ok=True)
    (run / "heartbeat" / f"rank-{b['rank']}.json").write_text(json.dumps(b))


def live_trace(run, host, levels, seconds, hz=10, t_end=None, drop=()):
    """Flushed segments of a still-running sampler: levels[gpu] = (power W, util %)."""
    t_end = time.time() if t_end is None else t_end
    w = TraceWriter(run / "telemetry" / f"{host}.parquet", {"host": host}, flush_every_s=1e9, merge_every=3)
    n = int(seconds * hz)
    for i in range(n):
        t = t_end - seconds + i / hz
        if any(a <= t - (t_end - seconds) < b for a, b in drop):
            continue
        for gpu, (p, u) in levels.items():
            w.add({"time": t, "host": host, "gpu": gpu, "power_w": p, "util_gpu": u})
        if i % 10 == 9:
            w.flush()
    w.flush()
    return w


def test_trace_tail_reads_live_segments_incrementally_across_merges(tmp_path):
    w = live_trace(tmp_path, "n1", {0: (140.0, 100.0), 1: (72.0, 0.0)}, seconds=6)
    tail = TraceTail(tmp_path / "telemetry", keep_s=30)
    tail.update()
    got = tail.window(time.time() - 30)
    assert got[("n1", 0)][:2] == (140.0, 100.0) and got[("n1", 1)][:2] == (72.0, 0.0)
    before = sum(len(c[0]) for c in tail.chunks)
    assert before == 120  # 6 s x 10 Hz x 2 GPUs, none twice although segments were merged meanwhile
    tail.update()
    assert sum(len(c[0]) for c in tail.chunks) == before
    w.close()


def test_missing_samples_window_uses_what_is_there(tmp_path):
    live_trace(tmp_path, "n1", {0: (140.0, 100.0)}, seconds=10, drop=[(2, 8)])
    tail = TraceTail(tmp_path / "telemetry", keep_s=30)
    tail.update()
    p, u, covered = tail.window(time.time() - 20)[("n1", 0)]
    assert (p, u) == (140.0, 100.0) and covered > 8  # samples on both sides of the gap


@pytest.fixture
def job_tree():
    """A stand-in job: a shell with two sleeping children, in its own session (as the launcher starts it)."""
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    deadline = time.time() + 5
    while len(process_tree(proc.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_kill_tree_terminates_descendants_not_the_root(job_tree):
    children = process_tree(job_tree.pid)
    assert len(children) == 2
    result = kill_tree(job_tree.pid, grace_s=2)
    assert sorted(result["terminated"]) == sorted(children)
    assert job_tree.wait(timeout=5) is not None  # the shell's `wait` returns once its children are gone


def run_watch_in_thread(run, world, settings, table, pid):
    """Start the watcher and return once it is watching: it ignores heartbeats older than its start, so a test
    that wrote them earlier (a busy machine can take seconds to start a thread) would watch nothing."""
    box = {}
    t = threading.Thread(target=lambda: box.update(record=watch(run, job(world, table, settings), pid)), daemon=True)
    t.start()
    wait_for_record(run, lambda r: r["verdict"] == "running")
    return t, box


def wait_for_record(run, condition, timeout_s=60.0):
    """The watcher.json that meets `condition`, polled until a deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            record = json.loads((run / "watcher.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            record = None
        if record is not None and condition(record):
            return record
        time.sleep(0.02)
    raise AssertionError(f"no watcher.json meeting the condition within {timeout_s} s")


def test_watcher_kills_a_low_power_hang_and_records_why(tmp_path, job_tree):
    run = tmp_path / "run"
    s = replace(S, hang_after_s=2.0)
    t, box = run_watch_in_thread(run, 2, s, H100, job_tree.pid)
    start = time.time()
    write_beat(run, beat(0, 12, micro=1, micros=2) | {"time": start})
    write_beat(run, beat(1, 12, "checkpoint", epoch_ends=(12, 24)) | {"time": start})
    live_trace(run, "n1", {0: (140.0, 100.0), 1: (72.0, 0.0)}, seconds=4, t_end=start + 3.5)
    t.join(timeout=30)
    record = box["record"]
    assert record.verdict == "deadlock" and record.ran_ahead == (1,) and record.behind == (0,)
    assert record.power_signal.startswith("GPUs in the low power band")
    assert record.killed_at - start < s.hang_after_s + 10
    assert job_tree.wait(timeout=10) is not None
    on_disk = json.loads((run / "watcher.json").read_text())
    assert on_disk["verdict"] == "deadlock" and on_disk["kill"]["terminated"]
    # what the hang cost from the last progress to the kill, against the collective timeout without the watcher
    cost = on_disk["cost"]
    assert cost["spent_s"] == pytest.approx(record.killed_at - start, abs=0.01) and cost["gpus"] == 2
    assert cost["power_w"] == pytest.approx(212.0, abs=1.0)
    assert cost["spent_kwh"] == pytest.approx(cost["power_w"] * cost["spent_s"] / 3.6e6, rel=1e-3)
    assert cost["without_watcher"]["timeout_s"] == 600.0  # NCCL's default when no timeout is given
    assert cost["without_watcher"]["gpu_hours"] == pytest.approx(600 * 2 / 3600)
    assert "GPU-hours saved" in cost["line"]


def test_watcher_leaves_a_checkpoint_alone_then_sees_the_job_finish(tmp_path, job_tree):
    run = tmp_path / "run"
    s = replace(S, hang_after_s=1.0, checkpoint_after_s=60)
    t, box = run_watch_in_thread(run, 2, s, H100, job_tree.pid)
    now = time.time()
    for r in (0, 1):  # both ranks announced the checkpoint; power is low, as in a hang
        write_beat(run, beat(r, 20, "checkpoint") | {"time": now})
    live_trace(run, "n1", {0: (140.0, 100.0), 1: (75.0, 3.0)}, seconds=3, t_end=now + 2.5)
    time.sleep(3.0)  # the claim is about a span: 3 x hang_after_s of low power inside a checkpoint
    assert t.is_alive() and job_tree.poll() is None
    for r in (0, 1):
        write_beat(run, beat(r, 40, "done") | {"time": time.time()})
    t.join(timeout=10)
    assert box["record"].verdict == "healthy" and job_tree.poll() is None


def test_warn_action_records_but_does_not_kill(tmp_path, job_tree):
    run = tmp_path / "run"
    s = replace(S, hang_after_s=1.0, action="warn")
    t, box = run_watch_in_thread(run, 1, s, None, job_tree.pid)
    # the rank is an idle process on this host whose command line names wattgate: every rank waits, a confirmed
    # deadlock (a stall with no evidence either way is only a warned-about slow step)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "wattgate"])
    write_beat(run, beat(0, 3) | {"time": time.time(), "host": socket.gethostname(), "pid": rank.pid})
    record = wait_for_record(run, lambda r: r["verdict"] != "running")
    assert record["verdict"] == "deadlock" and record["action"] == "warn"
    with pytest.raises(subprocess.TimeoutExpired):  # the kill would follow the record at once: none comes
        job_tree.wait(timeout=2.0)
    os.killpg(job_tree.pid, signal.SIGKILL)
    t.join(timeout=10)  # the watched process is gone: the watcher ends
    rank.kill()
    rank.wait()


def test_heartbeats_of_an_earlier_attempt_are_ignored(tmp_path):
    write_beat(tmp_path, beat(0, 40, "done") | {"time": 100.0})
    assert read_heartbeats(tmp_path, since=200.0) == {}
    assert read_heartbeats(tmp_path)[0].phase == "done"


def test_watch_cli_without_a_job_exits_cleanly(tmp_path):
    from conftest import REPO

    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {inputs: [x.jsonl]}\nwatcher: {poll_s: 0.1}\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wattgate",
            "watch",
            "--config",
            str(cfg),
            "--run-dir",
            str(tmp_path),
            "--pid",
            str(dead.pid),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "watcher.json").read_text())["verdict"] == "healthy"


def test_segments_of_a_killed_sampler_stay_readable(tmp_path):
    w = live_trace(tmp_path, "n1", {0: (300.0, 90.0)}, seconds=5)
    path = tmp_path / "telemetry" / "n1.parquet"
    assert not path.exists() and segment_dir(path).is_dir()
    assert len(read_trace(path)) == 50  # as if SIGKILLed now: every flushed row is there
    w.close()
    assert path.exists() and not segment_dir(path).exists() and len(read_trace(path)) == 50


def test_on_slurm_the_inner_srun_itself_gets_the_sigterm():
    """srun forwards SIGTERM to every node's tasks, so the watcher signals it (not only its local children)."""

    srun = subprocess.Popen(["sleep", "300"])  # stands in for the inner srun
    result = stop_job(srun.pid, "4242", grace_s=5)
    assert result == {"terminated": [srun.pid]}  # gone within the grace: no scancel needed
    assert srun.wait(timeout=5) == -signal.SIGTERM


# --- the run folder it watches and the verdict it would replace ---------------------------------


def watch_config() -> RunConfig:
    return run_config({"data": {"inputs": ["x.jsonl"]}, "watcher": {"poll_s": 0.05}})


def test_watch_refuses_a_run_folder_that_does_not_exist(tmp_path):
    missing = tmp_path / "no_such_rundir"
    with pytest.raises(InputError, match="no_such_rundir: no such run folder"):
        run_watch(watch_config(), missing, pid=dead_pid())
    assert not missing.exists()


def test_watch_does_not_replace_a_verdict_that_found_a_deadlock(h200_run, tmp_path):
    run = h200_run
    record = json.loads((run / "watcher.json").read_text())
    record |= {"verdict": "deadlock", "reason": "deadlock: no rank advanced", "action": "kill"}
    (run / "watcher.json").write_text(json.dumps(record))
    before = (run / "watcher.json").read_bytes()
    with pytest.raises(InputError, match=r"verdict 'deadlock' \(the job was killed\).*--out elsewhere"):
        run_watch(watch_config(), run, pid=dead_pid())
    assert (run / "watcher.json").read_bytes() == before
    # elsewhere it may watch, and a quiet record of its own it replaces
    assert run_watch(watch_config(), run, pid=dead_pid(), out=tmp_path / "w.json").verdict == "healthy"
    assert run_watch(watch_config(), run, pid=dead_pid(), out=tmp_path / "w.json").verdict == "healthy"

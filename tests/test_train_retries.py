"""Snakemake retries the train job (cluster.slurm.train.max_jobs - 1 times): a retry resumes a run that stopped at
its time limit or lost a rank with its node, and ends at once after a failure a retry would repeat (a rank's own
error: a non-finite loss, a full disk), naming that failure, instead of training to it again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wattgate.heartbeats import write_rank_error, write_rank_exit
from wattgate.run_files import ATTEMPT_OUTCOME
from wattgate.telemetry.failures import name_failure
from wattgate.train.attempts import Outcome, record_outcome

BIN = Path(sys.executable).parent


def launch(tmp: Path, run: Path, attempt: int) -> subprocess.CompletedProcess:
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "t", "model": {"config": {"model_type": "qwen3"}}}))
    argv = [str(BIN / "wattgate"), "launch", "--config", str(config), "--pretokenized", str(tmp / "pretokenized")]
    argv += ["--plan", str(tmp / "plan"), "--run-dir", str(run), "--attempt", str(attempt)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_a_retry_after_a_failure_it_would_repeat_ends_at_once_naming_it(tmp_path):
    from wattgate.run_files import claim_output

    run = claim_output(tmp_path / "run", "train")
    line = "rank 1 in step 5: step 5: non-finite loss on rank 1 ... (exit 1)"
    record_outcome(run, 1, Outcome(1, line, retry=False))
    proc = launch(tmp_path, run, attempt=2)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "retry 2 not started: attempt 1 ended with rank 1 in step 5" in proc.stderr
    assert "which a retry would repeat" in proc.stderr


def test_a_retry_after_a_stop_or_a_lost_node_goes_on_and_a_persons_rerun_always_does(tmp_path):
    from wattgate.run_files import claim_output

    run = claim_output(tmp_path / "run", "train")
    for outcome, attempt in [
        (Outcome(75, "stopped at step 40 (SIGUSR1)", retry=True), 2),
        (Outcome(1, "rank 1 died: killed by SIGKILL (signal 9)", retry=True), 3),
        (Outcome(2, "rank 0: No space left on device (exit 2)", retry=False), 1),  # --attempt 1: a person's rerun
    ]:
        record_outcome(run, attempt - 1 or 1, outcome)
        proc = launch(tmp_path, run, attempt)
        # the attempt went past the retry check: it now stops on the missing gate verdict instead
        assert "not started" not in proc.stderr and "gate" in proc.stderr, proc.stderr


def test_the_outcome_is_recorded_in_a_run_folder_of_train_and_never_in_a_foreign_one(tmp_path):
    from wattgate.run_files import claim_output

    run = claim_output(tmp_path / "run", "train")
    record_outcome(run, 3, Outcome(2, "rank 0: No space left on device (exit 2)", retry=False, attempt=5))
    record = json.loads((run / ATTEMPT_OUTCOME).read_text())
    assert record["attempt"] == 5 and record["snakemake_try"] == 3  # launch's count in the folder; Snakemake's try
    assert record["exit_status"] == 2 and record["retry"] is False
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("a user's")
    proc = launch(tmp_path, foreign, attempt=1)
    assert proc.returncode == 2 and sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_which_rank_failures_a_retry_may_cure(tmp_path):
    run = tmp_path / "run"
    (run / "heartbeat").mkdir(parents=True)
    write_rank_exit(run, 1, 1, 4242, -9)  # SIGKILL: the node or the OOM killer
    assert name_failure(run).retriable
    for f in (run / "heartbeat").glob("*-rank-*.json"):
        f.unlink()
    write_rank_error(run, 0, "step 5: non-finite loss on rank 0: ...", 1)  # the run's own: it would repeat
    assert not name_failure(run).retriable
    write_rank_error(run, 0, "Connection closed by peer [127.0.0.1]:1234", 1)  # a lost peer: the network's
    assert name_failure(run).retriable


@pytest.fixture
def full_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs), so a test can fill it: skipped where this user cannot mount one."""
    where = tmp_path / "small-disk"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.decode().strip()[:80]})")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def fill(folder: Path) -> None:
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with pytest.raises(OSError):
        (folder / "probe").write_bytes(b"\0" * 8192)


def test_an_attempt_on_a_full_disk_still_records_its_outcome_in_the_room_set_aside(full_disk):
    from wattgate.artifacts import reserve_spare
    from wattgate.run_files import claim_output

    run = claim_output(full_disk / "run", "train")
    assert reserve_spare(run / ATTEMPT_OUTCOME)  # launch does this at its start
    fill(full_disk)
    line = "rank 0: checkpoint step-40: No space left on device (exit 2)" + " and more" * 300  # cut to fit
    record_outcome(run, 1, Outcome(2, line, retry=False))
    recorded = json.loads((run / ATTEMPT_OUTCOME).read_text())
    assert recorded["exit_status"] == 2 and recorded["retry"] is False and recorded["line"].startswith("rank 0: chec")
    proc = launch(full_disk.parent, run, attempt=2)  # the retry reads it and ends at once
    assert "retry 2 not started: attempt 1 ended with rank 0: checkpoint step-40: No space left" in proc.stderr


def test_a_record_that_cannot_be_written_goes_into_its_spare_and_without_one_the_write_error_stands(
    tmp_path, monkeypatch
):
    """The same path where this user cannot mount a small disk: the write fails as on a full disk."""
    import errno

    import wattgate.artifacts as artifacts
    from wattgate.heartbeats import rank_error_path, reserve_rank_error, write_rank_error

    real = artifacts.write_bytes_atomic

    def disk_full(dest, data):
        if not Path(dest).name.startswith(".spare-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(dest, data)

    assert reserve_rank_error(tmp_path, 1)
    monkeypatch.setattr(artifacts, "write_bytes_atomic", disk_full)
    assert write_rank_error(tmp_path, 1, "wattgate train: checkpoint step-40: No space left on device", 2)
    assert json.loads(rank_error_path(tmp_path, 1).read_text())["error"].endswith("No space left on device")
    assert not write_rank_error(tmp_path, 1, "again: the spare is used up", 2)  # no room left: best effort, False

"""Snakemake retries the train job (cluster.slurm.train.max_jobs - 1 times): a retry resumes a run that stopped at
its time limit or lost a rank with its node, and ends at once after a failure a retry would repeat (a rank's own
error: a non-finite loss, a full disk), naming that failure, instead of training to it again."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
    record_outcome(run, 3, Outcome(2, "rank 0: No space left on device (exit 2)", retry=False))
    record = json.loads((run / ATTEMPT_OUTCOME).read_text())
    assert record["attempt"] == 3 and record["exit_status"] == 2 and record["retry"] is False
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

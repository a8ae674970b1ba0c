"""The proof's shortcuts for gate time (issue 31, item 6) record exactly what the plain dry run records.

- Replay: a train step's body with the same micro-batch shapes, a validation pass, and a pass's forwards from
  the second on run once per rank with the Trainer's own code and are replayed afterwards;
- workers: the ranks' dry runs spread over forked processes, one per usable core; rank 1 takes what rank 0 sent
  (proof/relay.py) whichever process runs it."""

import dataclasses
import time

import pytest

from wattgate.proof.classes import classes_by_rank, first_steps
from wattgate.proof.dryrun import dry_run_rank
from wattgate import forking
from wattgate.proof import workers
from wattgate.proof.workers import run_tasks
from wattgate.run_files import read_plan
from wattgate.train.rank_inputs import Paths


@pytest.mark.parametrize("rank", [0, 1])
def test_a_replayed_dry_run_records_what_running_every_step_records(proof_run, tmp_path, rank):
    pretokenized, plan_dir, config = proof_run
    plan, _ = read_plan(plan_dir)
    steps = first_steps(classes_by_rank(plan, plan_dir, config.train))
    relay = tmp_path / "relay"
    if rank:  # what rank 0 sends (the resume choice, DCP's plans) reaches rank 1 through rank 0's relay
        dry_run_rank(config, Paths(pretokenized, plan_dir, tmp_path / "rank-0"), 0, steps, 2, relay=relay)
    records = [
        dry_run_rank(config, Paths(pretokenized, plan_dir, tmp_path / str(replay)), rank, steps, 2, replay, relay=relay)
        for replay in (False, True)
    ]
    ran, replayed = (dataclasses.asdict(r) for r in records)
    assert ran == replayed
    assert len(steps) >= 4 and all(ran["steps"][g] for g in steps) and ran["stop"]
    assert ran["resume"] and ran["resume_step"] == plan.steps_per_epoch * config.train.epochs


def test_dry_runs_in_worker_processes_return_what_the_gate_process_computes(proof_run, tmp_path):
    pretokenized, plan_dir, config = proof_run
    plan, _ = read_plan(plan_dir)
    steps = first_steps(classes_by_rank(plan, plan_dir, config.train))
    relay = tmp_path / "relay"
    tasks = [
        (config, Paths(pretokenized, plan_dir, tmp_path / f"r{r}"), r, steps, 2, True, False, relay) for r in (0, 1, 1)
    ]
    here = run_tasks(dry_run_rank, tasks, processes=1)
    relay = tmp_path / "relay-spread"
    tasks = [
        (config, Paths(pretokenized, plan_dir, tmp_path / f"w{r}-{i}"), r, steps, 2, True, False, relay)
        for i, r in enumerate((0, 1, 1))
    ]
    spread = run_tasks(dry_run_rank, tasks, processes=2)  # task 2 in the gate's process, 1 and 3 in a worker
    assert [dataclasses.asdict(r) for r in here] == [dataclasses.asdict(r) for r in spread]
    assert [r.rank for r in spread] == [0, 1, 1]


def boom(x):
    if x == 1:
        raise ValueError("worker broke")
    return x


def test_a_worker_that_fails_fails_the_proof_with_its_reason(monkeypatch):
    monkeypatch.setattr(workers, "fork_allowed", lambda: True)  # fork even if an earlier test left one
    with pytest.raises(ValueError, match="worker broke"):
        run_tasks(boom, [(0,), (1,)], processes=2)
    assert run_tasks(boom, [(0,), (2,), (3,)], processes=2) == [0, 2, 3]


def nap(seconds):
    time.sleep(seconds)
    return seconds


def test_a_worker_that_does_not_answer_is_ended_and_named(monkeypatch):
    monkeypatch.setattr(workers, "WAIT_MIN_S", 0.5)
    monkeypatch.setattr(workers, "fork_allowed", lambda: True)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"a dry-run worker \(task 2 of 2\) did not finish within 0 s"):
        run_tasks(nap, [(0,), (30,)], processes=2)
    assert time.perf_counter() - t0 < 10


def test_no_worker_is_forked_while_another_python_thread_runs():
    """A fork copies the locks other threads hold: with another Python thread running, the dry runs stay in the
    gate's process."""
    import os
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not forking.fork_allowed()
        assert run_tasks(os.getpid, [(), (), ()], processes=2) == [os.getpid()] * 3
    finally:
        stop.set()
        thread.join()


FORK_AFTER_OPENMP = """
import torch
from wattgate.proof.workers import run_tasks

torch.set_num_threads(2)
a = torch.randn(1500, 1500)
(a @ a).sum()  # this process's OpenMP pool has run


def real_op(n):
    z = torch.randn(n, n)
    return int((z @ z).shape[0])


print(run_tasks(real_op, [(300,), (301,)], processes=2))
"""


def test_a_worker_forked_after_the_gate_used_its_openmp_pool_runs_torch_ops():
    """libgomp is not fork-safe: a child entering the pool its parent used hangs for good. Workers run torch ops on
    one thread, so they never enter it (without that, this run hangs until the timeout)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_OPENMP], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[300, 301]"

"""A stop on request (SIGTERM from a time limit or preemption, SIGUSR1, or STOP_REQUESTED in the run folder):
every rank agrees at the same step, a checkpoint is published, STOPPED says where, and a rerun finishes the
run bitwise equal to one that never stopped, losing no step. Non-finite losses and weights stop the run before
anything non-finite is written."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import yaml

from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.pack.plan import build_plan
from wattgate.run_files import STOP_REQUEST, STOPPED
from conftest import TINY


def cpu_run(tmp: Path, gpus: int = 2, **train) -> dict:
    """Pretokenized data, a plan and a config file for a CPU run of the tiny Qwen3 on `gpus` ranks."""
    lengths = np.random.default_rng(1).integers(5, 60, 300).tolist()
    write_random_pretokenized(tmp / "pretokenized", lengths, 96, 0, shard_docs=7, validation_fraction=0.1)
    settings = dict(seq_len=64, micro_batch_size=1, grad_accum=2, epochs=2, warmup_steps=0, lr=1e-2, log_every=1)
    settings.update(checkpoint_every=5, eval_every=4)
    settings.update(train)
    config = run_config(
        {"run_name": "t", "train": settings, "model": {"config": TINY}, "cluster": {"nodes": 1, "gpus_per_node": gpus}}
    )
    build_plan(config, tmp / "pretokenized", tmp / "plan")
    (tmp / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    return config


def train_argv(tmp: Path, out: Path, gpus: int = 2) -> list[str]:
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"),
        *("-m", "wattgate", "train", "--config", str(tmp / "config.yaml")),
        *("--pretokenized", str(tmp / "pretokenized"), "--plan", str(tmp / "plan"), "--run-dir", str(out)),
    ]


def rank_program_argv(tmp: Path, out: Path, program: str = "train_with_nan_loss.py") -> list[str]:
    """train_argv with a tests/dist/ script as each rank's program (train_with_nan_loss.py: a NaN injected at
    WATTGATE_TEST_NAN_AT; train_stop_in_eval.py: a stop inside a validation pass)."""
    argv = train_argv(tmp, out)
    at = argv.index("-m", 3)
    return argv[:at] + [str(Path(__file__).with_name("dist") / program)] + argv[at + 3 :]


def run_to_end(tmp: Path, out: Path, expect: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(train_argv(tmp, out), capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def heartbeat_step(out: Path, rank: int) -> int:
    try:
        return int(json.loads((out / "heartbeat" / f"rank-{rank}.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def wait_for(condition, job: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "final").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run that was never stopped: what every stopped-and-resumed run must equal bit for bit."""
    tmp = tmp_path_factory.mktemp("stop")
    cpu_run(tmp)
    run_to_end(tmp, tmp / "straight")
    return tmp, tmp / "straight"


def stopped_then_resumed(tmp: Path, out: Path, ask) -> dict:
    """Start the run, ask it to stop (`ask(job, out)`) once step 3 is behind it, check the stop, rerun to the end."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        train_argv(tmp, out), env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_for(lambda: heartbeat_step(out, 1) >= 3, job, "step 3")
        ask(job, out)
        log = job.communicate(timeout=300)[0].decode(errors="replace")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    stopped = json.loads((out / STOPPED).read_text())
    assert not (out / "TRAINED").exists(), log[-2000:]
    assert (out / "checkpoints" / f"step-{stopped['step']}" / "state.json").exists()
    assert f"stopped at step {stopped['step']}" in log
    (out / STOP_REQUEST).unlink(missing_ok=True)  # launch removes it before the next attempt
    run_to_end(tmp, out)
    summary = json.loads((out / "TRAINED").read_text())
    assert summary["resumed_from_step"] == stopped["step"]  # no step lost, none repeated
    return stopped


def assert_same_run(a: Path, b: Path) -> None:
    cols = ["step", "rank", "loss", "tokens"]
    assert (
        pq.read_table(a / "metrics.parquet", columns=cols).to_pylist()
        == pq.read_table(b / "metrics.parquet", columns=cols).to_pylist()
    )
    ecols = ["step", "loss", "tokens"]
    assert (
        pq.read_table(a / "eval.parquet", columns=ecols).to_pylist()
        == pq.read_table(b / "eval.parquet", columns=ecols).to_pylist()
    )
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigterm_to_the_job_stops_at_an_agreed_step_and_a_rerun_is_bitwise_equal(straight):
    tmp, done = straight
    out = tmp / "sigterm"
    stopped = stopped_then_resumed(tmp, out, lambda job, _: os.killpg(job.pid, signal.SIGTERM))
    assert stopped["reason"] == "SIGTERM"
    assert_same_run(done, out)


def test_a_stop_request_file_is_a_request_and_signals_are_noted_not_acted_on(tmp_path):
    """The file is how a request reaches ranks on other nodes (launch writes it); a signal only notes one."""
    import wattgate.train.stop as stop

    request = stop.StopRequest(tmp_path)
    assert request.reason() is None
    (tmp_path / STOP_REQUEST).write_text("{}")
    assert request.reason() == STOP_REQUEST
    (tmp_path / STOP_REQUEST).write_text('{"reason": "the Slurm job\'s time limit in 25 s"}')  # as launch writes it
    assert request.reason() == "STOP_REQUESTED: the Slurm job's time limit in 25 s"
    previous = {sig: signal.getsignal(sig) for sig in stop.STOP_SIGNALS}
    try:
        stop.install_stop_signals(grace_s=300)
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to this (main) thread before kill returns
        os.kill(os.getpid(), signal.SIGTERM)  # the same request again, within the grace: noted, not acted on
        os.kill(os.getpid(), signal.SIGINT)
        assert request.reason() == "SIGUSR1"
    finally:
        stop._signalled.clear()
        stop._first_at.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_only_a_sigterm_or_sigint_after_the_grace_ends_a_rank_at_once():
    from wattgate.train.stop import insists

    assert not insists(signal.SIGTERM, None, 100.0, 300)  # the first request
    assert not insists(signal.SIGTERM, 100.0, 399.0, 300)  # again within the grace: the same request
    assert insists(signal.SIGTERM, 100.0, 401.0, 300) and insists(signal.SIGINT, 100.0, 401.0, 300)
    assert not insists(signal.SIGUSR1, 100.0, 10_000.0, 300)  # a USR1 only ever asks


def test_sigusr1_on_one_rank_alone_stops_every_rank_at_the_same_step(straight):
    tmp, done = straight
    out = tmp / "one-rank"

    def signal_rank_1(_, run: Path) -> None:
        pid = json.loads((run / "heartbeat" / "rank-1.json").read_text())["pid"]
        os.kill(pid, signal.SIGUSR1)

    stopped = stopped_then_resumed(tmp, out, signal_rank_1)
    assert stopped["reason"] == "a stop requested on rank 1"  # rank 0 writes STOPPED: it learned it from rank 1
    assert_same_run(done, out)


def test_a_stop_inside_a_validation_pass_redoes_the_pass_on_resume_and_stays_bitwise_equal(straight):
    tmp, done = straight
    out = tmp / "in-eval"
    env = dict(os.environ, OMP_NUM_THREADS="1", WATTGATE_TEST_STOP_IN_EVAL="8")  # eval_every 4: a pass after step 8
    first = subprocess.run(
        rank_program_argv(tmp, out, "train_stop_in_eval.py"), capture_output=True, text=True, env=env
    )
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = json.loads((out / STOPPED).read_text())
    assert stopped["step"] == 8 and "inside the validation pass" in stopped["reason"]
    state = json.loads((out / "checkpoints/step-8/state.json").read_text())
    assert state["position"]["eval_pending"] is True and "eval_loss" not in state["position"]
    assert 8 not in [r["step"] for r in pq.read_table(out / "eval.parquet", columns=["step"]).to_pylist()]
    run_to_end(tmp, out)
    assert_same_run(done, out)  # the pass after step 8 was redone first: every validation row once, the same


# ---------------------------------------------------------------- non-finite state


def test_a_nan_loss_stops_before_the_update_naming_step_rank_and_documents(tmp_path):
    cpu_run(tmp_path, epochs=1, checkpoint_every=2)
    out = tmp_path / "nan"
    env = dict(os.environ, OMP_NUM_THREADS="1", WATTGATE_TEST_NAN_AT="5:1")
    proc = subprocess.run(
        rank_program_argv(tmp_path, out),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    line = next(x for x in proc.stderr.splitlines() if "non-finite" in x)
    assert "step 5: non-finite loss on rank 1" in line and "documents [" in line and "rank 0 micro" not in line
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*") if p.suffix != ".tmp")
    assert steps and max(steps) <= 4  # nothing after the non-finite step was checkpointed
    assert not (out / "final").exists() and not (out / "TRAINED").exists()


def test_skip_step_drops_the_non_finite_update_and_finishes(tmp_path):
    cpu_run(tmp_path, epochs=1, checkpoint_every=100, on_nonfinite="skip_step", nonfinite_skip_limit=2)
    out = tmp_path / "skip"
    env = dict(os.environ, OMP_NUM_THREADS="1", WATTGATE_TEST_NAN_AT="5:0")
    proc = subprocess.run(
        rank_program_argv(tmp_path, out),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update skipped (1 of at most 2" in proc.stderr
    summary = json.loads((out / "TRAINED").read_text())
    assert summary["nonfinite_skipped_steps"] == 1
    assert all(torch.isfinite(t).all() for t in final_weights(out).values())


# ---------------------------------------------------------------- the collective proof covers the stop


def test_the_proof_dry_runs_the_stop_path_and_names_a_rank_that_diverges_there(tmp_path, monkeypatch):
    from wattgate.proof.prove import prove_collectives
    from wattgate.train import loop

    config = cpu_run(tmp_path, epochs=1)
    clean = prove_collectives(config, tmp_path / "pretokenized", tmp_path / "plan").to_json()
    assert clean["passed"] and clean["stop"]["collectives"] > 0 and "graceful stop" in clean["detail"]

    original = loop.Trainer.finish_stopped

    def finish_stopped(self, step, epoch, reason):
        if self.rank == 1:
            dist.barrier()  # a rank-1-only collective on the stop path
        return original(self, step, epoch, reason)

    monkeypatch.setattr(loop.Trainer, "finish_stopped", finish_stopped)
    report = prove_collectives(config, tmp_path / "pretokenized", tmp_path / "plan").to_json()
    assert not report["passed"] and report["divergence"]["rank"] == 1
    assert report["divergence"]["phase"] == "graceful stop" and "rank 1 diverges" in report["detail"]


def test_an_abort_request_ends_a_rank_blocked_outside_python_within_seconds(tmp_path):
    """The watcher's kill of a hung job: a rank blocked in C code (as in a collective) runs no signal handler, but
    its abort thread sees ABORT_REQUESTED and ends the process."""
    from wattgate.run_files import ABORT_REQUEST

    code = (
        "import sys, threading; from pathlib import Path; from wattgate.train.stop import start_abort_watch;"
        "start_abort_watch(Path(sys.argv[1]), poll_s=0.05); print('ready', flush=True);"
        "threading.Event().wait()"  # blocked in C with the GIL released, as a gloo or NCCL wait is
    )
    rank = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        (tmp_path / ABORT_REQUEST).write_text("{}")
        assert rank.wait(timeout=60) == -signal.SIGKILL
    finally:
        if rank.poll() is None:
            rank.kill()


def test_the_abort_watch_ends_when_the_rank_is_done_with_its_collectives(tmp_path):
    """No thread is left polling the run folder while the interpreter shuts down."""
    from wattgate.train.stop import start_abort_watch, stop_abort_watch

    watch = start_abort_watch(tmp_path, poll_s=0.05)
    assert watch.thread.is_alive()
    stop_abort_watch(watch)
    assert not watch.thread.is_alive()

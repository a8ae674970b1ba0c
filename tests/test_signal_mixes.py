"""A stop signal reaches a train job however it is sent. scancel, preemption and a time limit without `--signal`
signal every process of the job (the rule's shell and tee, launch, the sampler, torchrun, the ranks, the watcher),
torchrun passes its own on to its ranks, and a person signals one process, or presses Ctrl-C twice. Every mix of
SIGTERM, SIGUSR1 and SIGINT, sent once or repeatedly within the stop margin, to any subset holding one of wattgate's
processes, at a random step or while a checkpoint is written, ends in a graceful stop: a checkpoint at the step
every rank agreed on, exit 75 through the rule's shell, watcher.json saying stopped, and no traceback.

The real chain on 2 gloo ranks, run as the train rule runs it (workflow/rules/common.smk: the shell ignores the
stop signals, launch's output through tee). Each mix resumes the run the previous one stopped.
WATTGATE_SIGNAL_MIXES sets how many mixes (3 here; 50 for the measurement in the closing note)."""

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import TINY, command_line, fake_pretokenized, process_tree
from wattgate.config import run_config
from wattgate.errors import EXIT_STOPPED
from wattgate.pack.plan import build_plan

BIN = Path(sys.executable).parent
MIXES = int(os.environ.get("WATTGATE_SIGNAL_MIXES", "3"))
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
WATTGATE_PROCESSES = ("launch", "sampler", "torchrun", "rank 0", "rank 1")


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
    """A plan far longer than the mixes need, its gate passed, and the rule's shell command for its launch."""
    tmp = tmp_path_factory.mktemp("signals")
    fake_pretokenized(tmp / "pretokenized", [40] * 4000)
    train = {"seq_len": 64, "micro_batch_size": 1, "grad_accum": 2, "epochs": 1, "warmup_steps": 0, "log_every": 1}
    train.update(checkpoint_every=2, eval_every=0, lr=1e-2)
    config = run_config(
        {
            "run_name": "t",
            "train": train,
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "gate": {"collectives": False},
            "watcher": {"startup_after_s": 600, "hang_after_s": 120},
        }
    )
    build_plan(config, tmp / "pretokenized", tmp / "plan")
    (tmp / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    gate = [str(BIN / "wattgate"), "gate", "--config", str(tmp / "config.yaml")]
    gate += ["--pretokenized", str(tmp / "pretokenized"), "--plan", str(tmp / "plan"), "--out", str(tmp / "gate")]
    proc = subprocess.run(gate, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp / "run"
    launch = [str(BIN / "wattgate"), "launch", "--config", str(tmp / "gate" / "config.yaml")]
    launch += ["--pretokenized", str(tmp / "pretokenized"), "--plan", str(tmp / "plan"), "--run-dir", str(run)]
    log = tmp / "train.log"
    # as the train rule's shell (workflow/rules/common.smk STAGE_SHELL["launch"])
    shell = f"set -euo pipefail; trap '' TERM INT USR1; {shlex.join(launch)} 2>&1 | tee -a {shlex.quote(str(log))}"
    return run, shell, log


def role(pid: int, cmd: list[str], run: Path) -> str | None:
    """What a process of the job is, from its command line (a rank from its heartbeat's pid)."""
    if not cmd:
        return None
    program = Path(cmd[0]).name
    if program in ("tee", "bash"):
        return {"tee": "tee", "bash": "shell"}[program]
    for r in (0, 1):
        if beat(run, r).get("pid") == pid:
            return f"rank {r}"
    # `python -m MODULE [COMMAND]` or the console script `wattgate COMMAND`
    at = (
        cmd.index("-m") + 1 if "-m" in cmd else next((i for i, a in enumerate(cmd) if Path(a).name == "wattgate"), None)
    )
    if at is None or at >= len(cmd):
        return None
    if cmd[at] == "wattgate.train.torchrun":
        return "torchrun"
    command = cmd[at + 1] if Path(cmd[at]).name == "wattgate" and at + 1 < len(cmd) else None
    return {"launch": "launch", "sample": "sampler", "watch": "watcher"}.get(command)


def job_processes(root: int, run: Path) -> dict[str, int]:
    found = {}
    for pid in process_tree(root):
        name = role(pid, command_line(pid), run)
        if name is not None and name not in found:
            found[name] = pid
    return found


def beat(run: Path, rank: int) -> dict:
    try:
        return json.loads((run / "heartbeat" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(condition, job: subprocess.Popen, what: str, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.01)
    return value


def a_mix(rng: random.Random) -> tuple[str, list[tuple[str, int]]]:
    """(when, [(process, signal), ...] in delivery order): every process (as scancel does) a third of the time,
    else a random subset holding at least one of wattgate's processes; each signal sent 1 to 3 times."""
    everyone = ("shell", "tee", "watcher") + WATTGATE_PROCESSES
    if rng.random() < 1 / 3:
        targets = list(everyone)
    else:
        targets = rng.sample(everyone, rng.randint(1, len(everyone)))
        if not set(targets) & set(WATTGATE_PROCESSES):
            targets.append(rng.choice(WATTGATE_PROCESSES))
    deliveries = [(t, rng.choice(SIGNALS)) for t in targets for _ in range(rng.randint(1, 3))]
    rng.shuffle(deliveries)
    return rng.choice(("step", "checkpoint")), deliveries


def deliver(processes: dict[str, int], deliveries, rng: random.Random) -> None:
    for name, signum in deliveries:
        try:
            os.kill(processes[name], signum)
        except (KeyError, ProcessLookupError):
            pass  # a process that has gone (or never ran: a rank's heartbeat not yet read)
        time.sleep(rng.uniform(0, 0.2))  # repeats spread as scancel's and torchrun's do


def test_every_mix_of_stop_signals_to_the_job_ends_in_a_graceful_stop(gated_run):
    run, shell, log = gated_run
    failures = []
    for i in range(MIXES):
        rng = random.Random(1000 + i)
        when, deliveries = a_mix(rng)
        mark = log.stat().st_size if log.exists() else 0
        job = subprocess.Popen(["bash", "-c", shell], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            start = wait_for(lambda: beat(run, 0).get("phase") == "train" and beat(run, 1), job, "a first step")
            at = int(start.get("step", 0)) + rng.randint(1, 3)
            if when == "checkpoint":
                wait_for(lambda: beat(run, 0).get("phase") == "checkpoint", job, "a checkpoint being written")
            else:
                wait_for(lambda at=at: int(beat(run, 0).get("step", 0)) >= at, job, f"step {at}")
            deliver(job_processes(job.pid, run), deliveries, rng)
            rc = job.wait(timeout=300)
        finally:
            if job.poll() is None:
                for pid in reversed(process_tree(job.pid)):
                    os.kill(pid, signal.SIGKILL)
                job.wait()
        text = log.read_text(errors="replace")[mark:]
        mix = f"mix {i} ({when}: {', '.join(f'{n} {signal.Signals(s).name}' for n, s in deliveries)})"
        problems = []
        if rc != EXIT_STOPPED:
            problems.append(f"exit {rc}")
        if "Traceback" in text:
            problems.append("a traceback")
        try:
            stopped = json.loads((run / "STOPPED").read_text())
            if not (run / "checkpoints" / f"step-{stopped['step']}").is_dir():
                problems.append(f"no checkpoint at the stop step {stopped['step']}")
        except (OSError, ValueError):
            problems.append("no STOPPED")
        try:
            verdict = json.loads((run / "watcher.json").read_text())["verdict"]
        except (OSError, ValueError, KeyError):
            verdict = "none"
        if verdict != "stopped":
            problems.append(f"watcher verdict {verdict}")
        if problems:
            failures.append(f"{mix}: {', '.join(problems)}\n{text[-1500:]}")
    assert not failures, f"{len(failures)} of {MIXES} mixes did not stop gracefully:\n" + "\n".join(failures)

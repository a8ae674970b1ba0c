"""Failures named (issue 30, point 5), on real runs: 2 gloo ranks under `wattgate launch` with a tiny Qwen3.
A SIGKILLed rank, a full disk while checkpointing and a stopped rank each end with one line from launch naming the
rank and the cause, and watcher.json says the same (a dead rank's verdict was "healthy", a full disk's stayed
"running"); a rerun of the train rule keeps the log of the attempt before it."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from wattgate.artifacts import claim_stage_output
from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan
from conftest import TINY

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """Pretokenized data, a plan and the gate's pass for 2 CPU ranks: 3 epochs of 40 steps, a checkpoint every 2."""
    tmp = tmp_path_factory.mktemp("gated")
    write_random_pretokenized(tmp / "pretokenized", [40] * 320, 96, 0, shard_docs=7)
    train = {"seq_len": 64, "micro_batch_size": 1, "grad_accum": 2, "epochs": 3, "warmup_steps": 0}
    train.update(checkpoint_every=2, lr=1e-2, log_every=1)
    config = run_config(
        {
            "run_name": "t",
            "train": train,
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "telemetry": {"enabled": True},  # no GPU here: each node's sampler wraps torchrun and writes an empty trace
            "watcher": {"hang_after_s": 8, "poll_s": 0.5, "kill_grace_s": 2},
            "forecast": {"ledger": str(tmp / "throughput.jsonl")},
        }
    )
    build_plan(config, tmp / "pretokenized", tmp / "plan")
    (tmp / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    report = run_gate(config, tmp / "pretokenized", tmp / "plan", tmp / "gate").to_json()
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    return tmp


def launch(gated: Path, out: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "wattgate", "launch", "--config", str(gated / "config.yaml")]
    argv += [
        "--pretokenized",
        str(gated / "pretokenized"),
        "--plan",
        str(gated / "plan"),
        "--gate",
        str(gated / "gate"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        argv + ["--run-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def beat(out: Path, rank: int) -> dict:
    try:
        return json.loads((out / "heartbeat" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def training(proc, out: Path, rank: int, step: int, wait_until) -> dict:
    """rank's heartbeat once it is in a training step after `step` (the job still running)."""

    def there():
        b = beat(out, rank)
        return proc.poll() is not None or (b.get("phase") == "train" and b.get("step", -1) >= step and b)

    found = wait_until(there, 300, f"rank {rank} training past step {step}")
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    return found


def ended(proc, timeout_s: float = 300) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"launch did not end: {proc.communicate()[0][-3000:]}") from None
    return output


def launch_line(output: str) -> str:
    lines = [x for x in output.splitlines() if x.startswith("wattgate launch: ")]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_killed_rank_is_named_with_its_signal(gated, tmp_path, wait_until):
    out = tmp_path / "run"
    proc = launch(gated, out)
    pid = training(proc, out, 1, 2, wait_until)["pid"]
    os.kill(pid, signal.SIGKILL)
    output = ended(proc)
    assert proc.returncode == 1, output[-3000:]
    line = launch_line(output)
    assert line.startswith(f"wattgate launch: failed: rank 1 (pid {pid} on {socket.gethostname()}) died: ")
    assert "killed by SIGKILL (signal 9)" in line and "the OOM killer or a kill -9" in line
    verdict = json.loads((out / "watcher.json").read_text())
    assert verdict["verdict"] == "failed" and verdict["failed_rank"] == 1, verdict.get("reason")
    assert verdict["cause"] == "killed by SIGKILL (signal 9)" and verdict["job_end"]["returncode"] == 1
    assert not (out / "TRAINED").exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root in a namespace that allows it)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_is_exit_2_with_one_line_and_a_verdict(gated, tmp_path, small_tmpfs):
    """The checkpoints live on a 64 KiB filesystem (the run folder's `checkpoints` links there), so the first
    checkpoint fills it; the rest of the run folder has room for the records that name the failure."""
    out = tmp_path / "run"
    claim_stage_output(out, "train")
    (out / "checkpoints").symlink_to(small_tmpfs)
    proc = launch(gated, out)
    output = ended(proc)
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    line = launch_line(output)
    assert line.startswith("wattgate launch: error: rank ") and " writing the checkpoint of step 2: " in line, line
    assert "No space left on device" in line and "(exit 2)" in line and "step-2.tmp" in line
    verdict = json.loads((out / "watcher.json").read_text())
    assert verdict["verdict"] == "failed" and "No space left on device" in verdict["reason"]
    assert verdict["job_end"]["failure"]["exit_status"] == 2


@pytest.mark.slow
def test_a_stopped_rank_is_named_in_the_watchers_line(gated, tmp_path, wait_until):
    out = tmp_path / "run"
    proc = launch(gated, out)
    pid = training(proc, out, 1, 2, wait_until)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        output = ended(proc)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1, output[-3000:]
    line = launch_line(output)
    assert line.startswith("wattgate launch: failed: watcher stopped the job: deadlock: "), line
    assert f"rank 1 (pid {pid}) stopped (state T) at step " in line, line
    verdict = json.loads((out / "watcher.json").read_text())
    assert verdict["verdict"] == "deadlock" and verdict["stuck_ranks"] == [1], verdict["reason"]


@pytest.mark.slow
def test_a_rerun_of_the_train_rule_keeps_the_earlier_attempts_log(tmp_path):
    """A rerun of the train rule: train.log holds only the new attempt, train.attempts.log every attempt, each under
    launch's header (launch writes both; the rule's own log, which Snakemake deletes first, is logs/train/<run>.log)."""
    import shutil

    for part in ("Snakefile", "workflow", "config"):
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy)(REPO / part, tmp_path / part)
    small = tmp_path / "small.yaml"
    small.write_text(
        yaml.safe_dump(
            {
                "demo_corpus": {"num_docs": 300},
                "tokenizer": {"vocab_size": 512},
                "train": {"seq_len": 256, "epochs": 1, "checkpoint_every": 5, "eval_every": 0, "log_every": 1},
                "model": {"config": {"vocab_size": 512}},
                "telemetry": {"enabled": False},
            }
        )
    )

    def snakemake(*args, more=()):
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        argv = [str(BIN / "snakemake"), "--cores", "2", "results/train/demo/TRAINED", *args, "--configfile", str(small)]
        argv += map(str, more)  # config files after small.yaml: their keys win
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    snakemake()
    snakemake("--forcerun", "train")
    run = tmp_path / "results/train/demo"
    attempts = (run / "train.attempts.log").read_text()
    first, second = attempts.index("launch: attempt 1 at "), attempts.index("launch: attempt 2 at ")
    assert first < attempts.index("train: step 1/") < second, attempts[:3000]
    log = (run / "train.log").read_text()
    assert log.startswith("launch: attempt 2 at ") and "launch: attempt 1" not in log and "train: step 1/" not in log
    # the attempt recorded is the one printed (Snakemake's own try is 1 again on a person's rerun)
    outcome = json.loads((run / "attempt-outcome.json").read_text())
    assert outcome["attempt"] == 2 and outcome["snakemake_try"] == 1 and outcome["exit_status"] == 0
    # each job of the rule keeps its own log under logs/ (the rule's log is the latest job's)
    logs = tmp_path / "logs/train"
    jobs = [(logs / f"demo.job-{n}.log").read_text() for n in (1, 2)]
    assert "launch: attempt 1 at " in jobs[0] and "launch: attempt 2 at " not in jobs[0], jobs[0][-2000:]
    assert "launch: attempt 2 at " in jobs[1] and (logs / "demo.log").read_text() == jobs[1]

    # another learning rate is another run: the earlier run's records move aside whole, and the report is the new one's
    lr = tmp_path / "lr.yaml"
    lr.write_text("train:\n  lr: 0.0005\n")
    snakemake(more=[lr])
    [previous] = [p for p in run.parent.iterdir() if p.name.startswith("demo.previous-")]
    assert "launch: attempt 2 at " in (previous / "train.attempts.log").read_text()
    log = (run / "train.log").read_text()
    assert log.startswith(
        f"launch: {run.relative_to(tmp_path)} held a run of another configuration (it differs in train.lr"
    )
    assert "launch: attempt 1 at " in log and "launch: attempt 1 at " in (run / "train.attempts.log").read_text()
    assert "attempt 2" not in (run / "train.attempts.log").read_text()
    first_steps = pq.read_table(previous / "metrics.parquet").column("time").to_pylist()
    new_steps = pq.read_table(run / "metrics.parquet").column("time").to_pylist()
    assert min(new_steps) > max(first_steps)  # the new run's metrics hold only its own steps


@pytest.mark.slow
def test_a_rank_killed_on_another_node_is_named_from_that_nodes_record(tmp_path, wait_until):
    """Two nodes as srun starts them (each runs launch's own per-node command: its sampler around the recording
    torchrun), here on one host without Slurm: the rank killed on the second node is named from the record its
    agent wrote; the first node's rank fails after it, or its agent loses the rendezvous store first."""
    from wattgate.telemetry.failures import name_failure
    from wattgate.train.launch import build_launch_command, resolve_launch, train_args

    write_random_pretokenized(tmp_path / "pretokenized", [40] * 320, 96, 0, shard_docs=7)
    train = {"seq_len": 64, "micro_batch_size": 1, "grad_accum": 2, "epochs": 3, "warmup_steps": 0, "log_every": 1}
    cluster = {"nodes": 2, "gpus_per_node": 1, "launcher": "slurm", "rendezvous_host": "127.0.0.1"}
    config = run_config({"run_name": "t", "train": train, "model": {"config": TINY}, "cluster": cluster})
    build_plan(config, tmp_path / "pretokenized", tmp_path / "plan")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    out = tmp_path / "run"
    job = str(1000 + os.getpid() % 9000)  # the rendezvous port derives from it: apart from other runs on this host
    spec = resolve_launch(config, {"SLURM_JOB_ID": job})
    args = train_args(tmp_path / "config.yaml", tmp_path / "pretokenized", tmp_path / "plan", out)
    argv = build_launch_command(spec, args, sample=(str(out / "telemetry" / "{host}.parquet"), 0.5), run=out)
    assert argv[0] == "srun" and argv[-2] == "-c"
    nodes = [
        subprocess.Popen(
            ["bash", "-c", argv[-1]],
            env=dict(os.environ, OMP_NUM_THREADS="1", SLURMD_NODENAME=f"n{i + 1}", SLURM_NODEID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        b = wait_until(
            lambda: beat(out, 1).get("phase") == "train" and beat(out, 1).get("step", 0) >= 2 and beat(out, 1)
        )
        os.kill(b["pid"], signal.SIGKILL)
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode != 0 for node in nodes)
    assert any(
        f"torchrun: rank 1 (local rank 0, pid {b['pid']}) failed: killed by SIGKILL (signal 9)" in o for o in outputs
    )
    # the first node's agent may instead lose the rendezvous store the second one hosted: no record of its own then
    assert (out / "heartbeat" / "exit-rank-1.json").exists()
    failure = name_failure(out)
    assert failure.rank == 1 and failure.cause == "killed by SIGKILL (signal 9)" and set(failure.others) <= {0}, failure
    assert failure.line.startswith(f"rank 1 (pid {b['pid']} on {socket.gethostname()}) died: killed by SIGKILL")

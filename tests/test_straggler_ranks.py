"""A straggler rank without power data (issue 34): each rank's CPU time from /proc says who the others wait for.
A rank blocked in a gloo collective uses ~0 of a core, a computing one ~1, so the rank still busy while the
others idle is the one they wait for. The watcher warns about it once, live, and never stops the job; triage
and the report name it after the run. End to end on 2 real CPU ranks, one slowed by tests/dist's wrapper; the
rest on the watcher's interval rule alone."""

import json
import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import yaml

from wattgate.cli import main
from wattgate.config import load_run_config, run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.gate.cost import last_run_wait
from wattgate.ledger import read_ledger
from wattgate.model_spec import load_model_spec
from wattgate.pack.plan import build_plan
from wattgate.records.heartbeat import Beat
from wattgate.telemetry.lag_watch import LagWatch, busy_from_samples
from conftest import TINY

SLOW_RANK = Path(__file__).with_name("dist") / "wattgate_train_slow_rank.py"


def slowed_run(tmp: Path, steps: int = 30, spin_s: float = 0.25) -> tuple[Path, int]:
    """What `wattgate launch` runs for a 2-rank CPU job, with rank 1 slowed: each node's torchrun under its
    sampler (no NVML here: an empty trace), and the watcher beside it writing into the same train.log."""
    lengths = np.random.default_rng(1).integers(5, 60, 300).tolist()
    write_random_pretokenized(tmp / "pretokenized", lengths, 96, 0, shard_docs=7)
    train = dict(seq_len=64, micro_batch_size=1, grad_accum=2, epochs=1, warmup_steps=0, lr=1e-2, log_every=10)
    train.update(checkpoint_every=1000, max_steps=steps)
    config = run_config(
        {
            "run_name": "t",
            "train": train,
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "watcher": {"poll_s": 0.5},
            "forecast": {"ledger": str(tmp / "throughput.jsonl")},
        }
    )
    build_plan(config, tmp / "pretokenized", tmp / "plan")
    (tmp / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    out = tmp / "run"
    out.mkdir()
    py = sys.executable
    job = [py, "-m", "wattgate", "sample", "--out", str(out / "telemetry" / "{host}.parquet"), "--"]
    job += [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SLOW_RANK)]
    job += ["--config", str(tmp / "config.yaml"), "--pretokenized", str(tmp / "pretokenized")]
    job += ["--plan", str(tmp / "plan"), "--run-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", WATTGATE_TEST_SLOW_RANK="1", WATTGATE_TEST_SLOW_S=str(spin_s))
    with open(out / "train.log", "ab") as log:
        proc = subprocess.Popen(job, stdout=log, stderr=log, env=env, start_new_session=True)
        watch = [py, "-m", "wattgate", "watch", "--config", str(tmp / "config.yaml"), "--run-dir", str(out)]
        watcher = subprocess.Popen([*watch, "--pid", str(proc.pid)], stdout=log, stderr=log, env=env)
        try:
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            watcher.send_signal(signal.SIGTERM)  # launch's "the job has ended"
            watcher.wait(timeout=60)
    return out, rc


def test_a_slowed_cpu_rank_is_warned_once_live_and_named_by_triage_and_the_report(tmp_path):
    out, rc = slowed_run(tmp_path)
    log = (out / "train.log").read_text()
    assert rc == 0, log[-3000:]
    warnings = [line for line in log.splitlines() if line.startswith("watch: warning: straggler:")]
    assert len(warnings) == 1 and "rank 1 " in warnings[0] and "never stops the job" in warnings[0], log[-3000:]
    record = json.loads((out / "watcher.json").read_text())
    assert record["verdict"] == "healthy"  # a straggler never stops the job
    (s,) = record["stragglers"]
    assert (s["rank"], s["signal"], s["gpu"]) == (1, "cpu", None) and s["lag_share"] > 0.5 and s["wait_rank_hours"] > 0

    power = tmp_path / "power"
    assert main(["triage", "--trace", str(out / "telemetry"), "--run-dir", str(out), "--out", str(power)]) == 0
    triage = json.loads((power / "triage.json").read_text())
    assert triage["status"] == "no GPU telemetry"
    assert [(e["rank"], e["gpu"], e["source"]) for e in triage["stragglers"]] == [(1, None, "watcher")]
    assert "rank 1" in (power / "triage.md").read_text() or "| 1 |" in (power / "triage.md").read_text()

    report = tmp_path / "report"
    config = ["--config", str(tmp_path / "config.yaml")]
    assert main(["report", *config, "--run-dir", str(out), "--power", str(power), "--out", str(report)]) == 0
    summary = json.loads((report / "summary.json").read_text())
    (e,) = summary["stragglers"]["entries"]
    assert e["rank"] == 1 and summary["stragglers"]["source"] == "watcher: rank CPU time"
    page = (report / "index.html").read_text()
    assert 'id="stragglers"' in page and "rank 1 on" in page
    assert any(a["kind"] == "straggler" and a["ranks"] == [1] for a in summary["anomalies"])

    # the report wrote the time lost to waiting into the run's ledger record; the next run's gate says it
    (rec,) = read_ledger(tmp_path / "throughput.jsonl")
    assert rec.wait_hours == pytest.approx(summary["stragglers"]["wait_rank_hours"]) and rec.wait_hours > 0
    assert rec.wait_source == "watcher: rank CPU time" and 0 < rec.wait_share <= 1
    cfg = load_run_config(tmp_path / "config.yaml")
    wait = last_run_wait(cfg, load_model_spec(cfg))
    assert wait.run_name == "t" and wait.unit == "rank-hours"
    assert "time lost to waiting for stragglers: " in wait.line and "% of its time" in wait.line


# ---------------------------------------------------------------- the watcher's interval rule


def beats(step: int = 5, phase: str = "train", world: int = 2) -> dict:
    return {
        r: Beat(rank=r, host="h", local_rank=r, step=step, phase=phase, pid=100 + r, time=0.0) for r in range(world)
    }


def cpu_history(shares_per_poll: list[dict], poll: float = 1.0) -> list[dict]:
    """Per poll, the ActivityMeter's samples (rank -> (pid, [(time, cpu s, io, state)...])) for these shares."""
    cpu = {r: 0.0 for r in shares_per_poll[0]}
    hist = {r: deque([(0.0, 0.0, 0, "R")]) for r in cpu}
    out = []
    for i, shares in enumerate(shares_per_poll, start=1):
        for r, share in shares.items():
            cpu[r] += share * poll
            hist[r].append((i * poll, cpu[r], 0, "R"))
        out.append({r: (100 + r, deque(h)) for r, h in hist.items()})
    return out


def test_the_watcher_warns_once_for_the_rank_the_others_wait_for():
    lag = LagWatch(None)
    polls = cpu_history([{0: 0.1, 1: 0.95}] * 12)
    found = [lag.observe(beats(), float(i), samples) for i, samples in enumerate(polls, start=0)]
    warned = [f for f in found if f is not None]
    assert len(warned) == 1 and warned[0].rank == 1 and warned[0].signal == "cpu"
    (rec,) = lag.records()
    assert rec.lag_share == 1.0 and rec.lag_windows >= 5 and rec.cause == "unknown"


def test_balanced_ranks_and_ranks_out_of_step_get_no_warning():
    lag = LagWatch(None)
    alternate = [{0: 0.95, 1: 0.1} if i % 2 else {0: 0.1, 1: 0.95} for i in range(40)]
    for i, samples in enumerate(cpu_history(alternate)):
        assert lag.observe(beats(), float(i), samples) is None
    lag = LagWatch(None)
    apart = beats()
    apart[1] = apart[1].replace(step=9)  # out of step: the hang rules' case, not a straggler's
    for i, samples in enumerate(cpu_history([{0: 0.1, 1: 0.95}] * 12)):
        assert lag.observe(apart, float(i), samples) is None
    assert lag.records() == ()


def test_with_power_the_gpu_reasons_name_the_cause():
    """Rank 2's GPU stays above the low band while the others wait at 140 W, with its thermal bits set."""

    class Tail:
        chunks = [True]

        def __init__(self):
            self.t = 0.0

        def busy_shares(self, since, now, low_max_w):
            time_ = np.repeat(np.linspace(since + 0.05, now, 10), 4)
            gpu = np.tile(np.arange(4), 10)
            power = np.where(gpu == 2, 600.0, np.where(np.arange(40) % 10 < 6, 600.0, 140.0))
            reasons = np.where(gpu == 2, 0x20, 0)
            return busy_from_samples(time_, np.full(40, "h", object), gpu, power, reasons, since, now, low_max_w)

    lag = LagWatch(210.0)
    tail = Tail()
    found = [lag.observe(beats(world=4), float(i), {}, tail) for i in range(12)]
    (warned,) = [f for f in found if f is not None]
    assert (warned.rank, warned.gpu, warned.signal, warned.cause) == (2, 2, "power", "thermal")
    assert lag.records()[0].wait_gpu_hours > 0

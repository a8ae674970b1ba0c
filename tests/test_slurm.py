"""`snakemake --profile slurm` on a real two-node Slurm cluster on this host (tests/slurm/start.sh:
slurmctld plus `slurmd -N n1` and `slurmd -N n2`), with tests/slurm/profile as the workflow profile
for what that cluster lacks (slurmdbd). Needs root; the packages are apt-installed when missing."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import REPO, copy_workflow

BIN = Path(sys.executable).parent
SLURM_DIR = REPO / "tests/slurm"
JOB_FIELDS = ["id", "name", "comment", "state", "nodes", "nodelist", "submit", "start", "end"]


# slurmd and its config are one per host: a second test run on this machine (the suite beside another
# full run of it) waits for the first one's cluster to stop, up to this long
OTHER_CLUSTER_WAIT_S = 1200


def _start_cluster(state: Path) -> subprocess.CompletedProcess:
    deadline = time.monotonic() + OTHER_CLUSTER_WAIT_S
    while True:
        start = subprocess.run(
            ["timeout", "-k", "10", "600", "bash", str(SLURM_DIR / "start.sh"), str(state)],
            capture_output=True,
            text=True,
        )
        if start.returncode != 6 or time.monotonic() > deadline:
            return start
        time.sleep(5)  # polling the other run's cluster, within the deadline above


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the Slurm test needs root (slurmd runs the jobs; the config must be /etc/slurm/slurm.conf)")
    state = tmp_path_factory.mktemp("slurm-state")
    start = _start_cluster(state)
    if start.returncode == 4:
        pytest.skip(f"Slurm is not installed and apt cannot install it: {start.stderr.strip()[-400:]}")
    try:
        assert start.returncode == 0, f"start.sh failed ({start.returncode}):\n{start.stdout}{start.stderr}"
        yield state
    finally:
        stop = subprocess.run(
            ["timeout", "-k", "5", "120", "bash", str(SLURM_DIR / "stop.sh"), str(state)],
            capture_output=True,
            text=True,
        )
        print(stop.stdout + stop.stderr)


@pytest.fixture(scope="module")
def slurm_workflow(tmp_path_factory):
    """The embedded default, small (as in test_workflow.py), trained as one job of 2 nodes x 1 CPU rank, with HSDP
    as the docs recommend for several nodes (parallel.replicate auto: a replica per node, sharded within it)."""
    work = tmp_path_factory.mktemp("wf-slurm")
    copy_workflow(work)
    shutil.copytree(REPO / "slurm", work / "slurm")
    shutil.copytree(SLURM_DIR / "profile", work / "tests/slurm/profile")
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["demo_corpus"]["num_docs"] = 400
    config["tokenizer"]["vocab_size"] = 512
    config["train"].update(seq_len=256, micro_batch_size=2, grad_accum=2)
    config["cluster"].update(nodes=2, gpus_per_node=1)
    config["parallel"] = {"replicate": "auto"}
    # job sizes for the test nodes (their CPUs and half the host's memory each)
    config["cluster"]["slurm"] = {
        "train": {"mem_mb": 1500, "runtime_min": 30, "max_jobs": 1},  # a failed train job is not retried
        "cpu": {"cpus": 1, "mem_mb": 2000, "runtime_min": 30},
        "small": {"mem_mb": 2000, "runtime_min": 30},
    }
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    return work


def snakemake_slurm(work: Path, *args: str, limit_s: int = 600) -> subprocess.CompletedProcess:
    # the slurm executor ignores SIGTERM: timeout -k follows up with SIGKILL
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    argv = [
        "timeout",
        "-k",
        "20",
        str(limit_s),
        str(BIN / "snakemake"),
        "--profile",
        "slurm",
        "--workflow-profile",
        "tests/slurm/profile",
        *args,
    ]
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    assert proc.returncode not in (124, 137), f"snakemake ran past {limit_s} s:\n{output(proc)[-4000:]}"
    return proc


def output(proc) -> str:
    return proc.stdout + proc.stderr


def run_id(proc) -> str:
    """The executor names every job of one snakemake run after its run id."""
    return re.search(r"SLURM run ID: (\S+)", output(proc)).group(1)


def rule(job: dict) -> str:
    """The rule a job ran: the executor's comment is rule_<rule>, with _wildcards_<values> for a rule with a run."""
    return job["comment"].split("_wildcards_")[0]


def jobs(name: str | None = None) -> list[dict]:
    """The cluster's job list; finished jobs stay in squeue for MinJobAge (900 s) on the test cluster."""
    argv = ["timeout", "-k", "5", "30", "squeue", "--states=all", "-h", "-o", "%i|%j|%k|%T|%D|%N|%V|%S|%e"]
    rows = subprocess.run(
        argv + (["--name", name] if name else []), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return sorted((dict(zip(JOB_FIELDS, row.split("|"))) for row in rows), key=lambda j: int(j["id"]))


def epoch(slurm_time: str) -> float:
    return datetime.fromisoformat(slurm_time).timestamp()


def finished_rules(proc) -> list[str]:
    return re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", output(proc))


@pytest.mark.slurm
@pytest.mark.slow
def test_two_node_train_job_through_snakemake_profile_slurm(cluster, slurm_workflow):
    work = slurm_workflow
    start = time.monotonic()
    proc = snakemake_slurm(work)
    wall = time.monotonic() - start
    log = output(proc)
    assert proc.returncode == 0, log[-6000:]
    mine = jobs(run_id(proc))
    print(f"\ntwo-node run: {wall:.1f} s wall; its Slurm jobs (squeue --states=all):")
    print("\n".join("|".join(j.values()) for j in mine))

    # every rule completed; the light ones on the submit host, the rest as Slurm jobs
    assert sorted(finished_rules(proc)) == sorted(
        [
            "demo_corpus",
            "demo_notes",
            "train_tokenizer",
            "pretokenize",
            "pack_and_balance",
            "invariant_gate",
            "train",
            "power_triage",
            "run_report",
            "all",
        ]
    )
    assert sorted(rule(j) for j in mine) == sorted(
        ["rule_pretokenize", "rule_pack_and_balance", "rule_train", "rule_power_triage", "rule_run_report"]
    )
    assert all(j["state"] == "COMPLETED" for j in mine), mine

    # train: ONE Slurm job spread over both nodes ...
    (train,) = [j for j in mine if rule(j) == "rule_train"]
    assert train["nodes"] == "2" and train["nodelist"] == "n[1-2]", train
    # ... and by the job's own record: one launcher task per node, each naming its Slurm node, in that job
    run = work / "results/train/demo"
    tasks = re.findall(
        r"^launch: node (\S+) \(SLURM_NODEID (\d+) of 2\) on \S+, job (\d+)$", (run / "train.log").read_text(), re.M
    )
    assert sorted(tasks) == [("n1", "0", train["id"]), ("n2", "1", train["id"])], tasks
    assert sorted(p.name for p in (run / "telemetry").glob("*.parquet")) == ["n1.parquet", "n2.parquet"]
    assert sorted(p.name for p in (run / "heartbeat").glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
    assert json.loads((run / "watcher.json").read_text())["verdict"] == "healthy"
    trained = json.loads((run / "TRAINED").read_text())
    assert trained["final_loss"] > 0 and trained["mesh"] == {"dp_replicate": 2, "dp_shard": 1}

    # the gate ran (on the submit host) and passed before the train job was submitted
    assert int((work / "results/gate/demo/PASSED").stat().st_mtime) <= epoch(train["submit"])
    assert log.rindex("(Rule: invariant_gate)") < log.index(f"submitted with SLURM jobid {train['id']} ")

    # the run report
    assert (work / "results/report/demo/index.html").stat().st_size > 0
    assert json.loads((work / "results/report/demo/summary.json").read_text())["tokens"] > 0
    # Slurm's own job logs (kept by the test profile)
    assert (work / f".snakemake/slurm_logs/rule_train/demo/{train['id']}.log").exists()

    # where jobs queue is not a result's input: another partition or account reruns nothing
    moved = work / "moved.yaml"
    moved.write_text("cluster: {slurm: {partition: elsewhere, account: other, train: {runtime_min: 60}}}\n")
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    dry = subprocess.run(
        [str(BIN / "snakemake"), "-n", "--configfile", "config/config.yaml", str(moved)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Nothing to be done" in output(dry), output(dry)[-3000:]


@pytest.mark.slurm
@pytest.mark.slow
def test_failing_gate_submits_no_train_job(cluster, slurm_workflow, tmp_path):
    uneven = tmp_path / "uneven.yaml"
    uneven.write_text("pack:\n  remainder: none\n")  # naive per-rank packing: uneven micro-batches
    trains_before = [j for j in jobs() if rule(j) == "rule_train"]
    proc = snakemake_slurm(slurm_workflow, "--configfile", str(uneven))
    assert proc.returncode != 0
    assert "gate: FAIL equal_steps" in output(proc)
    mine = jobs(run_id(proc))
    print("\nfailing-gate run, its Slurm jobs:\n" + "\n".join("|".join(j.values()) for j in mine))
    assert "rule_train" not in [rule(j) for j in mine]
    assert "rule_pack_and_balance" in [rule(j) for j in mine]  # the stage before it did run on the cluster
    assert [j for j in jobs() if rule(j) == "rule_train"] == trains_before
    assert not (slurm_workflow / "results/gate/demo/PASSED").exists()


@pytest.mark.slurm
@pytest.mark.slow
def test_watcher_stops_a_hung_two_node_job_through_srun(cluster, slurm_workflow, tmp_path):
    """The uneven-plan deadlock (both guards off) as a two-node Slurm job: the watcher on the first node
    SIGTERMs the inner srun, which ends both nodes' tasks, and the rule fails with the watcher's line. On the 1-D
    mesh: on the fixture's 2 x 1 HSDP mesh a rank's extra step has no shard collective to wait in, and gloo aborts at
    the first mismatched replica collective instead of hanging (NCCL would hang)."""
    hang = tmp_path / "hang.yaml"
    hang.write_text(
        "pack: {remainder: none}\ngate: {enforce: false}\nparallel: {replicate: 1}\n"
        "train: {check_planned_counts: false, collective_timeout_s: 600}\nwatcher: {hang_after_s: 5}\n"
    )
    proc = snakemake_slurm(slurm_workflow, "--configfile", str(hang))
    assert proc.returncode != 0
    assert "wattgate launch: failed: watcher stopped the job: deadlock" in output(proc), output(proc)[-4000:]
    (train,) = [j for j in jobs(run_id(proc)) if rule(j) == "rule_train"]
    print(f"\nhung job: {'|'.join(train.values())}")
    assert train["nodes"] == "2" and train["state"] == "FAILED", train
    verdict = json.loads((slurm_workflow / "results/train/demo/watcher.json").read_text())
    assert verdict["verdict"] == "deadlock" and verdict["slurm_job"] == train["id"]
    assert verdict["kill"] == {"terminated": [verdict["pid"]]}  # SIGTERM to srun sufficed, no scancel needed
    assert verdict["killed_at"] - (verdict["detected_at"] - verdict["stalled_for_s"]) <= 5 + 10
    # nothing of the job (launcher, samplers, torchrun agents, ranks: all run in the workflow folder) is left
    deadline = time.monotonic() + 30
    while (left := job_processes(slurm_workflow)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == []


@pytest.mark.slurm
@pytest.mark.slow
def test_a_run_longer_than_its_time_limit_finishes_across_jobs_without_a_person(cluster, slurm_workflow, tmp_path):
    """A 1-minute Slurm time limit and a run that needs more: launch stops each job gracefully stop_margin_s before
    its end (a checkpoint, exit 75), Snakemake submits the train job again, it resumes from the newest checkpoint,
    and the last job finishes, every step trained once. (That a stopped and resumed run is bit for bit the
    uninterrupted one is test_graceful_stop.py's: the same stop, checkpoint and resume, without Slurm's minute-long
    jobs and its executor's status polls.)"""
    work = slurm_workflow
    limited = tmp_path / "limited.yaml"
    limited.write_text(
        "run_name: jobs\n"
        "cluster: {slurm: {train: {runtime_min: 1, stop_margin_s: 25, max_jobs: 10, mem_mb: 1500}}}\n"
        "train: {epochs: 12, checkpoint_every: 1000}\n"  # 228 steps, a job trains 120-145 here: 50% faster needs two
    )
    # the train rule's target: triage and report add nothing to what this checks (each a Slurm job of ~15 s)
    target = "results/train/jobs/TRAINED"
    proc = snakemake_slurm(work, target, "--configfile", "config/config.yaml", str(limited), limit_s=900)
    log = output(proc)
    assert proc.returncode == 0, log[-6000:]
    trains = [j for j in jobs(run_id(proc)) if rule(j) == "rule_train"]
    print("\ntime-limited run, its train jobs:\n" + "\n".join("|".join(j.values()) for j in trains))
    assert len(trains) >= 2, trains  # cut by the limit at least once, resubmitted by Snakemake alone
    assert all(j["nodes"] == "2" for j in trains), trains
    run = work / "results/train/jobs"
    attempts = (run / "train.attempts.log").read_text()
    print(
        "\n".join(
            x for x in attempts.splitlines() if x.startswith(("launch: attempt", "train: stopped", "train: done"))
        )
    )
    stops = [int(n) for n in re.findall(r"^train: stopped at step (\d+)", attempts, re.M)]
    assert len(stops) == len(trains) - 1, attempts[-3000:]
    summary = json.loads((run / "TRAINED").read_text())
    assert summary["resumed_from_step"] == stops[-1] > 0 and not (run / "STOPPED").exists()
    # each job went on from the step the one before it stopped at: every step once, on both ranks, to the plan's end
    plan = json.loads((work / "results/plan/jobs/plan.json").read_text())
    metrics = pq.read_table(run / "metrics.parquet", columns=["step", "rank"]).to_pylist()
    steps = sorted((r["step"], r["rank"]) for r in metrics)
    assert steps == [(s, r) for s in range(1, plan["steps_per_epoch"] * plan["epochs"] + 1) for r in (0, 1)]


def job_processes(work: Path) -> list[str]:
    """Command lines of the live wattgate processes whose working directory is `work`."""
    found = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc_dir / "cwd")) != work.resolve():
                continue
            cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "wattgate" in cmdline and state != "Z":
            found.append(cmdline)
    return found


class Resources(dict):
    """A job's resources as the slurm executor reads them: resources.get(name) and resources.name."""

    __getattr__ = dict.__getitem__


def dry_run_resources(work: Path, *args: str) -> dict[str, dict]:
    """Every job's resources, from `snakemake -n` (which prints them)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        [str(BIN / "snakemake"), "-n", "--cores", "1", *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, output(proc)[-3000:]
    blocks = re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", proc.stdout, re.M)
    return {
        rule: Resources((k, int(v) if v.isdigit() else v) for k, v in (kv.split("=", 1) for kv in res.split(", ")))
        for rule, res in blocks
    }


def sbatch_flags(resources: Resources) -> list[str]:
    """The sbatch command snakemake-executor-plugin-slurm builds for a job with these resources."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    job = SimpleNamespace(resources=resources, threads=1)
    params = dict(run_uuid="run", slurm_logfile="log", comment_str="rule", account="", partition="", workdir="w")
    return (get_submit_command(job, params) + set_gres_string(job)).split()


def test_b300_example_is_one_job_of_two_nodes_with_eight_gpus_each(tmp_path):
    """The 2 x 8 B300 example through the plugin's own sbatch builder: one task per node (the launcher),
    all 8 GPUs and 96 CPUs of each node, no --ntasks-per-gpu (it would start the launcher once per GPU)."""
    work = tmp_path / "wf"
    work.mkdir()
    copy_workflow(work)
    (tmp_path / "tok").mkdir()
    (tmp_path / "corpus.jsonl").write_text('{"text": "x"}\n')
    local = tmp_path / "paths.yaml"  # the example's site paths, pointed at files that exist here
    local.write_text(
        yaml.safe_dump(
            {
                "data": {"inputs": [str(tmp_path / "corpus.jsonl")]},
                "tokenizer": {"path": str(tmp_path / "tok")},
                "model": {"path": str(tmp_path)},
            }
        )
    )
    res = dry_run_resources(work, "--configfile", "config/examples/qwen3-32b-2x8-b300.yaml", str(local))

    train = res["train"]
    assert train["mpi"] == "srun"  # the jobstep runs the rule's shell once; `wattgate launch` sruns per node
    flags = sbatch_flags(train)
    for flag in ["--nodes=2", "--ntasks=2", "--cpus-per-task=96", "--gres=gpu:8", "--exclusive"]:
        assert flag in flags, (flag, flags)
    # (the executor turns these into -p/-A after checking them with sinfo/sacctmgr)
    assert train["slurm_partition"] == "gpu" and train["slurm_account"] == "my-project"
    assert flags[flags.index("-t") + 1] == "2880" and "--mem" not in flags  # mem_mb 0: the cluster's default
    assert not any(f.startswith("--ntasks-per-gpu") for f in flags)
    # why tasks_per_gpu=0: without it the plugin asks for one task per GPU
    flags = sbatch_flags(Resources({k: v for k, v in train.items() if k != "tasks_per_gpu"}))
    assert "--ntasks-per-gpu=2" in flags

    # CPU stages: one-node jobs in the CPU partition; the gate never leaves the submit host
    flags = sbatch_flags(res["pretokenize"])
    assert "--cpus-per-task=32" in flags and flags[flags.index("--mem") + 1] == "128000"
    assert res["pretokenize"]["slurm_partition"] == "cpu"
    assert "slurm_partition" not in res["invariant_gate"] and "mpi" not in res["pretokenize"]

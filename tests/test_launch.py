"""The launch command is built by one function: local torchrun, or srun + torchrun on Slurm."""

import signal
import socket
import subprocess

import pytest

from wattgate.config import run_config
from wattgate.errors import InputError
from wattgate.train.launch import build_launch_command, launch_env, resolve_launch, train_args

ARGS = train_args("c.yaml", "pre", "plan", "out")


def spec(environ=None, **cluster):
    return resolve_launch(run_config({"cluster": cluster}), environ or {})


def test_local_default_is_standalone_torchrun_with_explicit_omp_threads():
    s = spec(cpus_per_node=2)
    argv = build_launch_command(s, ARGS, python="py")
    assert argv[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert argv[5:] == [
        "-m",
        "wattgate",
        "train",
        "--config",
        "c.yaml",
        "--pretokenized",
        "pre",
        "--plan",
        "plan",
        "--run-dir",
        "out",
    ]
    # Snakemake would set OMP_NUM_THREADS from threads: 2 cores / 2 processes -> 1 each
    assert launch_env(s, {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "1"


def test_auto_picks_slurm_inside_a_multi_node_allocation():
    s = spec({"SLURM_JOB_ID": "4242"}, nodes=2, gpus_per_node=8, cpus_per_node=64)
    assert s.launcher == "slurm" and s.omp_threads == 8
    argv = build_launch_command(s, ARGS, python="py")
    # the jobstep strips SLURM_*: node count and CPUs per task are passed to srun explicitly
    assert argv[:7] == [
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--kill-on-bad-exit=1",
        "--jobid=4242",
        "bash",
    ]
    assert argv[7] == "-c" and len(argv) == 9
    hello, inner = argv[8].split("; exec ", 1)
    assert "$SLURMD_NODENAME" in hello.replace("{", "").replace(":-?}", "") and "SLURM_NODEID" in hello
    assert inner.startswith("py -m torch.distributed.run --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d")
    # the launcher's own host (the batch host, in the allocation); port from the job id
    assert f"--rdzv-endpoint={socket.gethostname()}:24242" in inner
    assert "--rdzv-id=4242" in inner and inner.endswith("--run-dir out")
    assert "--node-rank" not in inner and "--node_rank" not in inner  # c10d hands out ranks in join order


def test_one_node_inside_an_allocation_runs_torchrun_locally():
    s = spec({"SLURM_JOB_ID": "7"}, nodes=1, gpus_per_node=2, cpus_per_node=8)
    assert s.launcher == "local" and s.omp_threads == 4
    assert build_launch_command(s, ARGS, python="py")[3] == "--standalone"


def test_slurm_without_cpus_per_node_gives_each_task_every_cpu_of_its_node():
    s = spec({"SLURM_JOB_ID": "7"}, nodes=2, gpus_per_node=4)
    assert s.cpus_per_node is None and s.omp_threads == 1  # the job asked for one CPU per process
    assert not any(a.startswith("--cpus-per-task") for a in build_launch_command(s, ARGS))


def test_each_node_samples_into_a_trace_named_after_its_slurm_node():
    """Several slurmd may share one hostname (the localhost test cluster): the node name keeps traces apart."""
    s = spec({"SLURM_JOB_ID": "9"}, nodes=2)
    inner = build_launch_command(s, ARGS, python="py", sample=("run dir/telemetry/{host}.parquet", 0.1))[-1]
    word = inner.split("--out ", 1)[1].split(" --interval", 1)[0]
    echo = ["bash", "-c", f"printf '%s\\n' {word}"]
    assert (
        subprocess.run(echo, env={"SLURMD_NODENAME": "n2"}, capture_output=True, text=True).stdout
        == "run dir/telemetry/n2.parquet\n"
    )


def test_two_jobs_get_different_rendezvous_ports():
    a = build_launch_command(spec({"SLURM_JOB_ID": "17"}, nodes=2), ARGS)[-1]
    b = build_launch_command(spec({"SLURM_JOB_ID": "18"}, nodes=2), ARGS)[-1]
    assert ":20017" in a and ":20018" in b


def test_configured_rendezvous_host_is_quoted():
    s = spec({"SLURM_JOB_ID": "5"}, nodes=2, rendezvous_host="127.0.0.1")
    assert "--rdzv-endpoint=127.0.0.1:20005" in build_launch_command(s, ARGS)[-1]


def test_multi_node_without_slurm_is_refused():
    with pytest.raises(InputError, match="cluster.nodes is 2"):
        spec(nodes=2, launcher="local")


def test_slurm_launcher_outside_an_allocation_is_refused():
    with pytest.raises(InputError, match="SLURM_JOB_ID is not set"):
        build_launch_command(spec(launcher="slurm"), ARGS)


def test_each_node_execs_its_agent_with_sigusr1_ignored(tmp_path):
    """Slurm may send USR1 to every process of the step: the node's sampler and torchrun have no handler for it, so
    the task's shell ignores it before exec (inherited; the ranks install their own)."""
    probe = tmp_path / "py"
    probe.write_text("#!/bin/sh\ngrep '^SigIgn:' /proc/$$/status\n")  # stands in for python: what did exec keep?
    probe.chmod(0o755)
    inner = build_launch_command(spec({"SLURM_JOB_ID": "3"}, nodes=2), ARGS, python=str(probe), run="r")[-1]
    assert " -m wattgate.train.torchrun --run-dir r --stop-grace-s 300 --nnodes=2 " in inner  # wattgate's torchrun
    out = subprocess.run(["bash", "-c", inner], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    ignored = int(out.stdout.split()[-1], 16)
    assert ignored >> (signal.SIGUSR1 - 1) & 1, out.stdout + out.stderr


def test_a_run_folder_gives_every_rank_the_recording_torchrun():
    argv = build_launch_command(spec(cpus_per_node=2), ARGS, python="py", run="out")
    agent = ["py", "-m", "wattgate.train.torchrun", "--run-dir", "out", "--stop-grace-s", "300"]
    assert argv[:9] == [*agent, "--standalone", "--nproc-per-node=2"]

"""The launch command is built by one function: local torchrun, or srun + torchrun on Slurm."""

import pytest

from wattgate.config import validate_config
from wattgate.errors import InputError
from wattgate.train.launch import build_launch_command, launch_env, resolve_launch, train_args

ARGS = train_args("c.yaml", "pre", "plan", "out")


def spec(environ=None, **cluster):
    return resolve_launch(validate_config({"cluster": cluster}), environ or {})


def test_local_default_is_standalone_torchrun_with_explicit_omp_threads():
    s = spec(cpus_per_node=2)
    argv = build_launch_command(s, ARGS, python="py")
    assert argv[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert argv[5:] == ["-m", "wattgate", "train", "--config", "c.yaml", "--pretokenized", "pre", "--plan", "plan",
                        "--out", "out"]
    # Snakemake would set OMP_NUM_THREADS from threads: 2 cores / 2 processes -> 1 each
    assert launch_env(s, {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "1"


def test_auto_picks_slurm_inside_an_allocation():
    s = spec({"SLURM_JOB_ID": "4242"}, nodes=2, gpus_per_node=8, cpus_per_node=64)
    assert s.launcher == "slurm" and s.omp_threads == 8
    argv = build_launch_command(s, ARGS, python="py")
    assert argv[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--jobid=4242"]
    assert argv[4:6] == ["bash", "-c"]
    inner = argv[6]
    assert inner.startswith("exec py -m torch.distributed.run --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d")
    # first host of the allocation, resolved inside each srun task; port from the job id
    assert '--rdzv-endpoint=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):24242' in inner
    assert "--rdzv-id=4242" in inner and inner.endswith("--out out")
    assert "--node-rank" not in inner and "--node_rank" not in inner  # c10d hands out ranks in join order


def test_two_jobs_get_different_rendezvous_ports():
    a = build_launch_command(spec({"SLURM_JOB_ID": "17"}, nodes=2), ARGS)[6]
    b = build_launch_command(spec({"SLURM_JOB_ID": "18"}, nodes=2), ARGS)[6]
    assert ":20017" in a and ":20018" in b


def test_configured_rendezvous_host_is_quoted():
    s = spec({"SLURM_JOB_ID": "5"}, nodes=2, rendezvous_host="127.0.0.1")
    assert "--rdzv-endpoint=127.0.0.1:20005" in build_launch_command(s, ARGS)[6]


def test_multi_node_without_slurm_is_refused():
    with pytest.raises(InputError, match="cluster.nodes is 2"):
        spec(nodes=2, launcher="local")


def test_slurm_launcher_outside_an_allocation_is_refused():
    with pytest.raises(InputError, match="SLURM_JOB_ID is not set"):
        build_launch_command(spec(launcher="slurm"), ARGS)

"""The README's local commands need no --cores (issue 31, item 7): Snakemake 9 reads the workflow profile from
profiles/default in the current directory or beside the Snakefile, never from workflow/profiles/ (where it was:
`snakemake --configfile X --until invariant_gate` stopped with "cores have to be specified")."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, copy_workflow

BIN = Path(sys.executable).parent


def dry_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    cmd = [str(BIN / "snakemake"), "--configfile", "config/config.yaml", "-n", "--until", "invariant_gate", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_local_run_without_cores_takes_them_from_the_workflow_profile(tmp_path):
    work = copy_workflow(tmp_path)
    shutil.copytree(REPO / "profiles", work / "profiles")
    proc = dry_run(work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Using workflow specific profile profiles/default" in proc.stderr
    assert "invariant_gate" in proc.stdout + proc.stderr
    assert not (REPO / "workflow" / "profiles").exists()  # where Snakemake never looks


def test_the_slurm_profile_on_a_host_without_slurm_says_so_at_once_in_a_dry_run_too(tmp_path):
    """It failed after the executor's first status check (45 s) with "No such file or directory: 'sacct'"."""
    work = copy_workflow(tmp_path)
    for part in ("profiles", "slurm"):
        shutil.copytree(REPO / part, work / part)
    tools = tmp_path / "bin"  # a PATH with what Snakemake itself runs, and no Slurm
    tools.mkdir()
    for name in ("bash", "sh", "which", "uname", "cat", "git"):
        found = shutil.which(name)
        if found:
            (tools / name).symlink_to(found)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{tools}")
    cmd = [str(BIN / "snakemake"), "--profile", "slurm", "-n", "--until", "invariant_gate"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "wattgate: the slurm executor (--profile slurm) needs sbatch and sacct, not found on this host's PATH: run "
        "from a Slurm login node, or run locally with plain `snakemake`; without slurmdbd set "
        "`slurm-status-command: squeue` in the profile"
    ), proc.stderr[-2000:]

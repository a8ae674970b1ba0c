"""Snakemake on a copy of the workflow, with this venv's tools on PATH."""

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        [str(BIN / "snakemake"), "--cores", "2", *args], cwd=workdir, env=env, capture_output=True, text=True
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc

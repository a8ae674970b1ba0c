"""Stopping a job: the process tree under the launcher's sampler wrapper locally, the inner srun (or scancel)
on Slurm. torchrun's workers run in their own sessions, so a process-group kill would miss them."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def process_tree(root: int) -> list[int]:
    """Descendants of `root` (not root itself), parents before children, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(root: int, grace_s: float) -> dict:
    """SIGTERM every process under `root`, then SIGKILL what is left after `grace_s`."""
    pids = process_tree(root)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors + [p for p in process_tree(root) if p not in pids]:
        _signal(pid, signal.SIGKILL)
    return {"terminated": pids, "killed_after_grace": survivors}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def scancel(job_id: str) -> dict:
    r = subprocess.run(["scancel", str(job_id)], capture_output=True, text=True, timeout=60)
    return {"scancel": job_id, "returncode": r.returncode, "stderr": r.stderr.strip()}


def _stop_job(pid: int | None, slurm_job: str | None, grace_s: float) -> dict:
    if slurm_job:
        if pid is not None:  # the inner srun: it forwards SIGTERM to every node's tasks (and their samplers)
            _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if not _alive(pid):
                return {"terminated": [pid]}
        return scancel(slurm_job)
    # local: everything under the node's sampler wrapper, which then finishes its trace and exits
    return kill_tree(pid, grace_s) if pid is not None else {}

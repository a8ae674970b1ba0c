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
    """SIGKILL the training ranks under `root` and SIGTERM every other process there (the sampler finishes its
    trace, torchrun reports), then SIGKILL what is left after `grace_s`.

    A rank takes SIGTERM as a graceful stop request (train/stop.py), which a hung rank can never act on: blocked in a
    collective it runs no Python handler at all. The watcher acts only on a hang or a stall past its limit, so the
    ranks are killed at once; a rerun resumes from their last checkpoint."""
    pids = process_tree(root)
    ranks = [p for p in pids if is_training_rank(p)]
    for pid in ranks:
        _signal(pid, signal.SIGKILL)
    others = [p for p in pids if p not in ranks]
    for pid in others:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in others):
        time.sleep(0.1)
    survivors = [p for p in others if _alive(p)]
    for pid in survivors + [p for p in process_tree(root) if p not in pids]:
        _signal(pid, signal.SIGKILL)
    return {"terminated": others, "killed_ranks": ranks, "killed_after_grace": survivors}


def is_training_rank(pid: int) -> bool:
    """The process runs `... -m wattgate train ...` (a rank; not the sampler, torchrun or the watcher)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(argv[i : i + 2] == [b"wattgate", b"train"] for i in range(len(argv) - 1))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def scancel(job_id: str) -> dict:
    r = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
    return {"scancel": job_id, "returncode": r.returncode, "stderr": r.stderr.strip()}


def stop_job(pid: int | None, slurm_job: str | None, grace_s: float) -> dict:
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

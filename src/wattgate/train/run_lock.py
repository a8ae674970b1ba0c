"""One trainer per run folder: an exclusive lock the training job itself holds, independent of Snakemake's.

`snakemake --unlock` while a run was going let a second train job start in the same folder, and two jobs then race
over one set of checkpoints and heartbeats. `wattgate launch` holds `launch.lock` for its whole job, and rank 0 of
`wattgate train` holds `train.lock` (ranks can be started with torchrun alone, without launch; and a launcher
killed with -9 leaves its job running). The kernel drops a lock when its holder dies, however it dies, so a lock
file left behind never blocks a later run. The file names its holder for the refusal line; it is rewritten in place,
not through a temporary name, because the lock belongs to the file itself (a rename would put a new, unlocked file
under the name).

flock on shared filesystems: NFSv4 clients emulate it with byte-range locks that every client sees (Linux >= 2.6.12);
Lustre needs its `flock` mount option (without it flock fails, or with `localflock` only one node sees it). Where the
filesystem has no locks, a warning says so and the job runs unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime
from pathlib import Path

from wattgate.errors import InputError
from wattgate.records.attempt import LockHolder

SLURM_JOB_ID = "SLURM_JOB_ID"  # the environment variable naming the Slurm job


class RunLocked(InputError):
    """Another trainer holds this run folder (exit 2; the refused process writes nothing into the folder)."""


_held: dict[Path, int] = {}  # lock file -> its descriptor, open (so locked) until this process ends
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def hold_run_lock(run: Path, name: str, role: str) -> LockHolder:
    """Lock `run/name` for the rest of this process, or refuse (RunLocked, one line naming the folder and the
    holder). Writes and returns this holder's record: role, host, pid, start time, Slurm job id, `attempt` (the
    previous holder's plus one: launch numbers its attempts in the run folder with it)."""
    path = Path(run) / name
    if path in _held:
        return _read(_held[path])
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    locked = True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            holder = _read(fd)
            os.close(fd)
            raise refusal(run, path.name, holder) from None
        if exc.errno not in _NO_LOCKS:
            os.close(fd)
            raise
        print(
            f"{role}: WARNING: {path}: the filesystem has no file locks ({exc.strerror}); a second trainer in "
            "this run folder would not be refused",
            file=sys.stderr,
            flush=True,
        )
        locked = False
    previous = _read(fd).attempt
    record = LockHolder(
        role=role,
        host=socket.gethostname(),
        pid=os.getpid(),
        started=time.time(),
        slurm_job=os.environ.get(SLURM_JOB_ID),
        attempt=previous + 1 if previous is not None else 1,
        locked=locked,
    )
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record.to_json()) + "\n").encode(), 0)  # in field order, as before
    _held[path] = fd
    return record


def renumber_held(run: Path, name: str, attempt: int) -> LockHolder:
    """Rewrite the record of a lock this process holds with another attempt number (launch, when the folder's
    earlier run was set aside: a new run's attempts count from 1 again)."""
    path = Path(run) / name
    fd = _held[path]
    record = _read(fd).replace(attempt=attempt)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record.to_json()) + "\n").encode(), 0)
    return record


def refusal(run: Path, name: str, holder: LockHolder) -> RunLocked:
    return RunLocked(
        f"{run}: another trainer is running in this run folder ({describe_holder(holder)}; {name} is locked): "
        "wait for it to end or stop it; two trainers in one folder overwrite each other's checkpoints"
    )


def check_unlocked(run: Path, name: str) -> None:
    """Refuse (RunLocked) when another process holds `run/name`; hold nothing. launch checks rank 0's lock before
    it clears anything: a job whose launcher was killed (kill -9) may still be training there."""
    path = Path(run) / name
    if path in _held or not path.exists():
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise refusal(run, name, _read(fd)) from None
    finally:
        os.close(fd)  # drops the lock if it was taken


def _read(fd: int) -> LockHolder:
    """The lock file's holder (no holder when the file holds no record: empty, damaged or of another shape)."""
    try:
        return LockHolder.from_json(json.loads(os.pread(fd, 1 << 16, 0) or b"{}"))
    except (OSError, ValueError, InputError):
        return LockHolder()


def describe_holder(holder: LockHolder) -> str:
    """'wattgate launch, pid 4242 on node7, started 2025-01-02 03:04:05, Slurm job 99' from a lock's record."""
    parts = [holder.role or "holder not recorded"]
    if holder.pid:
        parts[0] += f", pid {holder.pid}" + (f" on {holder.host}" if holder.host else "")
    if holder.started is not None:
        parts.append(f"started {datetime.fromtimestamp(holder.started).isoformat(sep=' ', timespec='seconds')}")
    if holder.slurm_job:
        parts.append(f"Slurm job {holder.slurm_job}")
    return ", ".join(parts)


def release_run_lock(run: Path, name: str) -> None:
    """Drop a lock this process holds (tests; a process ending drops its locks anyway)."""
    fd = _held.pop(Path(run) / name, None)
    if fd is not None:
        os.close(fd)

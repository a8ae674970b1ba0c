"""Atomic writes and content hashes shared by every stage.

Every artifact is written under a temporary name in the destination folder and
renamed into place, so a killed stage never leaves a half-written file that a
later stage (or Snakemake) could mistake for a finished one.

Temporary names are `.{name}.{pid}@{host}.{random}.tmp` (and `.old` for a
folder being replaced), beside the destination. When a stage publishes `dest`,
the leftovers of killed writers of the same `dest` are swept: a temp of a dead
process on this host, or (another host, or an older wattgate that did not put
its pid in the name) one untouched for `STALE_AFTER_S`. A temp of a live
writer is never removed.

`atomic_dir` replaces a whole folder, so it only ever replaces a folder that
the same stage published (it holds the marker file `OUTPUT_MARKER` naming it)
or an empty one; any other non-empty folder is refused, never deleted.

Files and folders are published with the user's umask (not mkstemp's 0600 /
mkdtemp's 0700), so teammates on a shared project folder can read them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

from wattgate.errors import InputError

_CHUNK = 1 << 20

# The marker `atomic_dir` writes into every folder it publishes; a dot-file, skipped by sha256_tree.
OUTPUT_MARKER = ".wattgate-output"
MARKER_FORMAT_VERSION = 1

# A temp of another host (pid not checkable) or without a pid is stale after this long untouched.
STALE_AFTER_S = 3600.0


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once, at import (os.umask can only be read by setting it; process-wide).
UMASK = _read_umask()


def _file_mode() -> int:
    return 0o666 & ~UMASK


def _dir_mode() -> int:
    return 0o777 & ~UMASK


def _host() -> str:
    return (re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host")[:48]


def _temp_prefix(dest: Path) -> str:
    return f".{dest.name}.{os.getpid()}@{_host()}."


@contextlib.contextmanager
def _publishing(dest: Path, tmp: Path, remove: Callable[[Path], object]) -> Generator[None, None, None]:
    """Around writing `tmp` and renaming it onto `dest`: an OSError that names no file (a failed write()) is
    raised naming `dest`, and `tmp` is removed whatever happens."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(dest)) from exc
        raise
    finally:
        if tmp.exists():
            remove(tmp)


def _refuse_folder(dest: Path) -> None:
    """A file output at a folder: one line naming --out (a file is never renamed onto a folder)."""
    if dest.is_dir():
        raise InputError(f"{dest}: is a folder; this output is a file: give a file name")


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Generator[Path, None, None]:
    """Yield a temporary path beside `dest`; rename it onto `dest` on success (a folder at `dest` is refused
    first: a file is never renamed onto one)."""
    dest = Path(dest)
    _refuse_folder(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(dest), suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    with _publishing(dest, tmp_path, Path.unlink):
        yield tmp_path
        os.chmod(tmp_path, _file_mode())
        os.replace(tmp_path, dest)
    sweep_stale_temps(dest)


def write_bytes_atomic(dest: str | os.PathLike, data: bytes) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


SPARE_BYTES = 4096  # one filesystem block: room for a failure record's one line


def spare_path(path: str | os.PathLike) -> Path:
    """The hidden file that holds room for `path`'s record (`reserve_spare`)."""
    path = Path(path)
    return path.with_name(f".spare-{path.name}")


def reserve_spare(path: str | os.PathLike, size: int = SPARE_BYTES) -> bool:
    """Set aside room for a record that must be written even when the disk is full (how an attempt ended, why a
    rank failed): a file of `size` spaces beside it, written while there is room. Best effort (False: no room)."""
    spare = spare_path(path)
    try:
        if spare.is_file() and spare.stat().st_size >= size:
            return True
        write_bytes_atomic(spare, b" " * size)
    except OSError:
        return False
    return True


def write_bytes_or_spare(dest: str | os.PathLike, data: bytes) -> None:
    """write_bytes_atomic, and where that fails (a full disk) the record written into its spare in place (existing
    blocks: no new space), padded with spaces (JSON ignores them), then renamed over `dest`. The write's own
    OSError when there is no spare, or the record does not fit it."""
    try:
        write_bytes_atomic(dest, data)
        return
    except OSError as exc:
        spare = spare_path(dest)
        try:
            size = spare.stat().st_size
        except OSError:
            raise exc from None
        if len(data) > size:
            raise exc from None
        try:
            with open(spare, "r+b") as f:
                f.write(data + b" " * (size - len(data)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(spare, dest)
        except OSError:
            raise exc from None


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON null), for a writer that
    knows a missing figure is legitimate (say so at the call: `write_json_atomic(..., nonfinite="null")`)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _nonfinite_path(obj: Any, path: str = "$") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        if found := _nonfinite_path(value, f"{path}[{key!r}]" if isinstance(obj, dict) else f"{path}[{key}]"):
            return found
    return None


def canonical_json(obj: Any, *, nonfinite: str = "error") -> str:
    """Strict JSON with sorted keys and a trailing newline: the same object gives the same bytes.

    NaN and Infinity are not JSON: with nonfinite="error" (the default) they raise ValueError
    naming where they are; nonfinite="null" writes them as null (the caller's deliberate choice).
    """
    if nonfinite not in ("error", "null"):
        raise ValueError(f"nonfinite must be 'error' or 'null', not {nonfinite!r}")
    if nonfinite == "null":
        obj = json_safe(obj)
    try:
        return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError:
        where = _nonfinite_path(obj)
        if where is None:
            raise
        raise ValueError(
            f"non-finite float (NaN or Infinity) at {where}: not valid JSON; "
            "write null for it, or pass nonfinite='null'"
        ) from None


def write_json_atomic(dest: str | os.PathLike, obj: Any, *, nonfinite: str = "error") -> None:
    """Write canonical, strict JSON atomically (see canonical_json for `nonfinite`)."""
    write_bytes_atomic(dest, canonical_json(obj, nonfinite=nonfinite).encode())


def _caller_stage() -> str:
    """The stage that publishes a folder: the last part of the calling wattgate module's name."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module not in (__name__, "contextlib"):
            return module.rsplit(".", 1)[-1] or "unknown"
        frame = frame.f_back
    return "unknown"


def marker_bytes(stage: str, names: list[str] | None = None) -> bytes:
    """The marker's content: fixed for a stage (and, for a published folder, the names it published), so
    byte-identical reruns stay byte-identical."""
    marker: dict[str, object] = {"format_version": MARKER_FORMAT_VERSION, "stage": stage, "written_by": "wattgate"}
    if names is not None:
        marker["names"] = sorted(names)
    return canonical_json(marker).encode()


def _marker_names(dest: Path) -> set[str] | None:
    """The names a published folder's marker lists (None: it lists none, so it is no marker atomic_dir wrote)."""
    try:
        names = json.loads((dest / OUTPUT_MARKER).read_text()).get("names")
    except (OSError, ValueError, AttributeError):
        return None
    return set(names) if isinstance(names, list) else None


def check_replaceable(dest: str | os.PathLike, stage: str) -> None:
    """Refuse (InputError) to replace `dest` unless it is missing, an empty folder or `stage`'s own output
    (another stage's output is refused too: a run folder's checkpoints are never a typo away)."""
    dest = Path(dest)
    if not os.path.lexists(dest):
        return
    if dest.is_symlink():
        what = "a symlink"
    elif not dest.is_dir():
        what = "not a folder"
    elif (found := marker_stage(dest)) is not None:
        if found != stage:
            what = f"the output of wattgate {found}"
        elif (published := _marker_names(dest)) is None:
            what = f"marked as wattgate {stage}'s output by a {OUTPUT_MARKER} without its 'names' list"
        # what a published folder holds beyond what it published
        elif added := _foreign_entries(dest, (OUTPUT_MARKER, *map(glob.escape, published))):
            what = (
                f"wattgate {stage}'s output with {', '.join(added[:3])}{' and more' if len(added) > 3 else ''} "
                "added by someone else (replacing it would delete them: move them out first)"
            )
        else:
            return
    else:
        with os.scandir(dest) as entries:
            if next(entries, None) is None:
                return
        what = f"a non-empty folder that wattgate did not write (no {OUTPUT_MARKER})"
    raise InputError(
        f"{dest}: output exists and is {what}; wattgate replaces only its own outputs: "
        "choose an empty or new folder, or remove it yourself"
    )


def marker_stage(dest: str | os.PathLike) -> str | None:
    """The stage named by `dest`'s OUTPUT_MARKER; None without one (or an unreadable one)."""
    try:
        return str(json.loads((Path(dest) / OUTPUT_MARKER).read_text()).get("stage"))
    except (OSError, ValueError, AttributeError):
        return None


def _is_temp_name(name: str) -> bool:
    """A temporary of atomic_path/atomic_dir (`.{name}.{pid}@{host}.{random}.tmp|old`): a killed writer's."""
    return re.fullmatch(r"\..+\." + _TEMP_TAIL.pattern, name) is not None


def _foreign_entries(dest: Path, own: tuple[str, ...]) -> list[str]:
    """Names in `dest` that are none of `own` (fnmatch patterns) or a wattgate temporary."""
    with os.scandir(dest) as entries:
        names = sorted(e.name for e in entries)
    return [n for n in names if not _is_temp_name(n) and not any(fnmatch.fnmatchcase(n, p) for p in own)]


def check_stage_output(dest: str | os.PathLike, stage: str, own: tuple[str, ...] = (), flag: str = "--out") -> None:
    """Refuse (InputError) to write into `dest` in place unless it is missing, a folder this `stage` marked as
    its own, or one holding nothing but `own` (fnmatch patterns of the names the stage writes: an output of a
    wattgate from before the marker, or what another rank of the same launch has made by now) and wattgate
    temporaries. For stages that write their files into --out rather than publishing a folder;
    `flag`: the option that named `dest` (train's run folder is --run)."""
    dest = Path(dest)
    if not os.path.lexists(dest):
        return
    if dest.is_dir() and not dest.is_symlink():
        found = marker_stage(dest)
        foreign = _foreign_entries(dest, own) if found is None else []
        if OUTPUT_MARKER in foreign:  # another rank of this launch marked the folder between our two reads
            found = marker_stage(dest)
            foreign = foreign if found is None else []
        if found == stage:
            return
        if found is None and not foreign:
            return
        what = (
            f"the output of wattgate {found}"
            if found
            else f"a folder wattgate {stage} did not write (it holds {', '.join(foreign[:3])}"
            + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            + f"; no {OUTPUT_MARKER})"
        )
    else:
        what = "a symlink" if dest.is_symlink() else "not a folder"
    raise InputError(
        f"{dest}: output exists and is {what}; {stage} writes only into an empty or new folder or its own "
        f"earlier output: choose another {flag}"
    )


def claim_stage_output(dest: str | os.PathLike, stage: str, own: tuple[str, ...] = (), flag: str = "--out") -> Path:
    """check_stage_output, then create `dest` and mark it as `stage`'s (before the stage writes anything)."""
    dest = Path(dest)
    check_stage_output(dest, stage, own, flag)
    dest.mkdir(parents=True, exist_ok=True)
    if marker_stage(dest) != stage:
        write_bytes_atomic(dest / OUTPUT_MARKER, marker_bytes(stage))
    return dest


def check_file_output(dest: str | os.PathLike, stage: str, ours: Callable[[Path], bool]) -> None:
    """Refuse (InputError) to write the file `dest` unless it is missing or `ours(dest)` recognises it as
    `stage`'s earlier output (by a signature it carries): a user's file at a file --out is never overwritten."""
    dest = Path(dest)
    _refuse_folder(dest)
    if not os.path.lexists(dest):
        return
    try:
        mine = dest.is_file() and not dest.is_symlink() and ours(dest)
    except (OSError, ValueError):  # unreadable or not even the format (UnicodeDecodeError is a ValueError): not ours
        mine = False
    if not mine:
        raise InputError(
            f"{dest}: output exists and is a file wattgate {stage} did not write; {stage} replaces only its own "
            "earlier output: choose another --out, or remove it yourself"
        )


def first_line_has(path: Path, text: str) -> bool:
    """Whether the first line of the text file `path` contains `text` (a written-by header)."""
    with open(path, "rb") as f:
        return text.encode() in f.readline(4096)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike, stage: str | None = None) -> Generator[Path, None, None]:
    """Yield a fresh temporary folder beside `dest`; swap it in for `dest` on success.

    The published folder holds `OUTPUT_MARKER` (naming `stage`, by default the calling
    module). `dest` must be missing, empty, or an earlier wattgate output: anything else is
    refused with InputError before any work is done, and checked again before the swap.
    """
    dest = Path(dest)
    stage = stage or _caller_stage()
    check_replaceable(dest, stage)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(dest), suffix=".tmp", dir=dest.parent))
    with _publishing(dest, tmp, shutil.rmtree):
        yield tmp
        with atomic_path(tmp / OUTPUT_MARKER) as marker:
            marker.write_bytes(marker_bytes(stage, [p.name for p in tmp.iterdir() if p.name != marker.name]))
        os.chmod(tmp, _dir_mode())
        check_replaceable(dest, stage)  # it may have changed while the stage ran
        if os.path.lexists(dest):
            old = Path(tempfile.mkdtemp(prefix=_temp_prefix(dest), suffix=".old", dir=dest.parent))
            os.replace(dest, old / "x")
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dest)
    sweep_stale_temps(dest)


_TEMP_TAIL = re.compile(r"(?:(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)\.)?[a-z0-9_]{8}\.(?:tmp|old)")


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    except OSError:
        return True  # cannot tell: keep
    return True


def _is_stale(path: Path, pid: str | None, host: str | None, now: float) -> bool:
    if pid is not None and host == _host():
        return int(pid) != os.getpid() and not _pid_alive(int(pid))
    return now - _newest_mtime(path) > STALE_AFTER_S


def sweep_stale_temps(dest: str | os.PathLike) -> list[Path]:
    """Remove leftovers of killed writers of `dest` (see the module doc); returns what was removed.

    Never raises: a temp that cannot be inspected or removed is left for a later sweep.
    """
    dest = Path(dest)
    prefix = f".{dest.name}."
    removed = []
    now = time.time()
    try:
        with os.scandir(dest.parent) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        m = _TEMP_TAIL.fullmatch(name[len(prefix) :])
        if m is None:
            continue
        path = dest.parent / name
        try:
            if not _is_stale(path, m.group("pid"), m.group("host"), now):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(paths: Iterable[str | os.PathLike], file_sha256: Callable[[Path], str] | None = None) -> str:
    """Hash files and folders by relative name and content, in a fixed order. `file_sha256(path)` gives a file's
    sha256 (default sha256_file; the gate's sources check reuses one it kept).

    A folder's `OUTPUT_MARKER` is not hashed: it says who wrote the folder, not what it holds.
    """
    file_sha256 = file_sha256 or sha256_file
    h = hashlib.sha256()
    for root in paths:
        root = Path(root)
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != OUTPUT_MARKER)
        else:
            files = [root]
        for f in files:
            name = f.relative_to(root).as_posix() if root.is_dir() else f.name
            h.update(name.encode() + b"\0")
            h.update(bytes.fromhex(file_sha256(f)))
    return h.hexdigest()

"""model.path's bytes, as the gate verified them and as the train job reads them.

The gate's `weights` check reads only the safetensors headers; a weight changed after the gate (a bit flipped, a
file replaced by another download) trained silently. So the gate hashes the folder's files (every `*.safetensors`
and `*.json` at its top level: the weights, their index and config.json) in chunks of CHUNK_BYTES, records the
hashes in gate.json `model_files`, and launch hands them to the job; before the first step every rank hashes its
share of the chunks (rank r the chunks r, r + world, ...: a 65 GB model is ~250 chunks, a few per rank) and one
gather tells every rank whether all match. A rerun of the gate rehashes only the files whose size, inode or
ctime changed (ctime moves with every write and cannot be set back).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path

from wattgate.data.shards import content_hasher, shard_hash_algorithm
from wattgate.errors import InputError
from wattgate.records.gate import ModelFile, ModelFiles

CHUNK_BYTES = 1 << 28  # 256 MiB: a 65 GB model is ~250 chunks to share over the ranks


def model_file_names(folder: Path) -> list[str]:
    """The files of a model folder a run reads: the weights, their index and the JSON configs (top level)."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError as exc:
        raise InputError(f"{folder}: cannot list model.path ({exc.strerror})") from None
    return sorted(p.name for p in entries if p.is_file() and p.suffix in (".safetensors", ".json"))


def chunk_hashes(path: Path, size: int, chunk_bytes: int, which: Iterable[int] | None = None) -> dict[int, str]:
    """{chunk index: xxh3_128 hex} of a file's chunks (all of them, or `which`), hashed in place (memory-mapped)."""
    count = max(1, -(-size // chunk_bytes))
    wanted = range(count) if which is None else which
    out = {}
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise InputError(f"{path}: {os.fstat(f.fileno()).st_size} bytes, the gate verified {size}")
        if size == 0:
            return {i: content_hasher().hexdigest() for i in wanted}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for i in wanted:
                    h = content_hasher()
                    h.update(view[i * chunk_bytes : (i + 1) * chunk_bytes])
                    out[i] = h.hexdigest()
            finally:
                view.release()
    return out


def hash_model_folder(folder: Path, previous: ModelFiles | None = None) -> tuple[ModelFiles, int]:
    """The folder's files hashed (a file `previous` holds with the same size, inode and ctime is taken from it),
    and how many bytes were read to hash them."""
    folder = Path(folder).resolve()
    reuse = previous if previous is not None and previous.chunk_bytes == CHUNK_BYTES else None
    files, read = {}, 0
    for name in model_file_names(folder):
        path = folder / name
        try:
            st = path.stat()
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror})") from None
        old = reuse.files.get(name) if reuse is not None and reuse.path == str(folder) else None
        if old is not None and (old.size, old.inode, old.ctime_ns) == (st.st_size, st.st_ino, st.st_ctime_ns):
            files[name] = old
            continue
        try:
            chunks = chunk_hashes(path, st.st_size, CHUNK_BYTES)
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror})") from None
        read += st.st_size
        files[name] = ModelFile(
            size=st.st_size, ctime_ns=st.st_ctime_ns, inode=st.st_ino, chunks=tuple(chunks.values())
        )
    hashes = ModelFiles(path=str(folder), algorithm=shard_hash_algorithm(), chunk_bytes=CHUNK_BYTES, files=files)
    return hashes, read


def changed_model_files(hashes: ModelFiles, rank: int, world: int) -> list[str]:
    """This rank's share of the launch check: one line per file of model.path that is not what the gate verified
    (rank 0 also checks that no weight or config file came or went)."""
    folder = Path(hashes.path)
    if hashes.algorithm != shard_hash_algorithm():
        return [f"{folder}: hashed with {hashes.algorithm} at the gate, this host has {shard_hash_algorithm()}"]
    problems = []
    if rank == 0:
        try:
            names = model_file_names(folder)
        except InputError as exc:
            return [str(exc)]
        came = sorted(set(names) - set(hashes.files))
        gone = sorted(set(hashes.files) - set(names))
        problems += [f"{folder / n}: not there when the gate checked model.path" for n in came]
        problems += [f"{folder / n}: gone since the gate checked model.path" for n in gone]
    chunks = [(name, i) for name in sorted(hashes.files) for i in range(len(hashes.files[name].chunks))]
    mine: dict[str, list[int]] = {}
    for name, i in chunks[rank::world]:
        mine.setdefault(name, []).append(i)
    for name, wanted in mine.items():
        recorded = hashes.files[name]
        path = folder / name
        if not path.is_file():
            continue  # rank 0 names it
        try:
            found = chunk_hashes(path, recorded.size, hashes.chunk_bytes, wanted)
        except InputError as exc:
            problems.append(str(exc))
            continue
        except OSError as exc:
            problems.append(f"{path}: cannot read ({exc.strerror})")
            continue
        bad = [i for i in wanted if found[i] != recorded.chunks[i]]
        if bad:
            at = bad[0] * hashes.chunk_bytes
            problems.append(
                f"{path}: bytes from offset {at} differ from what the gate verified (gate.json model_files)"
            )
    return problems

"""A checkpoint's files hashed as DCP writes them (xxh3_128, the shards' algorithm), with no second read: a
FileSystemWriter (dcp.save's default for a folder, the same settings and bytes) over a file system whose streams
hash what passes through them, keeping {file name: {bytes, hash}} for state.json; a write error names its file."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, cast

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

# the shards' algorithm (data/pretokenize.py SHARD_HASH_ALGORITHM): ~10 GB/s, small beside the write itself
HASH_ALGORITHM = "xxh3_128"


def named_error(exc: OSError, path: Path) -> OSError:
    """`exc` naming `path` (a write or flush error names no file; the CLI's one line should)."""
    return exc if exc.filename is not None else OSError(exc.errno, exc.strerror or str(exc), str(path))


class _HashingStream:
    """A write-only file that feeds every byte to xxh3_128 on its way out: the hash costs no second read.

    Sequential only (no seek): DCP and torch.save append, and a seek back would make the hash lie."""

    def __init__(self, file, path: Path, fs: _HashingFileSystem):
        self.file, self.path, self.fs = file, path, fs
        self.hasher = xxhash.xxh3_128()
        self.bytes = 0
        self.closed = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            n = self.file.write(view)
        except OSError as exc:
            raise self.fs.failed(named_error(exc, self.path)) from None
        n = len(view) if n is None else n
        self.hasher.update(view[:n])
        self.bytes += n
        return n

    def tell(self) -> int:
        return self.bytes  # the file was opened empty ("wb")

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            raise self.fs.failed(named_error(exc, self.path)) from None

    def fileno(self) -> int:
        # DCP fsyncs this descriptor: flush first, so what is synced is everything written (and a full disk
        # is reported here, naming the file, rather than by a later close)
        self.flush()
        return self.file.fileno()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.file.close()
            except OSError as exc:
                raise self.fs.failed(named_error(exc, self.path)) from None

    def record(self) -> dict:
        return {"bytes": self.bytes, "hash": self.hasher.hexdigest()}


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording {bytes, hash} of every file it writes into `written` by final name."""

    def __init__(self, written: dict[str, dict]):
        super().__init__()
        self.written = written
        self.lock = threading.Lock()  # DCP may write with several threads (thread_count)
        self.failure: OSError | None = None  # the first write error, named

    def failed(self, exc: OSError) -> OSError:
        """Note a write error: torch.save, writing through this stream, replaces it with its own RuntimeError
        ('unexpected pos') as it closes, so the writer raises the noted one instead."""
        with self.lock:
            self.failure = self.failure or exc
        return exc

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        file = path.open(mode)
        stream = _HashingStream(file, path, self)
        try:
            yield cast(io.IOBase, stream)  # duck-typed: the write-only stream DCP and torch.save use
            stream.close()
        except BaseException:
            with suppress(OSError):  # closing flushes again: the error already raised is the one to report
                file.close()
            raise
        with self.lock:
            self.written[path.name] = stream.record()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # .metadata is written as .metadata.tmp, then renamed
        with self.lock:
            if Path(path).name in self.written:
                self.written[Path(new_path).name] = self.written.pop(Path(path).name)


class HashingWriter(FileSystemWriter):
    """FileSystemWriter (dcp.save's default for a folder, same settings, same bytes) through _HashingFileSystem."""

    def __init__(self, path: Path, written: dict[str, dict]):
        super().__init__(path)
        self.written = written  # {file name: {bytes, hash}} of every file this rank wrote
        self.hashing_fs = _HashingFileSystem(written)
        self.fs = self.hashing_fs  # what FileSystemWriter writes through

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception:
            # the write error itself (e.g. ENOSPC, naming the file) is what DCP sends to every rank
            if self.hashing_fs.failure is not None:
                raise self.hashing_fs.failure from None
            raise

    def write_rng(self, name: str, state: dict) -> None:
        """This rank's RNG state beside its shards, hashed as it is written."""
        try:
            with self.hashing_fs.create_stream(Path(self.path) / name, "wb") as stream:
                torch.save(state, cast(IO[bytes], stream))  # a _HashingStream (create_stream)
        except Exception:  # torch.save turns a write error into its own RuntimeError: report the write error
            if self.hashing_fs.failure is not None:
                raise self.hashing_fs.failure from None
            raise

"""What the importers share: the options every reader takes, and the sample lines under a CSV header."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import tzinfo
from pathlib import Path
from typing import TypeVar

from wattgate.errors import InputError
from wattgate.power.log_parsing import (
    BadLine,
    Lines,
    truncated_final,
)


@dataclass(frozen=True)
class ReadOptions:
    """What every reader is given besides the file: one signature, read(path, imported, lines, options)."""

    host: str  # --host, else the file's stem
    explicit_host: str | None  # --host as given (DCGM prefers its own Hostname label)
    tz: tzinfo  # --tz, for naive times
    fields: list[str] | None  # nvidia-smi's --fields for a log without a header
    gpu_index: int  # the GPU of a one-GPU log (legacy zeus_monitor)
    mapping: dict[str, tuple[str, str]] | None  # --columns of --from csv


def no_samples(path: Path, rows: list) -> None:
    """A header and nothing under it is an error, as for nvidia-smi: an empty trace would pass silently."""
    if len(rows) < 2:
        raise InputError(f"{path}: a header line and no sample lines; import the log once its logger has written")


T = TypeVar("T")


def sample_rows(
    path: Path,
    rows: list[tuple[int, list[str]]],
    header: list[str],
    lines: Lines,
    parse: Callable[[list[str]], T],
    as_truncated: Callable[[BadLine], BadLine] = lambda e: e,
) -> Iterator[tuple[int, T]]:
    """(line number, parse(cells)) for each sample line under a CSV header. A line with another field count or
    a value parse() refuses (BadLine) goes to `lines`, as a truncated final line where it is one (`as_truncated`
    names the field for that test)."""
    no_samples(path, rows)
    last = rows[-1][0]
    read = 0
    for lineno, cells in rows[1:]:
        try:
            if len(cells) != len(header):
                raise BadLine("line", ",".join(cells), f"{len(cells)} fields, header has {len(header)}")
            parsed = parse(cells)
        except BadLine as exc:
            lines.bad(path, lineno, exc, truncated_final(path, cells, header, as_truncated(exc), lineno == last))
            continue
        read += 1
        yield lineno, parsed
    if not read:  # every line skipped (--skip-bad-lines): an empty trace would pass silently
        raise InputError(f"{path}: no readable sample lines")

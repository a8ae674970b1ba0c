"""Each input is read once: two data.inputs entries with the same bytes (a copy under another name) would train
each of their documents twice while the gate counts every document once. Only inputs of equal size are hashed
(sha256 of a file's bytes, or of a folder's files by relative name)."""

from __future__ import annotations

from pathlib import Path

from wattgate.artifacts import sha256_file, sha256_tree
from wattgate.errors import InputError


def input_size(path: str | Path) -> int:
    root = Path(path)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else root.stat().st_size


def check_distinct_content(paths: list[str], where: str) -> None:
    """No two inputs hold the same bytes (a copy of a file under another name trains its documents twice while the
    gate counts each once). Only inputs of equal size are hashed; a missing input is left to the reader's line."""
    by_size: dict[int, list[int]] = {}
    for i, path in enumerate(paths):
        try:
            by_size.setdefault(input_size(path), []).append(i)
        except OSError:
            continue
    for group in (g for g in by_size.values() if len(g) > 1):
        seen: dict[str, int] = {}
        for i in group:
            try:
                path = Path(paths[i])  # a folder's files by relative name; a file by its bytes alone, not its name
                key = sha256_tree([path]) if path.is_dir() else sha256_file(path)
            except OSError:
                continue
            if key in seen:
                raise InputError(
                    f"{where}[{i}] ({paths[i]}) holds the same bytes as {where}[{seen[key]}] ({paths[seen[key]]}); "
                    "list the data once (a mapping {path: ..., epochs: 2} trains a source twice on purpose)"
                )
            seen[key] = i

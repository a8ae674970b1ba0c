"""Gate check `sources`: the pretokenized data was made from the inputs this config names, as they are now.

The plan is bound to the manifest and the manifest to its shards, but nothing bound the manifest to the config
being gated: with `data.inputs: [no-such-corpus.jsonl]` and Snakemake deciding not to rerun pretokenize, the gate
passed on the old corpus. Here every file of data.inputs and data.validation.inputs must exist, be the paths the
manifest records (`sources`, `validation.inputs`) and hash to its `source_sha256` (pretokenize's own
`sha256_tree`). Each file's sha256 is kept in gate.json `source_files` with its size, inode and ctime, so the next
gate rereads only a file written since.
"""

from __future__ import annotations

import os
from pathlib import Path

from wattgate.artifacts import sha256_file, sha256_tree
from wattgate.config import input_paths
from wattgate.gate.checks import Check
from wattgate.records.gate import SourceFile
from wattgate.records.manifest import Manifest
from wattgate.records.run_config import RunConfig

NAME = "sources"
RERUN = "rerun pretokenize (snakemake --forcerun pretokenize) or point the config at the inputs it was made from"


def hashed_tree(paths: list[str], seen: dict[str, SourceFile], kept: dict[str, SourceFile]) -> str:
    """artifacts.sha256_tree of `paths`, taking a file's sha256 from `seen` when its stat is unchanged; every file
    hashed goes into `kept`."""

    def file_sha256(f: Path) -> str:
        st = f.stat()
        key = str(f.resolve())
        old = seen.get(key)
        if old is not None and (old.size, old.inode, old.ctime_ns) == (st.st_size, st.st_ino, st.st_ctime_ns):
            digest = old.sha256
        else:
            digest = sha256_file(f)
        kept[key] = SourceFile(size=st.st_size, ctime_ns=st.st_ctime_ns, inode=st.st_ino, sha256=digest)
        return digest

    return sha256_tree(paths, file_sha256)


def _same_paths(named: list[str], recorded: tuple[str, ...]) -> bool:
    return [os.path.realpath(p) for p in named] == [os.path.realpath(p) for p in recorded]


def check_sources(
    config: RunConfig, manifest: Manifest, seen: dict[str, SourceFile] | None
) -> tuple[Check, dict[str, SourceFile] | None]:
    """The check, and the per-file hashes to keep for the next gate (None: nothing hashed)."""
    if manifest.synthetic or manifest.sources is None:
        return Check(NAME, True, "synthetic data: no input files to compare"), None
    sides = [("data.inputs", input_paths(config.data), manifest.sources, manifest.source_sha256)]
    validation = manifest.validation
    if config.data.validation.inputs or (validation is not None and validation.inputs):
        recorded = validation.inputs if validation is not None else ()
        sha = validation.source_sha256 if validation is not None else None
        sides.append(("data.validation.inputs", list(config.data.validation.inputs), recorded, sha))
    kept: dict[str, SourceFile] = {}
    for key, named, recorded, sha in sides:
        missing = [p for p in named if not Path(p).exists()]
        if missing:
            return Check(
                NAME, False, f"{key}: {missing[0]}: not found; fix the config's path, or restore the file"
            ), None
        if not _same_paths(named, recorded):
            return Check(
                NAME,
                False,
                f"{key} names {', '.join(named) or 'nothing'}, the pretokenized data was made from "
                f"{', '.join(recorded) or 'nothing'}; {RERUN}",
            ), None
        try:
            found = hashed_tree(named, seen or {}, kept)
        except OSError as exc:
            return Check(NAME, False, f"{key}: {exc.filename}: cannot read ({exc.strerror})"), None
        if sha is not None and found != sha:
            return Check(
                NAME, False, f"{key} ({', '.join(named)}) changed since pretokenize (sha256 differs); {RERUN}"
            ), None
    files = len(kept)
    return Check(
        NAME,
        True,
        f"the pretokenized data was made from the {files} input file(s) the config names, as they are now (sha256)",
    ), kept

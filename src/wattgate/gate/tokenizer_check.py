"""The gate's `tokenizer` check: the tokenizer the run will copy into final/ is still the one the data was made
with. The export verifies the same files by the same hash (train/export_files.py) only after the last step;
checking it here turns a run that would end without a final/ into a failed gate, for the cost of hashing a
few MB."""

from __future__ import annotations

from pathlib import Path

from wattgate.data.tokenizer import TOKENIZER_FILES
from wattgate.errors import InputError
from wattgate.gate.checks import Check
from wattgate.records.manifest import Manifest
from wattgate.run_files import first_line, read_manifest
from wattgate.train.export_files import tokenizer_folder, verified_tokenizer_files

NAME = "tokenizer"


def files_now(pretokenized: Path, manifest: Manifest) -> str:
    """The tokenizer files the recorded folder holds now, as " (it holds ...)", so a failure shows which one
    went missing or appeared; "" when the manifest names no folder or it is gone (the failure says so)."""
    try:
        folder = tokenizer_folder(pretokenized, manifest)
    except InputError:
        return ""
    if not folder.is_dir():
        return ""
    names = sorted(p.name for p in folder.iterdir() if p.name in TOKENIZER_FILES)
    return f" (it holds {', '.join(names)})" if names else ""


def check_tokenizer(pretokenized: Path) -> Check:
    """Passes when the manifest's tokenizer folder holds the files whose hash the manifest records (synthetic
    data without a tokenizer: nothing to export); fails with the export's own message otherwise."""
    manifest, _ = read_manifest(pretokenized)
    try:
        files = verified_tokenizer_files(pretokenized)
    except InputError as exc:
        return Check(NAME, False, f"{exc}{files_now(pretokenized, manifest)}")
    except OSError as exc:  # a tokenizer file that cannot be read cannot be exported either
        return Check(NAME, False, f"{exc.filename or pretokenized}: cannot read the tokenizer ({first_line(exc)})")
    if not files:
        return Check(NAME, True, "synthetic data: no tokenizer made it, final/ carries none")
    folder = files[0].parent
    assert manifest.tokenizer_sha256 is not None  # verified_tokenizer_files matched the files to it
    return Check(
        NAME,
        True,
        f"{folder}: {', '.join(p.name for p in files)} hash to the manifest's tokenizer_sha256 "
        f"{manifest.tokenizer_sha256[:12]}, as the export will verify",
    )

"""The files final/ carries beside the weights: the tokenizer the data was made with, verified by its hash,
and the input model's generation_config.json (its stop tokens and sampling defaults).

A final/ without its tokenizer cannot be used, and one with another tokenizer decodes the wrong text, so
the export refuses both: the manifest records where the tokenizer was (an absolute path) and the hash of its
files (data/tokenizer.tokenizer_sha256), and the folder must still hold exactly those files.
"""

from __future__ import annotations

from pathlib import Path

from wattgate.data.tokenizer import TOKENIZER_FILES, tokenizer_sha256
from wattgate.config import model_config
from wattgate.errors import InputError
from wattgate.records.manifest import Manifest
from wattgate.records.run_config import ModelConfig
from wattgate.run_files import MANIFEST, read_manifest


def tokenizer_folder(pretokenized: Path, manifest: Manifest) -> Path:
    """The manifest's tokenizer folder: a relative tokenizer_path is from the pretokenized folder (both in one
    results/, which may have moved), an absolute one as it is."""
    where = Path(pretokenized) / MANIFEST
    if not manifest.tokenizer_path or manifest.tokenizer_sha256 is None:
        raise InputError(f"{where}: no tokenizer_path and tokenizer_sha256; rerun pretokenize")
    return (Path(pretokenized) / manifest.tokenizer_path).resolve()


def verified_tokenizer_files(pretokenized: Path) -> list[Path]:
    """The tokenizer files pretokenize used, checked against the manifest's tokenizer_sha256."""
    manifest, _ = read_manifest(pretokenized)
    if manifest.synthetic and not manifest.tokenizer_path:
        return []  # random token ids (data/synthetic.py): no tokenizer made them
    folder = tokenizer_folder(pretokenized, manifest)
    where = Path(pretokenized) / MANIFEST
    files = sorted(p for p in folder.iterdir() if p.name in TOKENIZER_FILES) if folder.is_dir() else []
    if not files:
        raise InputError(
            f"{folder}: the tokenizer pretokenize used (named in {where}) is gone; final/ needs it: put the "
            "tokenizer folder back there, or rerun pretokenize with the tokenizer you mean"
        )
    found, expected = tokenizer_sha256(folder), manifest.tokenizer_sha256
    assert expected is not None  # tokenizer_folder refuses a manifest without it
    if found != expected:
        raise InputError(
            f"{folder}: the tokenizer files changed since pretokenize (sha256 {found[:12]}, {where} says "
            f"{expected[:12]}); restore them, or rerun pretokenize with this tokenizer"
        )
    return files


def export_extra_files(pretokenized: Path, model_cfg: ModelConfig | dict) -> list[Path]:
    """Every file final/ carries besides weights and config: the verified tokenizer files, then the input
    model's generation_config.json when it has one. An InputError when the tokenizer is missing or changed:
    call it before training too, so a long run does not end in a final/ that cannot be written."""
    extra = verified_tokenizer_files(Path(pretokenized))
    model_cfg = model_config(model_cfg)
    generation = Path(model_cfg.path) / "generation_config.json" if model_cfg.path else None
    if generation is not None and generation.is_file():
        extra.append(generation)
    return extra


def check_tokenizer_present(pretokenized: Path) -> None:
    """Before the first step: the tokenizer folder the export will need is there (its files are verified by hash
    at the export itself); an InputError naming it otherwise, so a long run does not end without a final/."""
    manifest, _ = read_manifest(pretokenized)
    if manifest.synthetic and not manifest.tokenizer_path:
        return
    folder = tokenizer_folder(pretokenized, manifest)
    if not folder.is_dir() or not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise InputError(
            f"{folder}: the tokenizer pretokenize used (named in {Path(pretokenized) / MANIFEST}) is gone; final/ "
            "needs it: put the tokenizer folder back there, or rerun pretokenize with the tokenizer you mean"
        )

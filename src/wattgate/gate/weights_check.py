"""Gate check `weights`: model.path's safetensors fit the model its config.json builds, from the files' headers
alone (names, shapes, dtypes; no tensor byte is read), with the trainer's own checks (train/weights.py
`checkpoint_sources`), so a folder whose weights do not match its config fails before anything is submitted
instead of at train start on an allocation."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from wattgate.errors import InputError, first_line
from wattgate.gate.checks import Check
from wattgate.records.gate import ModelFiles
from wattgate.records.run_config import RunConfig

NAME = "weights"


def check_weights(config: RunConfig) -> Check:
    """Pass with a note for a random-init model (model.config); else every parameter and persistent buffer of
    the model (built on the meta device at its real depth) has its tensor, of its shape and a float dtype, and
    no checkpoint tensor is left unused."""
    model_cfg = config.model
    if not model_cfg.path:
        return Check(NAME, True, "random init from model.config: no checkpoint to check")
    path = Path(model_cfg.path)
    from wattgate.proof.depth import meta_model  # torch and transformers: imported only for a checkpoint
    from wattgate.train.weights import checkpoint_sources

    try:
        model = meta_model(model_cfg)
        sources = checkpoint_sources(model, path)
    except InputError as exc:
        return Check(NAME, False, str(exc))
    except Exception as exc:  # noqa: BLE001 - transformers refusing the config is this check's failure, named
        return Check(NAME, False, f"{path}: transformers cannot build the model from config.json ({first_line(exc)})")
    pieces = [p for s in sources for p in s.all_pieces()]
    files = sorted({p.file.name for p in pieces})
    dtypes = Counter(str(p.info.dtype).removeprefix("torch.") for p in pieces)
    kinds = ", ".join(f"{n} {d}" for d, n in dtypes.most_common())
    stacked = [s for s in sources if s.stacked]
    experts = (
        f"; {len(stacked)} expert stacks from {sum(len(s.all_pieces()) for s in stacked)} per-expert tensors "
        "(transformers' conversion mapping, read and exported per expert)"
        if stacked
        else ""
    )
    return Check(
        NAME,
        True,
        f"{len(pieces)} tensors in {len(files)} safetensors file(s) of {path} match "
        f"{model.config.architectures[0]}'s names and shapes ({kinds}){experts}; read from the headers, no tensor "
        "loaded",
    )


def with_model_hashes(
    weights: Check, config: RunConfig, previous: ModelFiles | None
) -> tuple[Check, ModelFiles | None]:
    """The passed weights check with model.path's files hashed for the train job's launch check (gate.json
    `model_files`; train/model_hashes.py), or the check failed naming a file it could not read. A file the
    previous gate hashed (`previous`) and that has not been written since keeps its hashes."""
    from wattgate.train.model_hashes import hash_model_folder

    if not weights.passed or not config.model.path:
        return weights, None
    start = time.perf_counter()
    try:
        hashes, read = hash_model_folder(Path(config.model.path), previous)
    except InputError as exc:
        return Check(NAME, False, str(exc)), None
    total = sum(f.size for f in hashes.files.values())
    reused = f", {(total - read) / 1e9:.2f} GB unchanged since the last gate" if read < total else ""
    detail = (
        f"{weights.detail}; its {len(hashes.files)} weight and config file(s) hashed for the train job's check before "
        f"its first step ({read / 1e9:.2f} GB read in {time.perf_counter() - start:.1f} s{reused})"
    )
    return Check(NAME, True, detail), hashes


def previous_report(out: Path):
    """gate.json of the gate that ran last in `out` (None: none, or one that does not read): what it hashed is
    reused for files unchanged since."""
    from wattgate.run_files import read_gate_report

    try:
        return read_gate_report(out)
    except InputError:
        return None

"""Run identity: everything that changes what a run computes, recorded in every checkpoint.

A checkpoint is resumed only by a run with the same identity: the same plan (plan.json bytes,
which carry packs_sha256), the same pretokenized content (manifest.json bytes, which carry the
shards' content hashes), the same model (its config and a fingerprint of every weight file)
and the same result-changing train settings. Anything else (logging, checkpoint cadence,
export dtype, attention kernel, activation checkpointing) may change between attempts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from wattgate.records.checkpoint import ModelIdentity, PlanLink, Position, RunIdentity
from wattgate.errors import InputError
from wattgate.run_files import read_manifest, read_plan
from wattgate.config import model_config
from wattgate.records.run_config import RunConfig, TrainConfig, ModelConfig

# train.* keys that change the computed weights or the schedule
RESULT_SETTINGS = (
    "seq_len",
    "micro_batch_size",
    "grad_accum",
    "epochs",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "betas",
    "grad_clip",
    "seed",
    "optimizer",
    "max_steps",
    "mixed_precision",
)
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 1 << 16


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None


def weight_file_fingerprint(path: Path) -> str:
    """sha256 of a weight file's size, its first and last MiB and 16 blocks spread over it.

    A different checkpoint of the same shapes differs in every block; hashing all of a 60 GB
    model on every start would cost minutes of I/O.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    offsets = {0, max(0, size - (1 << 20))} | {size * k // SAMPLE_BLOCKS for k in range(SAMPLE_BLOCKS)}
    try:
        with open(path, "rb") as f:
            for offset in sorted(offsets):
                f.seek(offset)
                h.update(f.read(1 << 20 if offset in (0, max(0, size - (1 << 20))) else SAMPLE_BYTES))
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    return h.hexdigest()


def model_identity(model_cfg: ModelConfig | dict) -> ModelIdentity:
    model_cfg = model_config(model_cfg)
    if model_cfg.path:
        path = Path(model_cfg.path)
        weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin")) if path.is_dir() else []
        return ModelIdentity(
            config=_sha256_bytes(_read(path / "config.json")),
            weights=_sha256_bytes("".join(f"{p.name}:{weight_file_fingerprint(p)}\n" for p in weights).encode()),
        )
    return ModelIdentity(config=_sha256_bytes(json.dumps(model_cfg.config, sort_keys=True).encode()), weights="init")


def train_identity(train: TrainConfig) -> dict:
    """The result-changing train keys as the identity records them."""
    settings = train.to_json()
    return {k: settings[k] for k in RESULT_SETTINGS}


def model_train_identity(config: RunConfig) -> RunIdentity:
    """The run identity's `model` and `train` parts: what a run continued on another world size must share."""
    return RunIdentity(model=model_identity(config.model), train=train_identity(config.train))


def run_identity(config: RunConfig, plan_dir: Path, pretokenized: Path) -> RunIdentity:
    plan, plan_bytes = read_plan(plan_dir)
    segments = plan.segments or ()
    links = []
    for seg in segments[:-1]:
        assert seg.packs_sha256 is not None  # Plan refuses an earlier segment without its hash (__post_init__)
        links.append(PlanLink(packs_sha256=seg.packs_sha256, end_step=seg.end_step))
    return RunIdentity(
        plan=_sha256_bytes(plan_bytes),
        # earlier plans this one continues (pack/segments.py): their checkpoints up to each boundary resume
        links=tuple(links),
        pretokenized=_sha256_bytes(read_manifest(pretokenized)[1]),
        model=model_identity(config.model),
        train=train_identity(config.train),
    )


def identity_differences(
    recorded: RunIdentity | None, current: RunIdentity, position: Position | None = None
) -> list[str]:
    """The keys in which a checkpoint's identity differs from this run's (empty: resumable).

    A checkpoint of an earlier plan that the current plan continues on another world size (its segments
    link to that plan's packs up to a boundary step at or after the checkpoint) is not a difference."""
    if recorded is None:
        return ["run identity (the checkpoint predates it)"]
    parts = {"plan": (recorded.plan, current.plan), "pretokenized": (recorded.pretokenized, current.pretokenized)}
    diffs = [name for name, (a, b) in parts.items() if a != b]
    position = position or Position()
    step = position.step if position.step is not None else -1
    if diffs[:1] == ["plan"] and any(
        link.packs_sha256 == position.plan and step <= link.end_step for link in current.links
    ):
        diffs.remove("plan")
    return diffs + model_train_differences(recorded, current)


def model_train_differences(recorded: RunIdentity | None, current: RunIdentity, values: bool = False) -> list[str]:
    """The model parts and train keys in which a recorded identity differs from `current` (`model` and `train`
    parts only): what pack compares before it continues a run on another world size, so that train never
    sets aside the checkpoints it continues. `values` adds 'old -> new' to each train key."""
    if recorded is None:
        return ["run identity (the checkpoint predates it)"]
    model, now = recorded.model or ModelIdentity(), current.model or ModelIdentity()
    parts = {"config": (model.config, now.config), "weights": (model.weights, now.weights)}
    diffs = [f"model {part}" for part, (a, b) in parts.items() if a != b]
    before, after = recorded.train or {}, current.train or {}
    for k in RESULT_SETTINGS:
        if before.get(k) != after.get(k):
            diffs.append(f"train.{k} ({before.get(k)!r} -> {after.get(k)!r})" if values else f"train.{k}")
    return diffs

"""Before the first step, what trains is what the gate verified: the shards, the tokenizer and model.path.

The gate checked every shard against manifest.json's `shard_hashes` and that plan.json was made from this
manifest (its sha256), pretokenize recorded the tokenizer's hash, and the gate hashed model.path's files (gate.json
`model_files`, which launch copies into the run folder); the launch checked that the gate's marker names plan.json.
A shard or a weight changed after that (a byte flipped, a file replaced by another run's) trained silently, and a
changed tokenizer was found only at the export. So every rank hashes its share of the shards and of the model's
chunks (xxh3_128: ~8 GB/s from the page cache, a 65 GB model or a 100 GB corpus a few seconds over 16 ranks), one
rank the tokenizer, rank 0 checks the manifest against the plan, and one gather gives every rank every verdict:
all stop together with the same line, naming the first changed file, or all go on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.distributed as dist

from wattgate.data.shards import shard_hash
from wattgate.errors import InputError
from wattgate.records.plan import Plan
from wattgate.records.gate import ModelFiles
from wattgate.run_files import MANIFEST, MODEL_HASHES, read_manifest
from wattgate.train.export_files import verified_tokenizer_files
from wattgate.train.model_hashes import changed_model_files

RERUN = (
    "changed after the gate verified it: restore it, or rerun the stages it feeds (snakemake reruns pretokenize, pack "
    "and gate for data and tokenizer, the gate for model.path)"
)


def changed_data(pretokenized: Path, plan: Plan, rank: int, world: int) -> list[str]:
    """This rank's share of the data check: one line per file that is not what the gate verified."""
    pretokenized = Path(pretokenized)
    manifest, raw = read_manifest(pretokenized)
    problems = []
    if rank == 0 and plan.pretokenized_manifest_sha256 not in (None, hashlib.sha256(raw).hexdigest()):
        problems.append(f"{pretokenized / MANIFEST}: not the manifest plan.json was made from (sha256 differs)")
    expected = manifest.shard_hashes or {}
    for name in sorted(expected)[rank::world]:
        try:
            found = shard_hash(pretokenized / name)
        except OSError as exc:
            problems.append(f"{pretokenized / name}: cannot read ({exc.strerror})")
            continue
        if found != expected[name]:
            problems.append(
                f"{pretokenized / name}: content hash {found[:12]}, the gate verified {expected[name][:12]} "
                "(manifest.json shard_hashes)"
            )
    return problems


def changed_inputs(data: Path, pretokenized: Path, plan: Plan, run_dir: Path, rank: int, world: int) -> list[str]:
    """This rank's share of the whole check: the shards it reads (`data`: the pretokenized folder or its local
    copy), the tokenizer (one rank; found from the pretokenized folder itself) and model.path's chunks."""
    problems = changed_data(data, plan, rank, world)
    if rank == 1 % world:  # the tokenizer is small: one rank, not rank 0, which has the manifest
        try:
            verified_tokenizer_files(pretokenized)
        except InputError as exc:
            problems.append(str(exc))
    model = Path(run_dir) / MODEL_HASHES
    if model.exists():  # launch copied the gate's hashes: a random init or ranks started by hand have none
        try:
            problems += changed_model_files(ModelFiles.read(model, "wattgate launch"), rank, world)
        except InputError as exc:
            problems.append(str(exc))
    return problems


def verify_inputs(data: Path, pretokenized: Path, plan: Plan, run_dir: Path, rank: int, world: int) -> None:
    """Every rank: the shards, manifest, tokenizer and model files are the bytes the gate verified, or the same
    InputError on every rank."""
    mine = changed_inputs(data, pretokenized, plan, run_dir, rank, world)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    problems = [line for part in everyone for line in (part or [])]
    if problems:
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        raise InputError(f"{problems[0]}{more}: {RERUN}")

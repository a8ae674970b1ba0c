"""Before the first step, the training data is the data the gate verified.

The gate checked every shard against manifest.json's `shard_hashes` and that plan.json was made from this
manifest (its sha256); the launch checked that the gate's marker names plan.json. A shard changed after that (a
byte flipped, a file replaced by another run's) trained silently. So every rank hashes its share of the shards
(xxh3_128, the manifest's own hash: ~8 GB/s from the page cache, a 100 GB corpus a few seconds over 16 ranks),
checks the manifest against the plan, and one gather gives every rank every verdict: all stop together with the
same line, naming the first changed file, or all go on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.distributed as dist

from wattgate.data.pretokenize import shard_hash
from wattgate.errors import InputError
from wattgate.records.plan import Plan
from wattgate.run_files import MANIFEST, read_manifest

RERUN = "the data changed after the gate: rerun pretokenize, pack and gate (snakemake reruns them), or restore it"


def changed_inputs(pretokenized: Path, plan: Plan, rank: int, world: int) -> list[str]:
    """This rank's share of the check: one line per file that is not what the gate verified."""
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


def verify_training_data(pretokenized: Path, plan: Plan, rank: int, world: int) -> None:
    """Every rank: the shards and manifest are the bytes the gate verified, or the same InputError on every rank."""
    mine = changed_inputs(pretokenized, plan, rank, world)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    problems = [line for part in everyone for line in (part or [])]
    if problems:
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        raise InputError(f"{problems[0]}{more}: {RERUN}")

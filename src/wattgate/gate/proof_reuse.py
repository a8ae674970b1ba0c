"""A gate rerun reuses the collective proof when nothing the dry run reads has changed.

The proof is a function of: wattgate's code (its version and the sha256 of its own source, so an edited
checkout is never taken for the released one), torch's and transformers' versions (FSDP2's collectives, the
model's modules), the model's config (model.config, or model.path's config.json: the weights are never read),
every train setting (the dry run's Trainer reads the whole section: mixed precision, activation
checkpointing, attention, cadence, micro-batch and validation sizes), the GPU model (the mixed-precision
policy), the world size and its mesh (parallel.replicate), and every rank's step class at every step
(micro-batch counts, log / validation / checkpoint / epoch end / last, validation micro-batches) with the steps
chosen for the dry run, and the packed rows of every rank's micro-batches (with the model's shapes they group
the ranks, proof/ranks.py). The data's values are not an input: the proof's premise is that collectives never
depend on them.

The proof is kept in the gate's own --out folder (PROOF_CACHE beside gate.json, with the inputs it was proved
for), so it can only be reused by a rerun of that gate. Nothing here imports torch: a reused proof costs the
key (reading packs.parquet's columns) and one JSON file.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import wattgate
from wattgate.artifacts import write_json_atomic
from wattgate.config import context_degree, expert_degree, replicate_degree
from wattgate.errors import InputError
from wattgate.records.gate import Collectives, ProofCache, Reused
from wattgate.proof.classes import first_steps, plans_by_rank
from wattgate.run_files import PROOF_CACHE, read_plan
from wattgate.records.run_config import RunConfig

# 2: the proof runs DCP's save and load and dry-runs a resume (gate.json collectives.resume): a kept proof of 1
# proved less, and is proved again
CACHE_FORMAT = 2


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


@functools.lru_cache(maxsize=1)
def source_sha256() -> str:
    """sha256 over wattgate's own Python files (names and bytes): any edit to the code is another proof."""
    root = Path(wattgate.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def proof_inputs(config: RunConfig, plan_dir: Path) -> dict:
    """Everything the proof's result depends on (see the module docstring), as plain JSON."""
    plan, _ = read_plan(plan_dir)
    # the classes as the dry run computes them, from the same train section (rank_schedule's cadence and max_steps)
    plans = plans_by_rank(plan, plan_dir, config.train)
    classes = [p.classes for p in plans]
    first = plan.first_step
    model = config.model.to_json()
    if config.model.path:
        try:
            model["config.json sha256"] = _sha256((Path(config.model.path) / "config.json").read_bytes())
        except OSError:
            model["config.json sha256"] = None  # the proof itself names the missing file
    return {
        "format_version": CACHE_FORMAT,
        "wattgate": wattgate.__version__,
        "wattgate_source_sha256": source_sha256(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "model": model,
        "train": config.train.to_json(),
        "gpu_model": config.cluster.gpu_model,
        "world_size": plan.world_size,
        "replicate": replicate_degree(config),  # the mesh: HSDP's groups are other collectives
        # EP's groups and all-to-alls; absent at 1, so proofs made before the key existed stay reusable
        **({"expert": expert_degree(config)} if expert_degree(config) > 1 else {}),
        # CP's mesh, its gathers and the plan's world times C; absent at 1 (proofs made before the key stay reusable)
        **({"context": context_degree(config)} if context_degree(config) > 1 else {}),
        "steps": first_steps(classes, first),
        "classes_sha256": _sha256(json.dumps([[c.key() for c in seq] for seq in classes]).encode()),
        "micro_batch_rows_sha256": _sha256(b"|".join(p.rows for p in plans)),  # the rank groups follow them
    }


def inputs_sha256(inputs: dict) -> str:
    return _sha256(json.dumps(inputs, sort_keys=True, default=str).encode())[:16]


def read_cache(out: Path) -> ProofCache | None:
    """The kept proof, or None when there is none or it is unreadable (a cache: the proof then runs again)."""
    try:
        return ProofCache.read(Path(out) / PROOF_CACHE)
    except InputError:
        return None


def changed_inputs(old: dict | None, new: dict) -> list[str] | None:
    """The inputs that differ from the kept proof's (None: no kept proof)."""
    if old is None:
        return None
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def reusable(proof: Collectives) -> bool:
    """A proof that ran to its verdict (a dry run that could not start or broke is not kept: it may be the
    machine's, not the inputs')."""
    return proof.elapsed_s is not None and proof.depth is not None


def reused_section(entry: ProofCache, inputs: dict, t0: float) -> Collectives:
    """gate.json `collectives` from a kept proof: its verdict and record as proved, saying so."""
    proof = entry.collectives
    return proof.replace(
        reused=Reused(proved_at=entry.proved_at, proved_s=proof.elapsed_s),
        changed_inputs=(),
        inputs_sha256=inputs_sha256(inputs),
        detail=f"{proof.detail} (reused: the proof's inputs are unchanged since {entry.proved_at})",
        elapsed_s=round(time.perf_counter() - t0, 3),
    )


def write_cache(out: Path, inputs: dict, proof: Collectives) -> None:
    proved_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json_atomic(
        Path(out) / PROOF_CACHE, ProofCache(inputs=inputs, collectives=proof, proved_at=proved_at).to_json()
    )

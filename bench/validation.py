"""What the validation split costs on 1M documents: the carve and the validation pass's plan against the pack
stage without a split, and the gate's validation checks (leakage included) against the gate without one;
each against a plain-Python version of the same work, run in the same process.

Targets (issue 22): carve + validation plan at most 10% more pack time; the gate's validation checks and
their inputs at most 0.3 s.

`--smoke`: 20,000 documents, one run of each.

    python bench/validation.py [--n 1000000] [--fraction 0.01] [--repeat 3] [--smoke]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pyarrow.parquet as pq

from benchlib import Parser, figure, positive_float, positive_int
from gate import lognormal_lengths, make_config, write_pretokenized  # bench/gate.py: the gate bench's corpus
from wattgate.config import run_config
from wattgate.data.split import VALIDATION_FILE, carve, carve_keys, doc_ids_sha256, write_validation_ids
from wattgate.gate import validation_checks as V
from wattgate.gate.inputs import load_inputs
from wattgate.gate.memory import estimate_memory
from wattgate.model_spec import load_model_spec
from wattgate.gate.run import fit_settings, run_checks
from wattgate.pack.plan import build_plan

PACK_TARGET = 1.10
GATE_TARGET_S = 0.3
MASK = (1 << 64) - 1
SMOKE_DOCS = 20_000


def best_of(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return out, min(times)


def content_hashes(pretok: Path) -> np.ndarray:
    manifest = json.loads((pretok / "manifest.json").read_text())
    return np.concatenate(
        [pq.read_table(pretok / n, columns=["content_hash"]).column(0).to_numpy() for n in manifest["shards"]]
    )


def python_carve(hashes: list[int], fraction: float, seed: int) -> list[bool]:
    """The carve one document at a time in plain Python (the same splitmix64 key, the same threshold)."""

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
        return x ^ (x >> 31)

    salt, limit = mix(seed), int(fraction * 2.0**64)
    return [mix((h & MASK) ^ salt) < limit for h in hashes]


def with_split(pretok: Path, dest: Path, held: np.ndarray, lengths: np.ndarray) -> None:
    """The same shards (hard links) with the held-out documents recorded as pretokenize records them."""
    dest.mkdir()
    manifest = json.loads((pretok / "manifest.json").read_text())
    for name in manifest["shards"]:
        os.link(pretok / name, dest / name)
    ids = np.flatnonzero(held)
    write_validation_ids(dest / VALIDATION_FILE, ids)
    manifest["validation"] = {
        "source": "carve",
        "file": VALIDATION_FILE,
        "num_docs": int(len(ids)),
        "num_tokens": int(lengths[held].sum()),
        "doc_ids_sha256": doc_ids_sha256(ids),
        "train_docs": int((~held).sum()),
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def python_validation_checks(inputs) -> bool:
    """validation_steps, validation_conservation and leakage over Python lists, sets and Counters."""
    v, world = inputs.validation, inputs.plan.world_size
    packs = v.packs
    micro_per_rank = [len({int(m) for m, r in zip(packs.micro, packs.rank) if r == k}) for k in range(world)]
    seen = Counter(int(d) for d in packs.doc_ids)
    held = {int(d) for d in v.held_out}
    once = all(seen[d] == 1 for d in held) and set(seen) == held
    train_hashes = {int(h) for d, h in enumerate(v.content_hashes) if d not in held}
    no_copy = not any(int(v.content_hashes[d]) in train_hashes for d in held)
    not_trained = not any(int(d) in held for d in inputs.packs.doc_ids)
    return len(set(micro_per_rank)) == 1 and once and no_copy and not_trained


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0], smoke=f"{SMOKE_DOCS:,} documents, one run of each")
    parser.add_argument("--n", type=positive_int, default=None, help="documents (default 1,000,000)")
    parser.add_argument("--fraction", type=positive_float, default=0.01)
    parser.add_argument("--repeat", type=positive_int, default=None, help="runs of each side (default 5)")
    args = parser.parse_args()
    if args.fraction >= 1:
        parser.error(f"argument --fraction: must be below 1, not {args.fraction:g}")
    args.n = args.n or (SMOKE_DOCS if args.smoke else 1_000_000)
    args.repeat = args.repeat or (1 if args.smoke else 5)
    with tempfile.TemporaryDirectory(prefix="wattgate-bench-validation-") as tmp:
        tmp = Path(tmp)
        lengths = lognormal_lengths(args.n)
        plain, split = tmp / "plain", tmp / "split"
        write_pretokenized(plain, lengths)
        config = make_config(1, int(lengths.sum()))

        hashes, t_read = best_of(lambda: content_hashes(plain), args.repeat)
        held, t_carve = best_of(lambda: carve(hashes, args.fraction, None, 0), args.repeat)
        py_hashes = hashes.tolist()
        py_held, t_py_carve = best_of(lambda: python_carve(py_hashes, args.fraction, 0), 1)
        assert py_held == held.tolist(), "the plain-Python carve disagrees"
        assert (carve_keys(hashes, 0) < np.uint64(int(args.fraction * 2.0**64))).tolist() == py_held
        with_split(plain, split, held, lengths)

        # alternated, best of each: on a shared 2-core machine a run's neighbours change between runs
        t_plain = t_split = float("inf")
        for _ in range(args.repeat):
            t_plain = min(t_plain, best_of(lambda: build_plan(run_config(config), plain, tmp / "plan-plain"), 1)[1])
            plan, t = best_of(lambda: build_plan(run_config(config), split, tmp / "plan-split"), 1)
            t_split = min(t_split, t)
        v = plan.validation
        ratio = (t_read + t_carve + t_split) / t_plain
        print(f"== {args.n:,} documents, {int(held.sum()):,} held out ({args.fraction:g}), world 16")
        print(
            f"  carve: read content_hash {t_read:.3f} s + carve {t_carve:.3f} s (plain Python {t_py_carve:.2f} s: "
            f"{t_py_carve / t_carve:.0f}x)"
        )
        print(
            f"  pack: no split {t_plain:.3f} s, split {t_split:.3f} s (validation pass {v.num_packs:,} packs, "
            f"{v.micro_batches_per_rank} micro-batches per rank, {v.strategy})"
        )
        print(
            f"  carve + pack with validation / pack without: {ratio:.3f} "
            f"(target <= {PACK_TARGET:.2f}: {'PASS' if ratio <= PACK_TARGET else 'FAIL'})"
        )
        figure(
            "validation",
            f"carve + pack with the validation pass, {args.n:,} documents",
            f"{t_read + t_carve + t_split:.3f} s, {ratio:.3f}x the baseline (target <= {PACK_TARGET:.2f}x)",
            f"pack without a split {t_plain:.3f} s",
        )

        ckpt = tmp / "train" / "bench" / "checkpoints"
        spec = load_model_spec(run_config(config))
        terms = estimate_memory(spec, fit_settings(run_config(config)))

        def gate(pretok, plan_dir):
            inputs = load_inputs(run_config(config), pretok, plan_dir, ckpt)
            return inputs, run_checks(inputs, spec, terms)

        t_gate_plain = t_gate_split = float("inf")
        for _ in range(args.repeat):
            t_gate_plain = min(t_gate_plain, best_of(lambda: gate(plain, tmp / "plan-plain"), 1)[1])
            (inputs, checks), t = best_of(lambda: gate(split, tmp / "plan-split"), 1)
            t_gate_split = min(t_gate_split, t)
        names = ("validation_steps", "validation_conservation", "leakage")
        assert all(c.passed for c in checks if c.name in names), [c for c in checks if c.name in names]

        def ours():
            return [
                V.check_validation_steps(inputs.validation, 16, 1, v.micro_batches_per_rank),
                V.check_validation_conservation(inputs.validation, inputs.doc_tokens, inputs.manifest.validation, 8192),
                V.check_leakage(inputs.validation, inputs.packs),
            ]

        _, t_checks = best_of(ours, args.repeat)
        ok, t_py_checks = best_of(lambda: python_validation_checks(inputs), 1)
        assert ok
        added = t_gate_split - t_gate_plain
        print(
            f"  gate (load + checks): no split {t_gate_plain:.3f} s, split {t_gate_split:.3f} s: validation adds "
            f"{added:+.3f} s (target <= {GATE_TARGET_S:.1f} s: {'PASS' if added <= GATE_TARGET_S else 'FAIL'})"
        )
        print(
            f"  the three validation checks alone {t_checks:.3f} s; plain Python {t_py_checks:.2f} s "
            f"({t_py_checks / t_checks:.0f}x)"
        )
        figure(
            "validation",
            f"the gate (load + checks) with a validation split, {args.n:,} documents",
            f"{t_gate_split:.3f} s, the split adds {added:+.3f} s (target <= {GATE_TARGET_S:.1f} s)",
            f"the gate without a split {t_gate_plain:.3f} s",
        )


if __name__ == "__main__":
    main()

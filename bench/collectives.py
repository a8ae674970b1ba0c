"""How long the collective proof (the gate's `collectives` check, wattgate/proof/) takes.

1. The embedded default (config/config.yaml: 2 ranks, a tiny Qwen3): demo corpus, tokenizer, pretokenize and
   pack through the CLI (not timed), then the proof. Target (issue 24): at most 10 s.
2. Each Qwen3-32B example (config/examples/: 2 x 8 ranks, seq_len 8192) on a random corpus of `--docs`
   documents with Qwen3's vocabulary, packed by the pack stage: the proof at full width (hidden 5120, vocab
   151,936) with 2 proxy layers scaled to 64. Target: at most 60 s for world size 16. The model is given as
   model.config (random init): with model.path the proof reads the folder's safetensors headers.

Each proof is set against the gate's other checks on the same inputs (run_gate with gate.collectives off),
measured in the same run. `--smoke`: the first example on 300 documents with its cluster cut to one node of 2
GPUs (16 ranks' dry runs take half a minute), not the embedded default (bench/gate.py --smoke proves it, through
the same default_plan, in its cold gate).

    python bench/collectives.py [--docs 4000] [--skip-default] [--smoke]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchlib import Parser, figure, positive_int

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET_S, EXAMPLE_TARGET_S = 10.0, 60.0
EXAMPLES = ("qwen3-32b-2x8-b300.yaml", "qwen3-32b-2x8-h100.yaml")
SMOKE_DOCS, SMOKE_WORLD = 300, 2
QWEN3_32B = {  # Qwen3-32B's config.json: the fields the model build reads
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
}


def cli(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "wattgate", *args], cwd=cwd, check=True, capture_output=True)


def default_plan(work: Path) -> tuple[dict, Path, Path]:
    from wattgate.config import validate_config

    c = str(ROOT / "config" / "config.yaml")
    cli("demo-corpus", "--config", c, "--out", "results/corpus/demo.jsonl", cwd=work)
    cli("demo-corpus", "--kind", "notes", "--config", c, "--out", "results/corpus/demo-notes.jsonl", cwd=work)
    cli("train-tokenizer", "--config", c, "--out", "tok", cwd=work)  # on data.inputs: both sources
    cli("pretokenize", "--config", c, "--tokenizer", "tok", "--out", "pretok", cwd=work)
    cli("pack", "--config", c, "--pretokenized", "pretok", "--out", "plan", cwd=work)
    config = validate_config(yaml.safe_load(Path(c).read_text()), source=c)
    config["tokenizer"]["path"] = str(work / "tok")
    return config, work / "pretok", work / "plan"


def example_plan(name: str, work: Path, docs: int, world: int | None = None) -> tuple[dict, Path, Path]:
    """The example's config and a random corpus of `docs` documents packed for it; `world`: one node of that
    many GPUs instead of the example's cluster."""
    from wattgate.config import run_config, validate_config
    from wattgate.data.synthetic import write_random_pretokenized
    from wattgate.pack.plan import build_plan

    model = work / "Qwen3-32B"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_32B))
    config = yaml.safe_load((ROOT / "config" / "examples" / name).read_text())
    # the shape as model.config, random init: the proof reads a model.path's safetensors headers, and 32B of
    # weights are not at hand (the folder with config.json stands in for the tokenizer path alone)
    config["model"] = {"path": None, "config": dict(QWEN3_32B)}
    config["tokenizer"]["path"] = str(model)
    if world is not None:
        config["cluster"].update(nodes=1, gpus_per_node=world)
    config = validate_config(config, source=name)
    seq = config["train"]["seq_len"]
    lengths = np.clip(np.random.default_rng(0).lognormal(7.0, 1.0, docs), 16, seq).astype(int)
    pretok = write_random_pretokenized(work / "pretok", lengths, QWEN3_32B["vocab_size"], validation_fraction=0.02)
    build_plan(run_config(config), pretok, work / "plan")
    return config, pretok, work / "plan"


def cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the proof's forked dry-run workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def gate_without_proof(config: dict, pretok: Path, plan: Path, out: Path) -> float:
    """Seconds of the gate's other checks on the same inputs: run_gate with gate.collectives off."""
    from wattgate.config import run_config
    from wattgate.gate.run import run_gate

    off = run_config(dict(config, gate=dict(config["gate"], collectives=False)))
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    run_gate(off, pretok, plan, out)
    return time.perf_counter() - t0


def prove(label: str, config: dict, pretok: Path, plan: Path, target: float) -> dict:
    from wattgate.config import run_config
    from wattgate.proof.prove import prove_collectives

    t0, c0 = time.perf_counter(), cpu_s()
    report = prove_collectives(run_config(config), pretok, plan)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    steps = sum(c.steps for c in report.classes or ())
    print(
        f"{label}: {report.world_size} ranks, {len(report.classes or ())} step classes over {steps} steps "
        f"(dry-run steps {list(report.steps_run or ())}), {report.proxy_layers} proxy layers of "
        f"{report.depth.layers if report.depth else '?'}: {'PASS' if report.passed else 'FAIL'} in {wall:.1f} s "
        f"({cpu:.1f} s of CPU over the gate's process and its dry-run workers; target {target:.0f} s: "
        f"{'met' if wall <= target else 'MISSED'})"
    )
    for c in report.classes or ():
        print(
            f"  {c.label}: {c.steps} steps, {c.collectives} collectives at the proxy's depth, "
            f"{c.collectives_at_depth} at full depth, {c.fingerprint}"
        )
    if not report.passed:
        print("  " + report.detail)
    other = gate_without_proof(config, pretok, plan, plan.parent / "gate-without-proof")
    figure(
        "collectives",
        f"the collective proof, {label} ({report.world_size} ranks)",
        f"{wall:.2f} s (target <= {target:.0f} s)",
        f"the gate's other checks on the same inputs {other:.2f} s",
    )
    return {
        "label": label,
        "seconds": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "passed": report.passed,
        "target_s": target,
    }


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0], smoke=f"one example on {SMOKE_DOCS} documents and 2 ranks")
    ap.add_argument("--docs", type=positive_int, default=None, help="documents of each example's corpus (4000)")
    ap.add_argument("--skip-default", action="store_true")
    args = ap.parse_args()
    docs = args.docs or (SMOKE_DOCS if args.smoke else 4000)
    examples = EXAMPLES[:1] if args.smoke else EXAMPLES
    world = SMOKE_WORLD if args.smoke else None
    import torch  # noqa: F401 - imported before any timing: the gate process pays it once

    results = []
    with tempfile.TemporaryDirectory(prefix="wattgate-bench-collectives-") as tmp:
        if not (args.skip_default or args.smoke):
            work = Path(tmp) / "default"
            work.mkdir()
            results.append(prove("embedded default", *default_plan(work), DEFAULT_TARGET_S))
        for name in examples:
            label = name if world is None else f"{name} cut to 1 x {world} GPUs"
            results.append(prove(label, *example_plan(name, Path(tmp) / name, docs, world), EXAMPLE_TARGET_S))
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Per-rank host peak of a many-expert MoE trained by `wattgate train` at parallel.expert 1, 2 and 4, against EP 1.

Shapes: a random-init Qwen3-MoE of 64 experts (top 4), hidden 256, expert intermediate 512, 4 layers (the experts
are ~95% of its ~105M parameters); 4 gloo ranks (OMP_NUM_THREADS=1, the environment `wattgate launch` gives CPU
ranks), seq_len 128, micro_batch_size 1, 3 SGD steps. Each degree runs the real training path (train/mesh.py's
EP mesh, train/model.py parallelize, train/expert_parallel.py's all-to-all dispatch) on the same pretokenized data
and plan, one torchrun each, in this one invocation.

Per rank the peak is TRAINED's memory record (VmHWM; steady: reset after loading). Printed per degree: the max over
ranks of the load and steady peaks, the steady peak's ratio to EP 1's (the baseline), and the gate's steady estimate
(gate/memory.py, summed terms) with its ratio to the measured peak. At EP E a rank gathers E-th of each MoE layer's
experts instead of all of them, so the steady peak should fall with E while the sharded state stays the same.

Figures, per degree > 1: the steady per-rank peak against EP 1's in the same run. `--smoke`: 32 experts, hidden
64, 2 layers, 2 ranks, EP 1 and 2, 1 step.

    python bench/expert_memory.py [--experts 1 2 4] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import yaml

from benchlib import Parser, fail, figure, positive_int
from steady_memory import TRAIN, rank_env, torchrun

WORLD = 4
SHAPE = {
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SMOKE_SHAPE = dict(
    SHAPE, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=32, num_hidden_layers=2,
    head_dim=16,
)  # fmt: skip
EP_TRAIN = dict(TRAIN, seq_len=128, max_steps=3, checkpoint_every=3)
SMOKE_TRAIN = dict(EP_TRAIN, seq_len=32, max_steps=1, checkpoint_every=1)
GIB = 1 << 30


def config_at(shape: dict, train: dict, world: int, expert: int) -> dict:
    from wattgate.config import validate_config

    return validate_config(
        {
            "run_name": f"expert-{expert}",
            "train": dict(train),
            "model": {"config": dict(shape)},
            "cluster": {"nodes": 1, "gpus_per_node": world, "gpu_model": "cpu"},
            "parallel": {"expert": expert},
            "pack": {"remainder": "drop"},
        }
    )


def make_data(work: Path, config: dict, world: int) -> None:
    """Pretokenized random documents and the plan every degree trains (the plan does not depend on the degree)."""
    import numpy as np

    from wattgate.config import run_config
    from wattgate.data.synthetic import write_random_pretokenized
    from wattgate.pack.plan import build_plan

    train = config["train"]
    seq_len = train["seq_len"]
    lengths = np.random.default_rng(0).integers(seq_len - 14, seq_len, 3 * world * train["max_steps"])
    write_random_pretokenized(work / "pretokenized", lengths, config["model"]["config"]["vocab_size"], 0)
    build_plan(run_config(config), work / "pretokenized", work / "plan")


def run_degree(work: Path, config: dict, world: int) -> dict:
    """`wattgate train` at the config's parallel.expert: per-rank load and steady host peaks (GiB)."""
    expert = config["parallel"]["expert"]
    path = work / f"config-ep{expert}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / f"train-ep{expert}"
    args = ["-m", "wattgate", "train", "--config", str(path), "--pretokenized", str(work / "pretokenized")]
    args += ["--plan", str(work / "plan"), "--run-dir", str(out)]
    torchrun(args, work / f"train-ep{expert}.log", rank_env(config, launcher=True), world)
    ranks = json.loads((out / "TRAINED").read_text())["memory"]["per_rank"]
    return {phase: [r["phases"][phase]["host_peak_gib"] for r in ranks] for phase in ("load", "steady")}


def gate_steady_gib(config: dict) -> float:
    from wattgate.config import run_config
    from wattgate.gate.memory import estimate_memory
    from wattgate.gate.run import fit_settings
    from wattgate.model_spec import load_model_spec

    typed = run_config(config)
    return sum(estimate_memory(load_model_spec(typed), fit_settings(typed)).values()) / GIB


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0], smoke="32 experts, hidden 64, 2 layers, 2 ranks, EP 1 2")
    parser.add_argument("--experts", type=positive_int, nargs="+", default=None, help="degrees (default 1 2 4)")
    parser.add_argument("--keep", type=Path, help="work folder to keep (default: a temporary one)")
    a = parser.parse_args()
    world = 2 if a.smoke else WORLD
    degrees = a.experts or ([1, 2] if a.smoke else [1, 2, 4])
    if degrees[0] != 1 or any(world % e for e in degrees):
        fail("expert_memory", f"--experts: give 1 first (the baseline), then divisors of the {world} ranks")
    shape, train = (SMOKE_SHAPE, SMOKE_TRAIN) if a.smoke else (SHAPE, EP_TRAIN)
    work = a.keep or Path(tempfile.mkdtemp(prefix="wattgate-expert-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    configs = {e: config_at(shape, train, world, e) for e in degrees}
    make_data(work, configs[1], world)
    rows = {}
    for e in degrees:
        rows[e] = {"peaks": run_degree(work, configs[e], world), "gate": gate_steady_gib(configs[e])}
        print(json.dumps({"expert": e, **rows[e]}), flush=True)
    base = max(rows[1]["peaks"]["steady"])
    print(f"\nper-rank host peak, GiB (max over {world} ranks); {shape['num_experts']} experts, {world} CPU ranks")
    print(f"{'expert':>6} {'load':>6} {'steady':>7} {'vs EP 1':>8} {'gate':>6} {'gate/steady':>11}")
    for e, r in rows.items():
        load, steady = max(r["peaks"]["load"]), max(r["peaks"]["steady"])
        print(f"{e:>6} {load:>6.3f} {steady:>7.3f} {steady / base:>8.3f} {r['gate']:>6.3f} {r['gate'] / steady:>11.2f}")
        if e == 1:
            continue
        figure(
            "expert_memory",
            f"wattgate train at parallel.expert {e}, {shape['num_experts']} experts on {world} CPU ranks, steady "
            "per-rank host peak",
            f"{steady:.3f} GiB, {steady / base:.3f}x EP 1 (the gate's estimate {r['gate']:.3f} GiB)",
            f"parallel.expert 1 in the same run {base:.3f} GiB",
        )
    if a.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Steady-state host memory per CPU rank: `wattgate train` against a plain FSDP2 loop, and the gate's estimate.

Shapes (issue 23, item 5): Qwen3 with hidden 1024, vocab 2048, 12 and 24 layers, written as bf16
safetensors; 4 gloo ranks (OMP_NUM_THREADS=1), seq_len 64, micro_batch_size 1, 2 SGD steps, one
checkpoint. Both sides load the same way (wattgate's sharded loader, train/weights.py) so the
comparison is the step: the plain loop is fully_shard per layer and root, forward, summed
cross-entropy, backward, SGD, zero_grad, then one dcp.save of the model and optimizer state.

Per rank the steady peak is VmHWM reset after loading (wattgate: TRAINED's memory.steady, the same
measurement). Printed per shape: the max over ranks of each side, the gate's steady estimate
(gate/memory.py, summed terms) and its ratio to the measured peak, and the growth from 12 to 24
layers as a multiple of the added fp32 model size (a sharded SGD step needs ~0.5x: parameters and
gradients, 8 bytes per parameter over 4 ranks). Both sides run with the environment
`wattgate launch` gives CPU ranks (train/launch.py, launch_env), and the plain loop also without
it (glibc's defaults) as a baseline.

Figures, per shape: wattgate's steady peak against the plain loop's (the launcher's environment), with the gate's
estimate. `--smoke`: hidden 128, 2 layers, 2 ranks, and no glibc-defaults run of the plain loop (the same code
as the plain run, another environment).

    python bench/steady_memory.py [--layers 12 24] [--ranks 4] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchlib import Parser, figure, positive_int

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
SHAPE = {
    "model_type": "qwen3",
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
TRAIN = {
    "seq_len": 64,
    "micro_batch_size": 1,
    "grad_accum": 1,
    "epochs": 1,
    "warmup_steps": 0,
    "optimizer": "sgd",
    "lr": 1e-3,
    "max_steps": 2,
    "checkpoint_every": 2,
    "checkpoint_keep": 1,
    "checkpoint_at_epoch_end": False,
    "log_every": 1,
    "tensorboard": False,
    "attn_implementation": "sdpa",
    "export_dtype": "bfloat16",
}
SMOKE_SHAPE = dict(
    SHAPE, hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32
)
GIB = 1 << 30
TARGET_GROWTH = 0.8  # x the added fp32 model size
TARGET_GATE = 0.15  # |gate / measured - 1|


def save_model(path: Path, layers: int, shape: dict) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(shape, num_hidden_layers=layers)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    return path


def make_inputs(work: Path, layers: int, world: int, shape: dict) -> tuple[dict, Path]:
    """bf16 model folder, pretokenized data, a plan for 2 steps on `world` ranks, and the config file."""
    import numpy as np

    from wattgate.config import run_config, validate_config
    from wattgate.data.synthetic import write_random_pretokenized
    from wattgate.pack.plan import build_plan

    folder = work / f"L{layers}"
    folder.mkdir(parents=True)
    model = save_model(folder / "model", layers, shape)
    config = validate_config(
        {
            "run_name": f"steady-{layers}",
            "train": dict(TRAIN),
            "model": {"path": str(model)},
            "cluster": {"nodes": 1, "gpus_per_node": world, "gpu_model": "cpu"},
            "pack": {"remainder": "drop"},
        }
    )
    lengths = np.random.default_rng(0).integers(50, 64, 3 * world * TRAIN["max_steps"])
    write_random_pretokenized(folder / "pretokenized", lengths, shape["vocab_size"], 0)
    build_plan(run_config(config), folder / "pretokenized", folder / "plan")
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return config, folder


def torchrun(args: list[str], log: Path, env: dict, world: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{' '.join(args[:3])} failed (status {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")


def rank_env(config: dict, launcher: bool) -> dict:
    """The ranks' environment: what `wattgate launch` sets (launch_env), or glibc defaults for the baseline."""
    from wattgate.config import run_config
    from wattgate.train.launch import launch_env, resolve_launch

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    for name in [k for k in env if k.startswith("MALLOC_")]:
        del env[name]
    if launcher:
        env = launch_env(resolve_launch(run_config(config)), env)
        env["OMP_NUM_THREADS"] = "1"  # 4 ranks on this 2-core machine: one thread each, as in the issue
    return env


def run_wattgate(folder: Path, config: dict, tag: str, world: int) -> dict:
    out = folder / f"train-{tag}"
    args = ["-m", "wattgate", "train", "--config", str(folder / "config.yaml")]
    args += ["--pretokenized", str(folder / "pretokenized"), "--plan", str(folder / "plan"), "--run-dir", str(out)]
    torchrun(args, folder / f"train-{tag}.log", rank_env(config, launcher=True), world)
    memory = json.loads((out / "TRAINED").read_text())["memory"]
    return {
        "load": max(r["phases"]["load"]["host_peak_gib"] for r in memory["per_rank"]),
        "steady": max(r["phases"]["steady"]["host_peak_gib"] for r in memory["per_rank"]),
    }


def run_plain(folder: Path, config: dict, launcher: bool, world: int) -> dict:
    tag = "plain-launch-env" if launcher else "plain-glibc-defaults"
    out = folder / tag
    out.mkdir()
    torchrun(
        [str(Path(__file__).resolve()), "--plain", str(folder), str(out)],
        out.with_suffix(".log"),
        rank_env(config, launcher),
        world,
    )
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    return {"load": max(r["load"] for r in ranks), "steady": max(r["steady"] for r in ranks)}


def plain_worker(folder: Path, out: Path) -> None:
    """One rank of the plain loop (run under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from wattgate.config import run_config
    from wattgate.train.data import IGNORE, DocStore, build_batch, read_rank_plan
    from wattgate.train.loop import group_steps
    from wattgate.train.metrics import peak_rss_bytes, reset_peak_rss
    from wattgate.train.model import load_sharded_model

    config = yaml.safe_load((folder / "config.yaml").read_text())
    train = run_config(config).train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = load_sharded_model(config["model"], train, init_device_mesh("cpu", (world,)), torch.device("cpu"))
    load_peak = peak_rss_bytes()
    reset_peak_rss()
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr)
    store = DocStore(folder / "pretokenized")
    for step_plan in group_steps(read_rank_plan(folder / "plan", rank))[: train.max_steps]:
        for i, m in enumerate(step_plan):
            b = build_batch(store, m.packs, train.seq_len)
            ids, labels = torch.from_numpy(b.input_ids), torch.from_numpy(b.labels)
            model.set_requires_gradient_sync(i == len(step_plan) - 1)
            logits = model(input_ids=ids, position_ids=torch.from_numpy(b.position_ids), use_cache=False).logits
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
            )
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(out / "ckpt"))
    (out / f"rank-{rank}.json").write_text(json.dumps({"load": load_peak / GIB, "steady": peak_rss_bytes() / GIB}))
    dist.barrier()
    dist.destroy_process_group()


def gate_steady_gib(config: dict) -> float:
    from wattgate.config import run_config
    from wattgate.gate.memory import estimate_memory
    from wattgate.model_spec import load_model_spec
    from wattgate.gate.run import fit_settings

    typed = run_config(config)
    return sum(estimate_memory(load_model_spec(typed), fit_settings(typed)).values()) / GIB


def fp32_model_gib(config: dict) -> float:
    from wattgate.config import run_config
    from wattgate.model_spec import load_model_spec

    return load_model_spec(run_config(config)).num_params * 4 / GIB


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0], smoke="hidden 128, 2 layers, 2 ranks")
    parser.add_argument("--layers", type=positive_int, nargs="+", default=None, help="decoder layers (default 12 24)")
    parser.add_argument("--ranks", type=positive_int, default=None, help=f"gloo ranks (default {WORLD})")
    parser.add_argument("--keep", type=Path, help="work folder to keep (default: a temporary one)")
    parser.add_argument("--plain", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.plain:
        return plain_worker(*a.plain)
    layer_counts = a.layers or ([2] if a.smoke else [12, 24])
    world = a.ranks or (2 if a.smoke else WORLD)
    shape = SMOKE_SHAPE if a.smoke else SHAPE
    work = a.keep or Path(tempfile.mkdtemp(prefix="wattgate-steady-"))
    rows = []
    for layers in layer_counts:
        config, folder = make_inputs(work, layers, world, shape)
        row = {
            "layers": layers,
            "fp32_gib": fp32_model_gib(config),
            "gate": gate_steady_gib(config),
            "wattgate": run_wattgate(folder, config, "launch-env", world),
            "plain": run_plain(folder, config, True, world),
            "plain_defaults": None if a.smoke else run_plain(folder, config, False, world),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nper-rank host peak, GiB (max over {world} ranks); gate = the gate's steady estimate")
    print(
        f"{'layers':>6} {'fp32 model':>10} {'load':>6} {'wattgate':>9} {'plain':>7} {'plain(glibc)':>13} "
        f"{'gate':>6} {'gate/wattgate':>13}"
    )
    for r in rows:
        glibc = "-" if r["plain_defaults"] is None else f"{r['plain_defaults']['steady']:.2f}"
        print(
            f"{r['layers']:>6} {r['fp32_gib']:>10.2f} {r['wattgate']['load']:>6.2f} {r['wattgate']['steady']:>9.2f} "
            f"{r['plain']['steady']:>7.2f} {glibc:>13} {r['gate']:>6.2f} "
            f"{r['gate'] / r['wattgate']['steady']:>13.2f}"
        )
        figure(
            "steady_memory",
            f"wattgate train, {r['layers']} layers on {world} CPU ranks, steady per-rank host peak",
            f"{r['wattgate']['steady']:.3f} GiB (the gate's estimate {r['gate']:.3f} GiB, "
            f"{r['gate'] / r['wattgate']['steady']:.2f}x)",
            f"a plain FSDP2 loop in the same environment {r['plain']['steady']:.3f} GiB",
        )
    ok = all(abs(r["gate"] / r["wattgate"]["steady"] - 1) <= TARGET_GATE for r in rows)
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        added = hi["fp32_gib"] - lo["fp32_gib"]
        for side in ("wattgate", "plain", "plain_defaults"):
            if hi[side] is None:
                continue
            growth = (hi[side]["steady"] - lo[side]["steady"]) / added
            print(f"growth {lo['layers']} -> {hi['layers']} layers, {side}: {growth:.2f}x the added fp32 model")
        ok &= (hi["wattgate"]["steady"] - lo["wattgate"]["steady"]) / added <= TARGET_GROWTH
    print(f"goal (growth <= {TARGET_GROWTH}x, gate within {TARGET_GATE:.0%}): {'met' if ok else 'NOT met'}")
    if a.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

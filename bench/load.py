"""Model load on CPU ranks: wattgate's sharded load vs the full-model path it replaced, in one run.

Both sides load the same Qwen3-shaped bf16 safetensors folder on `--ranks` gloo ranks under
torchrun and are measured the same way (wattgate.train.metrics.PhaseMemory: VmHWM reset at the
start of the load, the model's code imported before it):

- full (baseline, wattgate before issue 9): every rank calls from_pretrained(dtype=float32),
  moves the whole model to the device, then fully_shard's it;
- sharded (wattgate train / load-check): meta build, fully_shard, to_empty, each rank reads only
  the rows of its shards.

Then the model grows by `--add-layers` decoder layers (twice) and the per-rank peak RSS growth
of each path is fit against the added fp32 bytes: sharded should grow by about 1/ranks of it,
full by all of it.

Figures: each size's per-rank peak RSS growth during the load, sharded against full, and (two sizes or
more) the growth per added fp32 byte of each path. `--smoke`: one tiny model (hidden 128, vocab 2048,
2 layers) on 2 ranks, so no growth fit.

    python bench/load.py [--ranks 4] [--layers 10] [--add-layers 10] [--sizes 3] [--vocab 151936] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchlib import Parser, figure, positive_int

MIB = 1 << 20
GIB = 1 << 30


def qwen3_config(layers: int, vocab: int, size: str) -> dict:
    """A Qwen3-0.6B-like shape (hidden 1024, 16 heads, 8 KV heads) with `layers` decoder layers; `size` quick
    halves the width, smoke is a tiny model (hidden 128, 4 heads)."""
    hidden, inter, heads, kv, head_dim = {
        "full": (1024, 3072, 16, 8, 128),
        "quick": (512, 1536, 16, 8, 128),
        "smoke": (128, 384, 4, 2, 32),
    }[size]
    return {
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    }


def write_bf16_folder(path: Path, cfg: dict) -> int:
    """A bf16 Hugging Face folder with random weights; returns the parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    args = dict(cfg)
    config = AutoConfig.for_model(args.pop("model_type"), **args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty unties them
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def full_worker(model_dir: Path, out: Path) -> None:
    """One rank of the baseline: the whole fp32 model per rank, moved, then sharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from wattgate.train.distributed import setup_rank
    from wattgate.train.metrics import PhaseMemory
    from wattgate.train.model import build_meta_model, parallelize

    rank, world, device = setup_rank(600, out)
    build_meta_model({"path": str(model_dir)}, "sdpa")  # import the model's code outside the measurement
    memory = PhaseMemory(device)
    memory.start()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.to(device)
    parallelize(model, init_device_mesh(device.type, (world,)), False, False, False)
    dist.barrier()
    memory.end("load")
    every = memory.gather()
    if rank == 0:
        (out / "full.json").write_text(json.dumps(every))
    dist.destroy_process_group()


def torchrun(ranks: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        sys.exit(f"bench/load.py: {' '.join(args[:3])} failed:\n{proc.stderr[-3000:]}")


def measure(path: str, ranks: int, model_dir: Path, work: Path) -> dict:
    """Max over ranks of load seconds and of peak RSS growth during the load, for one path."""
    out = work / f"{path}-{model_dir.name}"
    out.mkdir()
    if path == "full":
        torchrun(ranks, [__file__, "--worker", str(model_dir), "--out", str(out)])
        per_rank = json.loads((out / "full.json").read_text())
    else:
        cfg = work / f"config-{model_dir.name}.yaml"  # beside --out: load-check writes only into its own folder
        cfg.write_text(
            json.dumps(
                {
                    "run_name": "bench",
                    "model": {"path": str(model_dir)},
                    "cluster": {"nodes": 1, "gpus_per_node": ranks},
                }
            )
        )
        torchrun(ranks, ["-m", "wattgate", "load-check", "--config", str(cfg), "--out", str(out)])
        per_rank = json.loads((out / "load-check.json").read_text())["memory"]["per_rank"]
    loads = [r["phases"]["load"] for r in per_rank]
    return {
        "seconds": max(p["seconds"] for p in loads),
        "grown": max((p["host_peak_gib"] - p["host_at_start_gib"]) * GIB for p in loads),
    }


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = Parser(description=__doc__.split("\n\n")[0], smoke="one tiny model on 2 ranks")
    ap.add_argument("--ranks", type=positive_int, default=None, help="gloo ranks (default 4)")
    ap.add_argument("--layers", type=positive_int, default=None, help="decoder layers of the first size (10)")
    ap.add_argument("--add-layers", type=positive_int, default=10)
    ap.add_argument("--sizes", type=positive_int, default=None, help="model sizes (default 3)")
    ap.add_argument("--vocab", type=positive_int, default=151936)
    ap.add_argument("--quick", action="store_true", help="a small shape (seconds)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return full_worker(args.worker, args.out)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    vocab = 2048 if args.smoke else 8192 if args.quick else args.vocab
    ranks = args.ranks or (2 if args.smoke else 4)
    first = args.layers or (2 if args.smoke else 10)
    sizes = args.sizes or (1 if args.smoke else 3)
    rows = []
    with tempfile.TemporaryDirectory(prefix="wattgate-bench-load-") as tmp:
        work = Path(tmp)
        for k in range(sizes):
            layers = first + k * args.add_layers
            model_dir = work / f"qwen3-{layers}l"
            t0 = time.perf_counter()
            params = write_bf16_folder(model_dir, qwen3_config(layers, vocab, size))
            print(
                f"model: {layers} layers, {params / 1e9:.3f}B params, bf16 folder written in "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            row = {"layers": layers, "params": params, "fp32_bytes": params * 4}
            for path in ("full", "sharded"):
                row[path] = measure(path, ranks, model_dir, work)
            rows.append(row)
            for f in model_dir.iterdir():  # free the disk (and page cache) before the next size
                f.unlink()

    print(f"\nload on {ranks} CPU ranks (gloo), bf16 safetensors -> fp32 FSDP2 shards; max over ranks")
    print(
        "| layers | params | fp32 model | full: load s | full: RSS growth/rank | sharded: load s "
        "| sharded: RSS growth/rank | RSS ratio full/sharded | load-time ratio full/sharded |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        f, s = r["full"], r["sharded"]
        print(
            f"| {r['layers']} | {r['params'] / 1e9:.3f}B | {r['fp32_bytes'] / MIB:.0f} MiB | {f['seconds']:.2f} "
            f"| {f['grown'] / MIB:.0f} MiB | {s['seconds']:.2f} | {s['grown'] / MIB:.0f} MiB "
            f"| {f['grown'] / s['grown']:.2f}x | {f['seconds'] / s['seconds']:.2f}x |"
        )
    for r in rows:
        figure(
            "load",
            f"sharded load of {r['layers']} layers ({r['fp32_bytes'] / MIB:.0f} MiB fp32) on {ranks} CPU ranks, "
            "per-rank peak RSS growth",
            f"{r['sharded']['grown'] / MIB:.0f} MiB in {r['sharded']['seconds']:.2f} s",
            f"the full-model path {r['full']['grown'] / MIB:.0f} MiB in {r['full']['seconds']:.2f} s",
        )
    if len(rows) < 2:
        print("growth per added layer: needs two sizes or more (--sizes)")
        return
    added = [r["fp32_bytes"] for r in rows]
    growth = {path: slope(added, [r[path]["grown"] for r in rows]) for path in ("full", "sharded")}
    for path, k in growth.items():
        print(f"{path}: per-rank peak RSS grows by {k:.3f} x the added fp32 bytes (1/ranks = {1 / ranks:.3f})")
    figure(
        "load",
        f"sharded load, per-rank peak RSS growth per added fp32 byte over {len(rows)} sizes",
        f"{growth['sharded']:.3f} (1/ranks = {1 / ranks:.3f})",
        f"the full-model path {growth['full']:.3f}",
    )


if __name__ == "__main__":
    main()

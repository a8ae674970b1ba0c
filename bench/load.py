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

    python bench/load.py [--ranks 4] [--layers 10] [--add-layers 10] [--vocab 151936] [--quick]
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

MIB = 1 << 20
GIB = 1 << 30


def qwen3_config(layers: int, vocab: int, quick: bool) -> dict:
    """A Qwen3-0.6B-like shape (hidden 1024, 16 heads, 8 KV heads) with `layers` decoder layers."""
    hidden, inter = (512, 1536) if quick else (1024, 3072)
    return {
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
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
        cfg = out / "config.yaml"
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--add-layers", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--quick", action="store_true", help="a small shape (seconds), for a smoke run")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return full_worker(args.worker, args.out)
    vocab = 8192 if args.quick else args.vocab
    rows = []
    with tempfile.TemporaryDirectory(prefix="wattgate-bench-load-") as tmp:
        work = Path(tmp)
        for k in range(3):
            layers = args.layers + k * args.add_layers
            model_dir = work / f"qwen3-{layers}l"
            t0 = time.perf_counter()
            params = write_bf16_folder(model_dir, qwen3_config(layers, vocab, args.quick))
            print(
                f"model: {layers} layers, {params / 1e9:.3f}B params, bf16 folder written in "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            row = {"layers": layers, "params": params, "fp32_bytes": params * 4}
            for path in ("full", "sharded"):
                row[path] = measure(path, args.ranks, model_dir, work)
            rows.append(row)
            for f in model_dir.iterdir():  # free the disk (and page cache) before the next size
                f.unlink()

    print(f"\nload on {args.ranks} CPU ranks (gloo), bf16 safetensors -> fp32 FSDP2 shards; max over ranks")
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
    added = [r["fp32_bytes"] for r in rows]
    for path in ("full", "sharded"):
        k = slope(added, [r[path]["grown"] for r in rows])
        print(f"{path}: per-rank peak RSS grows by {k:.3f} x the added fp32 bytes (1/ranks = {1 / args.ranks:.3f})")


if __name__ == "__main__":
    main()

"""Chunked against full-logits loss on CPU ranks: per-rank steady peak RSS and step time, with the gate's figures.

Shape (issue 23, item 4): Qwen3 with vocab 151,936, hidden 1024, 2 layers (tied embeddings, as in
Qwen3-0.6B), seq_len 4096, micro_batch_size 1 and 2, 2 gloo ranks (one thread each), AdamW, random
init by wattgate's sharded loader. Each (loss kind, micro_batch_size) runs in its own torchrun, all
in this one invocation: VmHWM is per process, reset after loading, so each peak is that loss's
steady state (3 optimizer steps of one packed micro-batch; the first is warm-up for the time).

Printed per variant: measured peak (max over ranks), the gate's steady estimate (gate/memory.py,
the same config) and their ratio; per micro_batch_size the measured drop full -> chunked against the
gate's (its `logits` terms' difference), and step time chunked / full (median of steps 2-3). A
variant whose predicted peak over both ranks exceeds this machine's available memory is not run
(the line says so).

Figures, per micro_batch_size: the chunked loss's measured peak and step time against the full-logits loss's
(the baseline), with the gate's predicted drop. `--smoke`: a tiny shape (vocab 8192, hidden 128), seq_len 1024,
micro_batch_size 1, 2 steps.

    python bench/loss.py [--micro-batch-sizes 1 2] [--steps 3] [--seq-len 4096] [--run-all] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchlib import Parser, figure, positive_int

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
SHAPE = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
SMOKE_SHAPE = dict(SHAPE, vocab_size=8192, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32)  # fmt: skip
SEQ_LEN, MIN_SEQ_LEN = 4096, 1024  # documents of 1024 tokens, the first 256 without loss
GIB = 1 << 30
TARGET_MATCH = 0.15  # |measured drop / predicted drop - 1|
TARGET_TIME = 1.05  # chunked step time / full


def config_for(kind: str, micro_batch_size: int, seq_len: int = SEQ_LEN, shape: dict = SHAPE) -> dict:
    from wattgate.config import validate_config

    return validate_config(
        {
            "run_name": "bench-loss",
            "model": {"config": dict(shape)},
            "cluster": {"nodes": 1, "gpus_per_node": WORLD, "gpu_model": "cpu"},
            "train": {
                "seq_len": seq_len,
                "micro_batch_size": micro_batch_size,
                "grad_accum": 1,
                "loss": kind,
                "attn_implementation": "sdpa",
            },
        }
    )


def predicted(config: dict) -> dict[str, int]:
    from wattgate.config import run_config
    from wattgate.gate.memory import estimate_memory
    from wattgate.model_spec import load_model_spec
    from wattgate.gate.run import fit_settings

    typed = run_config(config)
    return estimate_memory(load_model_spec(typed), fit_settings(typed))


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_variant(
    work: Path, kind: str, micro_batch_size: int, steps: int, seq_len: int, run_all: bool, shape: dict
) -> dict:
    from wattgate.train.launch import CPU_ALLOCATOR_ENV

    config = config_for(kind, micro_batch_size, seq_len, shape)
    terms = predicted(config)
    result = {"kind": kind, "mbs": micro_batch_size, "predicted": sum(terms.values()) / GIB}
    result["predicted_logits"] = terms["logits"] / GIB
    if not run_all and WORLD * sum(terms.values()) > 0.9 * available_bytes():
        result["skipped"] = (
            f"{WORLD} x {result['predicted']:.1f} GiB predicted > 90% of the "
            f"{available_bytes() / GIB:.1f} GiB available here"
        )
        return result
    out = work / f"{kind}-{micro_batch_size}"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += [str(Path(__file__).resolve()), "--worker", str(out), str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), **CPU_ALLOCATOR_ENV)
    with (out / "log.txt").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{kind} mbs {micro_batch_size} failed ({proc.returncode}):\n{(out / 'log.txt').read_text()[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    result["peak"] = max(r["peak"] for r in ranks)
    result["step_s"] = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(1, steps))
    result["loss"] = ranks[0]["loss"]
    return result


def worker(out: Path, steps: int) -> None:
    """One rank: sharded load, then `steps` AdamW steps on one packed micro-batch each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from wattgate.config import run_config
    from wattgate.train.data import IGNORE
    from wattgate.train.loss import summed_token_loss
    from wattgate.train.metrics import peak_rss_bytes, reset_peak_rss
    from wattgate.train.model import load_sharded_model
    from wattgate.train.optimizer import build_optimizer

    config = yaml.safe_load((out / "config.yaml").read_text())
    train = run_config(config).train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = load_sharded_model(config["model"], train, init_device_mesh("cpu", (world,)), torch.device("cpu"))
    optimizer = build_optimizer(model, train)
    g = torch.Generator().manual_seed(rank)
    shape = (train.micro_batch_size, train.seq_len)
    ids = torch.randint(0, config["model"]["config"]["vocab_size"], shape, generator=g)
    # documents of 1024 tokens; the first 256 of each (a prompt) carry no loss
    position_ids = (torch.arange(train.seq_len) % 1024).repeat(train.micro_batch_size, 1)
    labels = torch.where(position_ids >= 256, ids, IGNORE)
    tensors = {"input_ids": ids, "labels": labels, "position_ids": position_ids}
    reset_peak_rss()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        summed = summed_token_loss(model, tensors, train.loss, train.loss_chunk_tokens)
        (summed * world / int((labels != IGNORE).sum())).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(summed.detach()))
    record = {"peak": peak_rss_bytes() / GIB, "step_s": times, "loss": losses}
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0], smoke="a tiny shape, seq_len 1024, mbs 1, 2 steps")
    parser.add_argument("--micro-batch-sizes", type=positive_int, nargs="+", default=None, help="default 1 2")
    parser.add_argument("--steps", type=positive_int, default=None, help="steps per variant (default 3, at least 2)")
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help=f"default {SEQ_LEN}; a smaller one for a quick try (min {MIN_SEQ_LEN})",
    )
    parser.add_argument(
        "--run-all", action="store_true", help="run a variant even when the gate's (upper-bound) peak exceeds memory"
    )
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        return worker(Path(a.worker[0]), int(a.worker[1]))
    shape = SMOKE_SHAPE if a.smoke else SHAPE
    mbs_list = a.micro_batch_sizes or ([1] if a.smoke else [1, 2])
    steps = a.steps or (2 if a.smoke else 3)
    seq_len = a.seq_len or (MIN_SEQ_LEN if a.smoke else SEQ_LEN)
    if steps < 2 or seq_len < MIN_SEQ_LEN:
        parser.error(f"--steps must be at least 2 (the first is warm-up) and --seq-len at least {MIN_SEQ_LEN}")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="wattgate-loss-") as tmp:  # a failed variant prints its log's tail
        for mbs in mbs_list:
            for kind in ("chunked", "full"):
                rows[kind, mbs] = r = run_variant(Path(tmp), kind, mbs, steps, seq_len, a.run_all, shape)
                print(json.dumps(r), flush=True)
    print(f"\nper-rank steady peak RSS, GiB (max over {WORLD} ranks), vocab {shape['vocab_size']:,}, seq_len {seq_len}")
    print(f"{'loss':>8} {'mbs':>3} {'measured':>9} {'gate':>6} {'gate/measured':>13} {'step s':>7}")
    for (kind, mbs), r in rows.items():
        if "skipped" in r:
            print(f"{kind:>8} {mbs:>3}  not run: {r['skipped']}; gate {r['predicted']:.2f}")
            continue
        ratio = r["predicted"] / r["peak"]
        print(f"{kind:>8} {mbs:>3} {r['peak']:>9.2f} {r['predicted']:>6.2f} {ratio:>13.2f} {r['step_s']:>7.2f}")
    ok, checked = True, 0
    for mbs in mbs_list:
        c, f = rows["chunked", mbs], rows["full", mbs]
        what = f"chunked loss, vocab {shape['vocab_size']:,}, seq_len {seq_len}, micro_batch_size {mbs}, per-rank peak"
        if "peak" in c and "peak" not in f:  # the baseline does not fit this host: say so, with the gate's figure
            skipped = f.get("skipped", "failed")
            figure(
                "loss",
                what,
                f"{c['peak']:.3f} GiB (the gate predicted {c['predicted']:.3f} GiB); step {c['step_s']:.3f} s",
                f"the full-logits loss not run ({skipped}); the gate predicts it {f['predicted']:.3f} GiB",
            )
            continue
        if "peak" not in c or "peak" not in f:
            continue
        checked += 1
        drop, want = f["peak"] - c["peak"], f["predicted_logits"] - c["predicted_logits"]
        time_ratio = c["step_s"] / f["step_s"]
        print(
            f"mbs {mbs}: peak drop full -> chunked {drop:.2f} GiB, gate's logits terms {want:.2f} GiB "
            f"(measured / predicted {drop / want:.2f}); step time chunked / full {time_ratio:.2f}; "
            f"first-step loss chunked {c['loss'][0]:.2f}, full {f['loss'][0]:.2f}"
        )
        figure(
            "loss",
            what,
            f"{c['peak']:.3f} GiB, {drop:.3f} GiB below the baseline (the gate's logits terms: {want:.3f} GiB); "
            f"step {c['step_s']:.3f} s, {time_ratio:.2f}x the baseline's",
            f"the full-logits loss {f['peak']:.3f} GiB, step {f['step_s']:.3f} s",
        )
        ok &= drop >= (1 - TARGET_MATCH) * want and abs(drop / want - 1) <= TARGET_MATCH and time_ratio <= TARGET_TIME
    verdict = "not checked: no baseline ran" if not checked else "met" if ok else "NOT met"
    print(f"goal (drop >= the gate's within {TARGET_MATCH:.0%}, time <= {TARGET_TIME}x): {verdict}")


if __name__ == "__main__":
    main()

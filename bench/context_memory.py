"""Per-rank host peak of a forward + backward at seq_len 16k under context parallelism C = 1, 2 and 4, against C = 1.

Shapes: a random-init dense Qwen3 (hidden 256, intermediate 768, 2 layers, 4 query heads, 2 key/value heads,
head_dim 16, vocab 2048, float32, seed 0 on every rank: ~2M parameters, small beside the activations); 2 layers of
head_dim 16, not 4 of 64, because attention over a 16k row costs S^2 and 4 x 64 would take some 20 minutes on this
2-core machine. One packed micro-batch row (B = 1) of 16384 tokens: random-length documents (fixed seed) and one of
3/8 of the row that crosses chunk boundaries at every C. 4 gloo ranks, OMP_NUM_THREADS=1, no activation
checkpointing. Each C is its own torchrun, one after another (VmHWM cannot go down, so a process per C keeps each
C's peak its own). At C the ranks form 4/C context groups of C ranks (new_subgroups(C)); each group splits the same
row (shard_rows: context_layout.py's split) and runs `context_loss_sum` + backward, STEPS times.

Baseline, C = 1: every rank runs the whole row through the same context-parallel attention with a group of one (no
collective). It is the same code as C > 1 (mask construction, masked SDPA kernel, logits and loss), so the ratio
measures only what splitting the row saves; plain transformers sdpa would also change the mask path and the kernel.

Measured per rank: VmHWM reset after building the model and the shard (train/metrics.py reset_peak_rss), read after
the steps (the step peak), and the RSS before the steps, so the growth above it (what the steps hold) is printed
too. Rank 0 gathers them and prints per C the max and mean step peak over ranks and the max's ratio to C = 1's. The
summed shard losses of a group are printed per token as a check that every C ran the same row.

Expected trend: per-token tensors (hidden states, MLP activations, logits [S/C, vocab] and their gradients) fall by
~C. The all-gathered keys/values stay [S] at any C (small here: 2 heads x 32 floats a token). The attention mask is
bool [B, 1, S/C, S], built from two comparisons of index vectors (document_causal_mask: 2 bytes per (query, key)
pair at its peak), so it falls by C too. So the growth falls by about C; the peak by less, since the process's own
resident bytes (torch, transformers, the model: ~0.41 GiB) do not fall.

Figures, per C > 1: the max per-rank step peak at C against C = 1's in the same run. `--smoke`: seq_len 1024, hidden
64, 2 layers, 2 ranks, C = 1 and 2.

    python bench/context_memory.py [--seq-len 16384] [--contexts 1 2 4] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchlib import Parser, fail, figure, positive_int
from steady_memory import torchrun

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
STEPS = 2
SHAPE = {
    "model_type": "qwen3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,  # not 4 (nor head_dim 64): attention over 16k tokens is S^2, minutes on 2 cores
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
SMOKE_SHAPE = dict(SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
GIB = 1 << 30


def packed_row(seq_len: int, vocab: int):
    """One full row as build_batch lays it out ({input_ids, labels, position_ids} [1, seq_len], every token with a
    label): documents of random lengths up to seq_len/16, and one of 3/8 of the row starting at 1/16 of it, so it
    crosses a chunk boundary at every C up to 4 (chunks of seq_len/(2C))."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = [seq_len // 16, 3 * seq_len // 8]
    while sum(lengths) < seq_len:
        lengths.append(int(torch.randint(1, max(2, seq_len // 16), (1,), generator=g)))
    lengths[-1] -= sum(lengths) - seq_len
    ids = torch.randint(0, vocab, (seq_len,), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths if n > 0])
    return {"input_ids": ids[None], "labels": ids[None].clone(), "position_ids": positions[None]}


def build_model(shape: dict, seq_len: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(shape, max_position_embeddings=seq_len)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)  # the same weights on every rank, as FSDP's broadcast would leave them
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def context_group(context: int):
    """This rank's context group of `context` ranks (None: a group of one, no collective); every rank must call it,
    since new_subgroups is collective."""
    import torch.distributed as dist

    if context == 1:
        return None
    group, _ = dist.new_subgroups(context)
    return group


def worker(context: int, seq_len: int, smoke: bool, out: Path) -> None:
    """One rank (run under torchrun): STEPS forward + backward of its shard; rank 0 writes every rank's peaks."""
    import gc

    import torch
    import torch.distributed as dist

    from wattgate.train.context_parallel import context_loss_sum, shard_rows, use_context_attention
    from wattgate.train.metrics import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    dist.init_process_group("gloo")
    group = context_group(context)
    model = build_model(SMOKE_SHAPE if smoke else SHAPE, seq_len)
    use_context_attention(model)
    rank_in_group = 0 if group is None else dist.get_rank(group)
    shard = shard_rows(packed_row(seq_len, model.config.vocab_size), context, rank_in_group)
    gc.collect()
    before = current_rss_bytes()
    reset_peak_rss()  # the steps' peak, not the imports' or the model build's
    losses = []
    for _ in range(STEPS):
        loss = context_loss_sum(model, shard, group)
        loss.backward()
        losses.append(float(loss))
        del loss
        model.zero_grad(set_to_none=True)
    mine = torch.tensor([peak_rss_bytes() / GIB, before / GIB, losses[-1]], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        rows = [t.tolist() for t in every]
        out.write_text(json.dumps([{"peak": p, "before": b, "loss": x} for p, b, x in rows]))
    dist.destroy_process_group()


def run_context(work: Path, context: int, seq_len: int, smoke: bool, world: int) -> list[dict]:
    """One torchrun at `context`: per-rank {peak, before, loss}."""
    out = work / f"context-{context}.json"
    args = [str(Path(__file__).resolve()), "--worker", str(context), str(out)]
    args += ["--seq-len", str(seq_len)] + (["--smoke"] if smoke else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    torchrun(args, work / f"context-{context}.log", env, world)
    return json.loads(out.read_text())


def check_contexts(contexts: list[int], seq_len: int, world: int) -> None:
    if contexts[0] != 1 or any(world % c for c in contexts):
        fail("context_memory", f"--contexts: give 1 first (the baseline), then divisors of the {world} ranks")
    bad = [c for c in contexts if seq_len % (2 * c)]
    if bad:
        fail("context_memory", f"--seq-len {seq_len} does not split into 2C head-tail chunks at C = {bad[0]}")


def report(rows: dict[int, list[dict]], seq_len: int, world: int) -> None:
    base = max(r["peak"] for r in rows[1])
    base_growth = max(r["peak"] - r["before"] for r in rows[1])
    print(f"\nper-rank host peak of {STEPS} forward + backward steps, GiB; seq_len {seq_len}, {world} CPU ranks")
    print(f"{'C':>2} {'max':>7} {'mean':>7} {'vs C=1':>7} {'growth':>7} {'vs C=1':>7} {'before':>7} {'loss/tok':>9}")
    for c, ranks in rows.items():
        peak = max(r["peak"] for r in ranks)
        mean = sum(r["peak"] for r in ranks) / len(ranks)
        growth = max(r["peak"] - r["before"] for r in ranks)
        before = max(r["before"] for r in ranks)
        # the group's shard losses add up to the row's: a sanity check that C split the same row
        loss = sum(r["loss"] for r in ranks) / (world // c) / (seq_len - 1)
        print(
            f"{c:>2} {peak:>7.3f} {mean:>7.3f} {peak / base:>7.3f} {growth:>7.3f} {growth / base_growth:>7.3f} "
            f"{before:>7.3f} {loss:>9.4f}"
        )
    for c, ranks in rows.items():
        if c == 1:
            continue
        peak = max(r["peak"] for r in ranks)
        growth = max(r["peak"] - r["before"] for r in ranks)
        figure(
            "context_memory",
            f"parallel.context {c}, seq_len {seq_len} on {world} CPU ranks, per-rank host peak of forward + backward",
            f"{peak:.3f} GiB, {peak / base:.3f}x C = 1 (above the model: {growth:.3f} GiB, "
            f"{growth / base_growth:.3f}x)",
            f"C = 1 (the whole row per rank) in the same run {base:.3f} GiB (above the model {base_growth:.3f} GiB)",
        )


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0], smoke="seq_len 1024, hidden 64, 2 layers, 2 ranks, C 1 2")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="tokens per row (default 16384)")
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=None, help="C values (default 1 2 4)")
    parser.add_argument("--keep", type=Path, help="work folder to keep (default: a temporary one)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = parser.parse_args()
    seq_len = a.seq_len or (1024 if a.smoke else 16384)
    if a.worker:
        return worker(int(a.worker[0]), seq_len, a.smoke, Path(a.worker[1]))
    world = 2 if a.smoke else WORLD
    contexts = a.contexts or ([1, 2] if a.smoke else [1, 2, 4])
    check_contexts(contexts, seq_len, world)
    work = a.keep or Path(tempfile.mkdtemp(prefix="wattgate-context-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = {}
    for c in contexts:
        rows[c] = run_context(work, c, seq_len, a.smoke, world)
        print(json.dumps({"context": c, "ranks": rows[c]}), flush=True)
    report(rows, seq_len, world)
    if a.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

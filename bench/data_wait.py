"""How long a step waits for its data: batches built before each step (the loop before the prefetch thread)
against train/data.py's StepPrefetcher (the next step built while this one computes), same process.

A corpus of long documents (1-4k tokens) in shards laid out as pretokenize lays them (row groups of many
documents), packs drawn across the corpus as the planner deals them, so a micro-batch decodes the row groups
its documents live in (the document store keeps one: a rank reading a large corpus rarely hits its cache); a
small Qwen3 on CPU, forward + backward + AdamW per step as the trainer does it (summed_token_loss, grad_accum
micro-batches). data-wait share = time blocked on batches / step time.

`--smoke`: seq_len 1024 (documents of 256-1024 tokens), 3 steps, hidden 64, one layer, 200 documents a shard.

    python bench/data_wait.py [--steps 10] [--hidden 128] [--layers 2] [--seq-len 4096] [--smoke]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from benchlib import Parser, figure, positive_int
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.train.data import DocStore, StepPrefetcher, build_batch, host_tensors
from wattgate.train.loss import summed_token_loss

SEQ_LEN, GRAD_ACCUM, VOCAB, SHARD_DOCS = 4096, 2, 2048, 2000
FULL = {"seq_len": SEQ_LEN, "steps": 10, "hidden": 128, "layers": 2, "shard_docs": SHARD_DOCS}
SMOKE = {"seq_len": 1024, "steps": 3, "hidden": 64, "layers": 1, "shard_docs": 200}


def model_of(hidden: int, layers: int, seq_len: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=seq_len,
        use_cache=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def step_packs(n_docs: int, steps: int, seq_len: int):
    """Document lengths (a quarter of seq_len to seq_len), and per step, per micro-batch, one pack of documents
    drawn across the corpus."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(seq_len // 4, seq_len, n_docs)
    order, packs, used, pack = rng.permutation(n_docs), [], 0, []
    for doc in order.tolist():
        if used + lengths[doc] > seq_len:
            packs.append(np.array(pack))
            pack, used = [], 0
        pack.append(doc)
        used += lengths[doc]
    return lengths, [[[packs[s * GRAD_ACCUM + m]] for m in range(GRAD_ACCUM)] for s in range(steps)]


def run(model, optimizer, store, steps, prefetch: bool, seq_len: int) -> list[tuple[float, float]]:
    """(data wait, step time) per step after the first."""

    def build(g):
        return [(b, host_tensors(b, False)) for b in (build_batch(store, m, seq_len) for m in steps[g])]

    fetch = StepPrefetcher(build, len(steps)) if prefetch else None
    out = []
    try:
        for g in range(len(steps)):
            t0 = time.perf_counter()
            batches = fetch.get(g) if fetch else build(g)
            wait = time.perf_counter() - t0
            for _, tensors in batches:
                (summed_token_loss(model, tensors, "chunked", 1024) / 1e4).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if g:
                out.append((wait, time.perf_counter() - t0))
    finally:
        if fetch:
            fetch.close()
    return out


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0], smoke="seq_len 1024, 3 steps, hidden 64, one layer")
    parser.add_argument("--steps", type=positive_int, default=None, help="steps (default 10)")
    parser.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default 128)")
    parser.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default 2)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help=f"default {SEQ_LEN}")
    args = parser.parse_args()
    size = SMOKE if args.smoke else FULL
    seq_len, n_steps = args.seq_len or size["seq_len"], args.steps or size["steps"]
    hidden, layers, shard_docs = args.hidden or size["hidden"], args.layers or size["layers"], size["shard_docs"]
    if n_steps < 2:
        parser.error("argument --steps: at least 2 (the first step is not timed)")
    if hidden % 4 or seq_len < 8:
        parser.error("--hidden must be a multiple of 4 (4 heads) and --seq-len at least 8")
    torch.set_num_threads(1)  # one core computes, as a CPU rank does; the other is free for the builder
    with tempfile.TemporaryDirectory(prefix="wattgate-bench-data-wait-") as tmp:
        lengths, steps = step_packs(4 * shard_docs, n_steps, seq_len)
        pretok = write_random_pretokenized(Path(tmp) / "p", lengths, VOCAB, shard_docs=shard_docs)
        model = model_of(hidden, layers, seq_len)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        results = {}
        for prefetch in (False, True, False):  # baseline, prefetch, baseline again (the machine drifts)
            store = DocStore(pretok, cache_row_groups=1)  # a cold store each time: every batch decodes its groups
            rows = run(model, optimizer, store, steps, prefetch, seq_len)
            results.setdefault(prefetch, []).append(
                (statistics.median(w for w, _ in rows), statistics.median(t for _, t in rows))
            )
        tokens = sum(int(lengths[d].sum()) for s in steps for m in s for p in m for d in p) / len(steps)
        print(f"== {len(steps)} steps x {GRAD_ACCUM} micro-batches, ~{tokens:,.0f} tokens per step, seq_len {seq_len}")
        for prefetch, label in ((False, "baseline: built before each step"), (True, "StepPrefetcher")):
            wait, step = min(results[prefetch], key=lambda r: r[0])
            print(f"  {label:34s} data wait {wait * 1e3:7.1f} ms of a {step * 1e3:7.1f} ms step ({wait / step:6.2%})")
        before = min(w / t for w, t in results[False])
        after = min(w / t for w, t in results[True])
        print(f"  data-wait share: {before:.2%} -> {after:.2%} ({before / max(after, 1e-9):.0f}x less)")
        figure(
            "data_wait",
            f"data-wait share of a step with the StepPrefetcher, seq_len {seq_len}",
            f"{after:.2%}",
            f"batches built before each step {before:.2%}",
        )


if __name__ == "__main__":
    main()

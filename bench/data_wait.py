"""How long a step waits for its data: batches built before each step (the loop before the prefetch thread)
against train/data.py's StepPrefetcher (the next step built while this one computes), same process.

A corpus of long documents (1-4k tokens) in shards laid out as pretokenize lays them (row groups of many
documents), packs drawn across the corpus as the planner deals them, so a micro-batch decodes the row groups
its documents live in (the document store keeps one: a rank reading a large corpus rarely hits its cache); a
small Qwen3 on CPU, forward + backward + AdamW per step as the trainer does it (summed_token_loss, grad_accum
micro-batches). data-wait share = time blocked on batches / step time.

    python bench/data_wait.py [--steps 10] [--hidden 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from wattgate.data.synthetic import write_random_pretokenized
from wattgate.train.data import DocStore, StepPrefetcher, build_batch, host_tensors
from wattgate.train.loss import LossSettings, summed_token_loss

SEQ_LEN, GRAD_ACCUM, VOCAB, SHARD_DOCS = 4096, 2, 2048, 2000


def model_of(hidden: int, layers: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=SEQ_LEN,
        use_cache=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def step_packs(n_docs: int, steps: int):
    """Document lengths, and per step, per micro-batch, one pack of documents drawn across the corpus."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1000, 4000, n_docs)
    order, packs, used, pack = rng.permutation(n_docs), [], 0, []
    for doc in order.tolist():
        if used + lengths[doc] > SEQ_LEN:
            packs.append(np.array(pack))
            pack, used = [], 0
        pack.append(doc)
        used += lengths[doc]
    return lengths, [[[packs[s * GRAD_ACCUM + m]] for m in range(GRAD_ACCUM)] for s in range(steps)]


def run(model, optimizer, store, steps, prefetch: bool) -> list[tuple[float, float]]:
    """(data wait, step time) per step after the first."""
    loss = LossSettings("chunked", 1024)

    def build(g):
        return [(b, host_tensors(b, False)) for b in (build_batch(store, m, SEQ_LEN) for m in steps[g])]

    fetch = StepPrefetcher(build, len(steps)) if prefetch else None
    out = []
    try:
        for g in range(len(steps)):
            t0 = time.perf_counter()
            batches = fetch.get(g) if fetch else build(g)
            wait = time.perf_counter() - t0
            for _, tensors in batches:
                (summed_token_loss(model, tensors, loss) / 1e4).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if g:
                out.append((wait, time.perf_counter() - t0))
    finally:
        if fetch:
            fetch.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core computes, as a CPU rank does; the other is free for the builder
    with tempfile.TemporaryDirectory(prefix="wattgate-bench-data-wait-") as tmp:
        lengths, steps = step_packs(4 * SHARD_DOCS, args.steps)
        pretok = write_random_pretokenized(Path(tmp) / "p", lengths, VOCAB, shard_docs=SHARD_DOCS)
        model = model_of(args.hidden, args.layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        results = {}
        for prefetch in (False, True, False):  # baseline, prefetch, baseline again (the machine drifts)
            store = DocStore(pretok, cache_row_groups=1)  # a cold store each time: every batch decodes its groups
            rows = run(model, optimizer, store, steps, prefetch)
            results.setdefault(prefetch, []).append(
                (statistics.median(w for w, _ in rows), statistics.median(t for _, t in rows))
            )
        tokens = sum(int(lengths[d].sum()) for s in steps for m in s for p in m for d in p) / len(steps)
        print(f"== {len(steps)} steps x {GRAD_ACCUM} micro-batches, ~{tokens:,.0f} tokens per step, seq_len {SEQ_LEN}")
        for prefetch, label in ((False, "baseline: built before each step"), (True, "StepPrefetcher")):
            wait, step = min(results[prefetch], key=lambda r: r[0])
            print(f"  {label:34s} data wait {wait * 1e3:7.1f} ms of a {step * 1e3:7.1f} ms step ({wait / step:6.2%})")
        before = min(w / t for w, t in results[False])
        after = min(w / t for w, t in results[True])
        print(f"  data-wait share: {before:.2%} -> {after:.2%} ({before / max(after, 1e-9):.0f}x less)")


if __name__ == "__main__":
    main()

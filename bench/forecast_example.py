"""The gate's forecast and failure cost for an example config, on a corpus of a stated size.

The examples (config/examples/*.yaml) point at data and weights that live on a
cluster. This script stands in for them: document lengths drawn from a
log-normal (seeded; --docs and --mean-tokens set the corpus), packed and placed
by the real planner (pack/planner.py plan_packs) with the config's pack settings,
and the model shape from --model-config (a transformers config.json; default
Qwen3-32B's) in place of model.path's weights. It prints what `wattgate gate` would write: the forecast with its
terms (gate/cost.py, wattgate/forecast/) and, with --remainder none, where
the uneven plan would hang and what that would have cost.

    python bench/forecast_example.py config/examples/qwen3-32b-2x8-b300.yaml --remainder none
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from wattgate.config import load_config
from wattgate.gate.checks import check_equal_steps
from wattgate.gate.cost import cost_markdown, cost_section
from wattgate.gate.inputs import PackRows
from wattgate.model_spec import ModelSpec
from wattgate.pack.assign import Layout
from wattgate.pack.planner import plan_packs

from gate import QWEN3_32B as QWEN3_32B_SHAPE  # bench/gate.py, beside this script

QWEN3_32B = dict(QWEN3_32B_SHAPE, torch_dtype="bfloat16")  # bf16 weights: what the load term reads


def pack_rows(placement, packs, lengths: np.ndarray, tokens: np.ndarray) -> PackRows:
    """packs.parquet's rows as the gate reads them, without writing the file."""
    per_pack = np.diff(packs.offsets)
    counts = per_pack[placement.pack]
    starts = packs.offsets[placement.pack]
    entry = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
    docs = packs.docs[entry]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return PackRows(
        epoch=placement.epoch,
        step=placement.step,
        micro=placement.micro,
        rank=placement.rank,
        slot=placement.slot,
        num_tokens=tokens[placement.pack],
        doc_ids=docs,
        doc_lengths=lengths[docs],
        offsets=offsets,
        length_offsets=offsets,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--docs", type=int, default=200_000, help="documents in the corpus (default 200,000)")
    parser.add_argument("--mean-tokens", type=float, default=2100.0, help="mean document length (default 2,100)")
    parser.add_argument("--remainder", help="override pack.remainder (e.g. none: the uneven plan the gate stops)")
    parser.add_argument("--model-config", type=Path, help="transformers config.json (default: Qwen3-32B's shape)")
    parser.add_argument(
        "--ledger",
        default="/nonexistent/throughput.jsonl",
        help="throughput ledger (default: none, so the forecast is calibrated or analytic)",
    )
    args = parser.parse_args()

    config = load_config(args.config)
    config["forecast"]["ledger"] = args.ledger
    if args.remainder:
        config["pack"]["remainder"] = args.remainder
    shape = json.loads(args.model_config.read_text()) if args.model_config else QWEN3_32B
    spec = ModelSpec.from_hf_config(shape, str(args.model_config or "Qwen3-32B"))
    # a model folder with the config alone: the load term reads params x its dtype, as for absent weights
    folder = Path(tempfile.mkdtemp(prefix="forecast-model-"))
    (folder / "config.json").write_text(json.dumps(shape))
    config["model"] = {"path": str(folder), "config": None}

    t, p = config["train"], config["pack"]
    rng = np.random.default_rng(0)
    sigma = 0.9
    lengths = np.clip(
        rng.lognormal(np.log(args.mean_tokens) - sigma**2 / 2, sigma, args.docs), 16, 4 * t["seq_len"]
    ).astype(np.int64)
    lengths = np.minimum(lengths, t["seq_len"])  # pretokenize's overlong: split keeps every piece <= seq_len
    world = config["cluster"]["nodes"] * config["cluster"]["gpus_per_node"]
    layout = Layout(world, t["micro_batch_size"], t["grad_accum"])
    packs, placement, tokens, _ = plan_packs(
        lengths, t["seq_len"], layout, p["remainder"], t["epochs"], p["seed"], p["attn_weight"]
    )
    rows = pack_rows(placement, packs, lengths, tokens)
    steps_per_epoch = int(rows.step[rows.epoch == 0].max()) + 1
    plan = {
        "world_size": world,
        "epochs": t["epochs"],
        "steps_per_epoch": steps_per_epoch,
        "attn_weight": p["attn_weight"],
        "micro_batch_size": t["micro_batch_size"],
        "grad_accum": t["grad_accum"],
    }
    inputs = SimpleNamespace(config=config, plan=plan, packs=rows)
    eq = check_equal_steps(rows, world, t["epochs"], t["micro_batch_size"], t["grad_accum"], steps_per_epoch)
    out, budget = cost_section(inputs, spec, eq)
    print(
        f"{args.config}: {args.docs:,} documents, {int(lengths.sum()):,} tokens, pack.remainder "
        f"{p['remainder']}, {world} ranks, {steps_per_epoch} steps per epoch; {spec.num_params / 1e9:.1f}B params"
    )
    print(f"equal_steps: {'pass' if eq.passed else 'FAIL'}: {eq.detail}")
    print(f"budget: {'pass' if budget.passed else 'FAIL'}: {budget.detail}")
    print("\n".join(cost_markdown(out)))
    if out["forecast"] is None:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The gate's forecast and failure cost for an example config, on a corpus of a stated size.

The examples (config/examples/*.yaml) point at data and weights that live on a
cluster. This script stands in for them: document lengths drawn from a
log-normal (seeded; --docs and --mean-tokens set the corpus), packed and placed
by the real planner (pack/planner.py plan_packs) with the config's pack settings,
and the model shape from --model-config (a transformers config.json; default
Qwen3-32B's) in place of model.path's weights. It prints what `wattgate gate` would write: the forecast with its
terms (gate/cost.py, wattgate/forecast/) and, with --remainder none, where
the uneven plan would hang and what that would have cost.

Figures: the forecast's wall time against its steps term alone (the plan's steps at the forecast throughput,
no start-up, load, warm-up, validation, checkpoints or export), and with an uneven plan the cost of the hang
against the whole run's forecast. `--smoke`: 5,000 documents (the config defaults to the B300 example).

    python bench/forecast_example.py config/examples/qwen3-32b-2x8-b300.yaml --remainder none
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchlib import Parser, fail, figure, positive_float, positive_int
from wattgate.config import load_config, run_config
from wattgate.gate.checks import check_equal_steps
from wattgate.gate.cost import cost_markdown, cost_section
from wattgate.gate.inputs import PackRows
from wattgate.model_spec import ModelSpec
from wattgate.pack.assign import Layout
from wattgate.errors import InputError
from wattgate.pack.planner import plan_packs
from wattgate.records.plan import Plan

from gate import QWEN3_32B as QWEN3_32B_SHAPE  # bench/gate.py, beside this script

QWEN3_32B = dict(QWEN3_32B_SHAPE, torch_dtype="bfloat16")  # bf16 weights: what the load term reads
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "config" / "examples" / "qwen3-32b-2x8-b300.yaml"
SMOKE_DOCS = 5000


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
    parser = Parser(description=__doc__.splitlines()[0], smoke=f"{SMOKE_DOCS:,} documents")
    default = DEFAULT_CONFIG.relative_to(ROOT)
    parser.add_argument("config", type=Path, nargs="?", help=f"a run config (default {default})")
    parser.add_argument("--docs", type=positive_int, default=None, help="documents in the corpus (default 200,000)")
    parser.add_argument(
        "--mean-tokens", type=positive_float, default=2100.0, help="mean document length (default 2,100)"
    )
    parser.add_argument("--remainder", help="override pack.remainder (e.g. none: the uneven plan the gate stops)")
    parser.add_argument("--model-config", type=Path, help="transformers config.json (default: Qwen3-32B's shape)")
    parser.add_argument(
        "--ledger",
        default="/nonexistent/throughput.jsonl",
        help="throughput ledger (default: none, so the forecast is calibrated or analytic)",
    )
    args = parser.parse_args()
    args.config = args.config or DEFAULT_CONFIG
    docs = args.docs or (SMOKE_DOCS if args.smoke else 200_000)

    try:
        config = load_config(args.config)
        shape = json.loads(args.model_config.read_text()) if args.model_config else QWEN3_32B
    except (InputError, OSError, ValueError) as exc:
        fail("bench/forecast_example.py", str(exc).splitlines()[0])
    config["forecast"]["ledger"] = args.ledger
    if args.remainder:
        config["pack"]["remainder"] = args.remainder
    spec = ModelSpec.from_hf_config(shape, str(args.model_config or "Qwen3-32B"))
    # a model folder with the config alone: the load term reads params x its dtype, as for absent weights
    folder = Path(tempfile.mkdtemp(prefix="forecast-model-"))
    (folder / "config.json").write_text(json.dumps(shape))
    config["model"] = {"path": str(folder), "config": None}
    try:
        typed = run_config(config, str(args.config))
    except InputError as exc:
        fail("bench/forecast_example.py", str(exc).splitlines()[0])

    t, p = typed.train, typed.pack
    rng = np.random.default_rng(0)
    sigma = 0.9
    lengths = np.clip(rng.lognormal(np.log(args.mean_tokens) - sigma**2 / 2, sigma, docs), 16, 4 * t.seq_len).astype(
        np.int64
    )
    lengths = np.minimum(lengths, t.seq_len)  # pretokenize's overlong: split keeps every piece <= seq_len
    world = typed.cluster.nodes * typed.cluster.gpus_per_node
    layout = Layout(world, t.micro_batch_size, t.grad_accum)
    packs, placement, tokens, _ = plan_packs(lengths, t.seq_len, layout, p.remainder, t.epochs, p.seed, p.attn_weight)
    rows = pack_rows(placement, packs, lengths, tokens)
    steps_per_epoch = int(rows.step[rows.epoch == 0].max()) + 1
    plan = Plan(
        world_size=world,
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        grad_accum=t.grad_accum,
        epochs=t.epochs,
        steps_per_epoch=steps_per_epoch,
        seed=p.seed,
        attn_weight=p.attn_weight,
        remainder=p.remainder,
    )
    inputs = SimpleNamespace(config=typed, plan=plan, packs=rows, validation=None)
    eq = check_equal_steps(rows, world, t.epochs, t.micro_batch_size, t.grad_accum, steps_per_epoch)
    out, budget = cost_section(inputs, spec, eq)
    print(
        f"{args.config}: {docs:,} documents, {int(lengths.sum()):,} tokens, pack.remainder "
        f"{p.remainder}, {world} ranks, {steps_per_epoch} steps per epoch; {spec.num_params / 1e9:.1f}B params"
    )
    print(f"equal_steps: {'pass' if eq.passed else 'FAIL'}: {eq.detail}")
    print(f"budget: {'pass' if budget.passed else 'FAIL'}: {budget.detail}")
    print("\n".join(cost_markdown(out)))
    fc = out.forecast
    if fc is None:
        fail("bench/forecast_example.py", f"no forecast: {out.forecast_unavailable}", 1)
    figure(
        "forecast_example",
        f"{args.config.name}: the train job's forecast, {docs:,} documents",
        f"{fc.wall_s / 3600:.2f} h wall, {fc.gpu_hours:.4g} GPU-hours on {fc.world_size} GPUs",
        f"its steps term alone {fc.terms_s.steps_s / 3600:.2f} h ({fc.steps} steps at {fc.throughput.source} "
        "throughput, nothing else)",
    )
    if out.failure is not None and out.failure.cost is not None:
        cost = out.failure.cost
        figure(
            "forecast_example",
            f"{args.config.name}, pack.remainder {p.remainder}: what the hang would cost",
            f"{cost.timeout_gpu_hours:.4g} GPU-hours (reached after {cost.reach_s / 3600:.2f} h)",
            f"the whole run's forecast {fc.gpu_hours:.4g} GPU-hours",
        )


if __name__ == "__main__":
    main()

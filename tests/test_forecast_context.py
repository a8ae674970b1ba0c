"""The forecast and the throughput ledger under parallel.context C: a record is matched on its C (a CP run's rate,
with its key/value all-gathers, never stands for a C = 1 run's, nor the reverse), a launched rank's planned cost
is its data rank's over C, and a C = 1 run's ledger line is what it was before context parallelism."""

import json

import numpy as np
import pytest

from conftest import TINY_MODEL
from wattgate.config import run_config, world_size
from wattgate.forecast.throughput import flops_throughput, measured_record
from wattgate.forecast.walltime import Settings, forecast, plan_step_costs
from wattgate.gate.cost import throughput
from wattgate.ledger import MeasuredSteps, RunShape, StorageWrites, append_ledger, read_ledger, run_record
from wattgate.model_spec import load_model_spec
from wattgate.records.ledger import LedgerLine
from wattgate.records.plan import Plan
from wattgate.run_files import PackRows

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2}

# the fields a train run's ledger line held before context parallelism (docs/architecture.md,
# "results/throughput.jsonl"): a C = 1 line keeps exactly these
C1_FIELDS = {
    "version",
    "time",
    "run_name",
    "shape",
    "shape_key",
    "gpu_model",
    "world_size",
    "seq_len",
    "micro_batch_size",
    "attn_weight",
    "steps",
    "cost_per_s",
    "tokens_per_s",
    "step_s",
    "warmup_s",
    "startup_s",
    "load_s",
    "checkpoints",
    "checkpoint_s",
    "export_s",
    "storage_gbps",
    "job_s",
}


def ledger_record(run_name: str, cost_per_step: float, shape: RunShape) -> LedgerLine:
    """A finished run of `shape`: 40 one-second steps of `cost_per_step` cost units each."""
    return run_record(
        run_name=run_name,
        run=shape,
        steps=MeasuredSteps(costs=np.full(40, cost_per_step), times=[1.0] * 40, tokens=40_000),
        writes=StorageWrites(checkpoints=0, checkpoint_s=0.0, checkpoint_bytes=0, export_s=0.0, export_bytes=0),
        startup_s=2.0,
        load_s=1.0,
        job_s=50.0,
    )


def run_shape(context: int | None = None, shape: dict = SHAPE, world: int = 4, seq_len: int = 256) -> RunShape:
    """A run's shape; `context` None leaves RunShape's default (what every caller before CP built)."""
    kw = {} if context is None else {"context": context}
    return RunShape(
        shape=shape, gpu_model="cpu", world_size=world, seq_len=seq_len, micro_batch_size=1, attn_weight=1e-3, **kw
    )


def test_a_c1_runs_ledger_line_holds_the_fields_it_held_before_context_parallelism():
    default = ledger_record("demo", 1000.0, run_shape()).to_json()
    assert set(default) == C1_FIELDS
    explicit = ledger_record("demo", 1000.0, run_shape(context=1)).to_json()
    default.pop("time"), explicit.pop("time")
    assert json.dumps(explicit, sort_keys=True) == json.dumps(default, sort_keys=True)
    cp = ledger_record("demo", 1000.0, run_shape(context=2)).to_json()
    assert cp.pop("context") == 2 and set(cp) == C1_FIELDS


def test_a_record_is_matched_on_its_context_degree(tmp_path):
    ledger = tmp_path / "throughput.jsonl"
    append_ledger(ledger, ledger_record("cp2", 500.0, run_shape(context=2)))
    records = read_ledger(ledger)  # through the file: `context` survives the round trip

    def match(context: int) -> LedgerLine | None:
        return measured_record(records, SHAPE, 4, "cpu", 256, 1, context)

    assert match(1) is None  # a C = 2 run never feeds a C = 1 forecast
    assert match(2) is not None and match(2).run_name == "cp2"
    append_ledger(ledger, ledger_record("plain", 1000.0, run_shape()))
    records = read_ledger(ledger)
    assert match(1).run_name == "plain" and match(2).run_name == "cp2"
    assert match(4) is None


def packs(rows_per_rank: list[list[list[int]]]) -> PackRows:
    """packs.parquet's arrays for one epoch, one micro-batch a step: rows_per_rank[step][rank] is that row's
    document lengths."""
    epoch, step, rank, lengths, offsets = [], [], [], [], [0]
    for s, ranks in enumerate(rows_per_rank):
        for r, docs in enumerate(ranks):
            epoch.append(0)
            step.append(s)
            rank.append(r)
            lengths += docs
            offsets.append(len(lengths))
    n, o = len(epoch), np.asarray(offsets, np.int64)
    doc_lengths = np.asarray(lengths, np.int64)
    return PackRows(
        epoch=np.asarray(epoch),
        step=np.asarray(step),
        micro=np.zeros(n, np.int64),
        rank=np.asarray(rank),
        slot=np.zeros(n, np.int64),
        num_tokens=np.add.reduceat(doc_lengths, o[:-1]),
        doc_ids=np.arange(len(lengths)),
        doc_lengths=doc_lengths,
        offsets=o,
        length_offsets=o.copy(),
    )


def test_the_model_side_step_estimate_is_a_launched_ranks_share_of_its_rows():
    rows = [[[200, 56], [256]], [[100, 100, 56], [30, 226]]]  # 2 steps x 2 data ranks, seq_len 256
    p = packs(rows)
    plan = Plan(
        world_size=2, seq_len=256, micro_batch_size=1, grad_accum=1, epochs=1, steps_per_epoch=2, seed=0,
        attn_weight=1e-3, remainder="rebin",
    )  # fmt: skip
    tp = flops_throughput(1_000_000, 1e12, 0.35, "analytic", "datasheet")

    def steps_s(context: int) -> float:
        s = Settings(
            world_size=plan.world_size * context,  # the launch's ranks
            on_gpu=False,
            checkpoint_every=100,
            checkpoint_at_epoch_end=False,
            checkpoint_bytes=0,
            export_bytes=0,
            load_bytes=0,
            storage_gbps=1.0,
            collective_timeout_s=600,
            job_limit_s=None,
        )
        return forecast(plan_step_costs(p, plan, None, context), tp, s, None).terms_s.steps_s

    # the planner's cost of each row (tokens + attn_weight x squared document lengths), the costliest data rank
    # a step, over C: every launched rank runs 1/C of its row's tokens and attention
    row_cost = [[sum(d) + plan.attn_weight * sum(x * x for x in d) for d in step] for step in rows]
    one_rank_s = sum(max(step) for step in row_cost) / tp.cost_per_s
    assert steps_s(1) == pytest.approx(one_rank_s, abs=1e-3)
    assert steps_s(2) == pytest.approx(one_rank_s / 2, abs=1e-3)
    assert steps_s(4) == pytest.approx(one_rank_s / 4, abs=1e-3)


def test_the_gates_throughput_takes_only_a_run_of_its_own_context_degree(tmp_path):
    def config(context: int):
        return run_config(
            {
                "model": {"config": TINY_MODEL},
                "cluster": {"nodes": 1, "gpus_per_node": 4},
                "parallel": {"context": context},
                "forecast": {"ledger": str(tmp_path / "throughput.jsonl")},
            }
        )

    c1, c2 = config(1), config(2)
    shape = load_model_spec(c1).shape()
    t = c1.train
    launch = run_shape(context=2, shape=shape, world=world_size(c2), seq_len=t.seq_len)
    append_ledger(tmp_path / "throughput.jsonl", ledger_record("cp2", 500.0, launch))
    measured, _ = throughput(c2, load_model_spec(c2), None)
    assert measured is not None and measured.source == "measured" and measured.cost_per_s == pytest.approx(500.0)
    assert "4 ranks, 2 per row" in measured.detail
    other, _ = throughput(c1, load_model_spec(c1), None)
    assert other is None or other.source != "measured"

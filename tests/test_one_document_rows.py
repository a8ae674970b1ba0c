"""A model whose layers carry a recurrent state (Mamba/SSM, short convolutions, linear attention) trains on rows
of one document each: the pack stage plans them (pack.documents_per_row auto asks transformers), plan.json records
max_documents_per_row 1, the gate's document_isolation passes such a plan saying what it costs, and a row of one
document and padding gives each of that document's tokens the loss of its own forward alone, and a whole run's
validation loss is what transformers' own forward of its final/ gives on each held-out document alone (the five
hybrid families, tiny, on the torch fallback paths of their mixers)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import yaml
import pytest
import torch

from support.architectures import TINY_DECODER
from support.runs import make_run
from support.scoring import scored_by_transformers
from wattgate.gate.run import run_gate
from wattgate.pack.assign import Layout
from wattgate.pack.plan import build_plan
from wattgate.pack.planner import plan_packs
from wattgate.run_files import read_packs
from wattgate.train.model import build_unsharded_model

from conftest import CADENCE

BASE = dict(TINY_DECODER, vocab_size=96, num_hidden_layers=2)
MAMBA2 = dict(
    mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2
) | dict(mamba_chunk_size=16)
# model_type -> what its tiny config adds: layer 0 carries a recurrent state, layer 1 attends
HYBRIDS = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2)
    | dict(num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2),
    "bamba": dict(MAMBA2, attn_layer_indices=[1]),
    "granitemoehybrid": dict(MAMBA2, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1)
    | dict(shared_intermediate_size=32),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2)
    | dict(linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    | dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16),
}
LFM2 = dict(BASE, model_type="lfm2", **HYBRIDS["lfm2"])


def saved_model(folder, model_type: str):
    """A transformers folder of the tiny `model_type` (random init by transformers: wattgate's own init has no rule
    for every router of these)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(BASE, **HYBRIDS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.float32)
    model.save_pretrained(str(folder))
    return {"path": str(folder)}


def token_losses(model, ids: torch.Tensor, positions: torch.Tensor, count: int, start: int = 0) -> torch.Tensor:
    """Each next-token loss of the `count` tokens from `start` of one row."""
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    targets = ids[start + 1 : start + count]
    return torch.nn.functional.cross_entropy(logits[start : start + count - 1], targets, reduction="none")


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_a_row_of_one_document_and_padding_gives_the_documents_own_losses(model_type, tmp_path):
    model = build_unsharded_model(saved_model(tmp_path / model_type, model_type), "eager", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    doc, before = torch.randint(3, 96, (21,), generator=g), torch.randint(3, 96, (10,), generator=g)
    pad = torch.zeros(43, dtype=torch.long)  # build_batch's padding: a position block of its own after the document
    alone = token_losses(model, doc, torch.arange(21), 21)
    row = token_losses(model, torch.cat([doc, pad]), torch.cat([torch.arange(21), torch.arange(43)]), 21)
    packed = token_losses(model, torch.cat([before, doc]), torch.cat([torch.arange(10), torch.arange(21)]), 21, 10)
    assert torch.allclose(row, alone, rtol=1e-5, atol=1e-5), (row - alone).abs().max()
    assert (packed - alone).abs().max() > 1e-2  # the control: after another document the state differs


def test_one_document_rows_pad_to_whole_steps_and_lose_no_document():
    lengths = np.random.default_rng(0).integers(5, 60, 37)
    layout = Layout(2, 2, 2, one_document_rows=True)
    packs, placement, tokens, _ = plan_packs(lengths, 64, layout, "rebin", 2, 0, 1e-5)
    assert packs.sizes.max() == 1 and len(packs) == 40 and (packs.sizes == 0).sum() == 3
    assert sorted(packs.docs.tolist()) == list(range(37)) and tokens.sum() == lengths.sum()
    assert len(placement.pack) == 2 * 40  # every epoch's rows on whole steps of 8
    dropped = plan_packs(lengths, 64, layout, "drop", 1, 0, 1e-5)[0]
    assert len(dropped) == 32 and dropped.sizes.max() == 1 and len(dropped.dropped_docs) == 5


def test_auto_plans_one_document_per_row_for_a_recurrent_model_and_the_gate_passes_it(tmp_path):
    lengths = [10, 14, 20, 8] * 12
    plan, config = make_run(tmp_path, lengths, gpus=2, validation_fraction=0.2, **CADENCE)
    assert "max_documents_per_row" not in json.loads((plan / "plan.json").read_text())  # attention only: many
    assert int(read_packs(plan / "packs.parquet").docs_per_row.max()) >= 2
    config = config.replace(model=config.model.replace(config=LFM2))
    one = tmp_path / "plan-one"
    build_plan(config, tmp_path / "pretokenized", one)
    recorded = json.loads((one / "plan.json").read_text())
    assert recorded["max_documents_per_row"] == 1
    for name in ("packs.parquet", "eval_packs.parquet"):
        assert int(read_packs(one / name).docs_per_row.max()) == 1
    run_gate(config, tmp_path / "pretokenized", one, tmp_path / "gate")
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    check = next(c for c in report["checks"] if c["name"] == "document_isolation")
    assert check["passed"], check["detail"]
    assert "layer 0 (conv) carries a recurrent state, so rows hold one document each" in check["detail"]
    assert (
        "max_documents_per_row 1" in check["detail"] and "for the same documents packed many per row" in check["detail"]
    )
    # the empty rows that make up the last step idle its ranks for part of a step: named, not a failed balance
    balance = next(c for c in report["checks"] if c["name"] == "balance")
    padded = bool((read_packs(one / "packs.parquet").num_tokens == 0).any())
    assert balance["passed"] and ("padding rows left out" in balance["detail"]) == padded, balance["detail"]
    # the same config forced to `many`: the gate fails, naming the layer
    many = config.replace(pack=config.pack.replace(documents_per_row="many"))
    build_plan(many, tmp_path / "pretokenized", tmp_path / "plan-many")
    run_gate(many, tmp_path / "pretokenized", tmp_path / "plan-many", tmp_path / "gate-many")
    report = json.loads((tmp_path / "gate-many" / "gate.json").read_text())
    check = next(c for c in report["checks"] if c["name"] == "document_isolation")
    assert not check["passed"] and "layer 0 (conv) carries a recurrent state" in check["detail"]


def train_alone(tmp, out) -> None:
    """`wattgate train` as a world of one started by hand (no torchrun agent: one process fewer to start)."""
    cmd = [sys.executable, "-m", "wattgate", "train", "--config", str(tmp / "config-1.yaml"), "--run-dir", str(out)]
    cmd += ["--pretokenized", str(tmp / "pretokenized"), "--plan", str(tmp / "plan-1")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_a_hybrid_runs_validation_loss_is_its_own_forward_on_each_held_out_document(model_type, tmp_path):
    """`wattgate train` (one rank) of the tiny hybrid from its folder, planned with pack.documents_per_row auto:
    rows of one document, so the reported validation loss is final/'s own forward on each document alone."""
    lengths = np.random.default_rng(1).integers(8, 40, 40).tolist()
    train = dict(CADENCE, max_steps=3, checkpoint_every=100, eval_every=100, export_dtype="float32")
    _, config = make_run(tmp_path, lengths, gpus=1, validation_fraction=0.2, **train)
    folder = saved_model(tmp_path / "model", model_type)["path"]
    config = config.replace(model=config.model.replace(config=None, path=folder))
    shutil.rmtree(tmp_path / "plan-1")
    build_plan(config, tmp_path / "pretokenized", tmp_path / "plan-1")
    assert json.loads((tmp_path / "plan-1" / "plan.json").read_text())["max_documents_per_row"] == 1
    (tmp_path / "config-1.yaml").write_text(yaml.safe_dump(config.to_json()))
    train_alone(tmp_path, tmp_path / "run")
    reported = pq.read_table(tmp_path / "run" / "eval.parquet", columns=["loss"]).column("loss").to_pylist()[-1]
    own = scored_by_transformers(tmp_path / "run" / "final", tmp_path / "pretokenized")
    assert abs(reported - own) <= 1e-5 * own, (model_type, reported, own)

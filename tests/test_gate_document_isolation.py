"""Gate check `document_isolation`: a model whose layers carry a recurrent state (Mamba/SSM, short convolutions,
linear attention) lets a packed document see the one before it, so the gate fails such a model on a plan whose packs
hold several documents, naming the layers, before anything is submitted; attention-only models and plans of one
document per pack pass. Which layers carry a state is transformers' own answer (its cache layers)."""

import json

import pytest
import torch

from support.architectures import TINY_DECODER
from wattgate.gate.run import run_gate
from wattgate.train.model import build_unsharded_model, model_hf_config, recurrent_layers

from conftest import CADENCE, TINY, make_run

# LFM2: a short-convolution layer, then attention (transformers' cache gives the first a linear-attention state)
LFM2 = dict(TINY_DECODER, model_type="lfm2", vocab_size=96, layer_types=["conv", "full_attention"])
# three periods of it: the proof dry-runs 2 layers, and the check reads every layer of the real depth
LFM2_6_LAYERS = dict(LFM2, num_hidden_layers=6, layer_types=["conv", "full_attention"] * 3)


def second_document_logits(model_cfg: dict, packed: bool) -> torch.Tensor:
    """The logits of document B (12 tokens) alone, or after document A (10 tokens) in one packed row with
    position_ids restarting at B, as wattgate's packs hold them."""
    model = build_unsharded_model(model_cfg, "eager", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 96, (10,), generator=g), torch.randint(3, 96, (12,), generator=g)
    ids = torch.cat([a, b]) if packed else b
    positions = torch.cat([torch.arange(10), torch.arange(12)]) if packed else torch.arange(12)
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    return logits[-12:]


@pytest.mark.parametrize("model,recurrent", [(TINY, False), (LFM2, True)])
def test_a_packed_document_sees_the_one_before_it_exactly_when_a_layer_carries_a_recurrent_state(model, recurrent):
    cfg = {"config": model}
    alone, packed = second_document_logits(cfg, packed=False), second_document_logits(cfg, packed=True)
    difference = (alone - packed).abs().max().item()
    assert bool(recurrent_layers(model_hf_config(cfg))) is recurrent
    assert (difference > 1e-3) if recurrent else (difference < 1e-5), difference


def gate(tmp_path, lengths, model: dict, runs: int = 1) -> list[dict]:
    """gate.json of each of `runs` gates on one plan into one folder (a rerun reuses the kept proof)."""
    plan, config = make_run(tmp_path, lengths, gpus=2, **CADENCE)
    config = config.replace(model=config.model.replace(config=model))
    reports = []
    for _ in range(runs):
        run_gate(config, tmp_path / "pretokenized", plan, tmp_path / "gate")
        reports.append(json.loads((tmp_path / "gate" / "gate.json").read_text()))
    return reports


def isolation(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "document_isolation")


def test_a_recurrent_model_on_packs_of_several_documents_fails_naming_its_layers_and_the_packs(tmp_path):
    report, again = gate(tmp_path, [10, 14, 20, 8] * 12, LFM2_6_LAYERS, runs=2)  # seq_len 64: several per pack
    check = isolation(report)
    assert not report["passed"] and not check["passed"]
    assert (
        "model.config (lfm2): layer 0 (conv), layer 2 (conv), layer 4 (conv) carry a recurrent state" in check["detail"]
    )
    assert " packs hold two or more documents" in check["detail"]
    recurrent = ["layer 0 (conv)", "layer 2 (conv)", "layer 4 (conv)"]
    assert report["collectives"]["depth"]["recurrent"] == recurrent  # the proof's record, kept for reruns
    assert report["collectives"]["proxy_layers"] == 2  # the proxy's own 2 layers hold one of them
    assert "| document_isolation | **FAIL** |" in (tmp_path / "gate" / "gate.md").read_text()
    # the rerun reuses the kept proof: the layers come from its record, and the verdict is the same
    assert again["collectives"]["reused"] is not None and isolation(again) == check


def test_a_recurrent_model_whose_packs_each_hold_one_document_passes(tmp_path):
    [report] = gate(tmp_path, [40, 50, 60, 45] * 6, LFM2)  # no two documents fit in 64 tokens
    check = isolation(report)
    assert check["passed"] and "every one of" in check["detail"] and "holds one document" in check["detail"]


def test_an_attention_only_model_passes_and_records_no_recurrent_layer(tmp_path):
    [report] = gate(tmp_path, [10, 14, 20, 8] * 12, TINY)
    assert isolation(report)["passed"] and "recurrent" not in report["collectives"]["depth"]

"""The gate at real depths: a model folder of every architecture of the matrix passes the gate with the collective
proof on at depths its proxy does not equal (3, 5 and 64 layers), and a folder with the published Qwen3-32B shape
(64 layers, header only: no 65 GB of weights) passes the weights check and the proof. The proxy reads the folder's
tensors for the layers it builds and the folder is checked whole at its own depth, so a config.json that says
fewer layers than its weights still fails, in one line. The matrix's own end-to-end folders (test_architectures.py)
are 7 layers deep: the scaled path of every family."""

import json

import pytest
import yaml
from support.architectures import ARCHITECTURES, save_tiny_model
from support.models import save_header_only_folder
from support.runs import pretokenize_and_pack

from wattgate.cli import main
from wattgate.config import run_config, validate_config
from wattgate.data.demo_corpus import write_demo_corpus
from wattgate.gate.weights_check import check_weights
from wattgate.proof.depth import layer_pattern, proxy_depths
from wattgate.proof.prove import prove_collectives

from conftest import QWEN3_32B

TRAIN = dict(seq_len=128, micro_batch_size=2, grad_accum=2, max_steps=6, warmup_steps=0, checkpoint_every=3)


def gate_config(tokenizer, corpus, model: dict, **cluster) -> dict:
    return validate_config(
        {
            "run_name": "depths",
            "data": {"inputs": [str(corpus)], "validation": {"fraction": 0.2}},
            "tokenizer": {"path": str(tokenizer)},
            "model": model,
            "train": dict(TRAIN, eval_every=3),
            "cluster": {"nodes": 1, "gpus_per_node": 2, **cluster},
        }
    )


@pytest.fixture(scope="module")
def planned(tmp_path_factory, tokenizer_dir):
    """The corpus pretokenized and planned once for 2 ranks: the model enters neither stage."""
    root = tmp_path_factory.mktemp("depths")
    corpus = root / "corpus.jsonl"
    write_demo_corpus(corpus, num_docs=120, seed=7, max_turns=3)
    pretokenize_and_pack(root, gate_config(tokenizer_dir, corpus, {"config": {"model_type": "qwen3"}}))
    return root, corpus, tokenizer_dir


def gate(planned, model: dict, out, **cluster) -> tuple[int, dict]:
    root, corpus, tokenizer = planned
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(gate_config(tokenizer, corpus, model, **cluster)))
    argv = ["gate", "--config", str(config), "--pretokenized", str(root / "pretokenized"), "--plan", str(root / "plan")]
    rc = main([*argv, "--out", str(out)])
    return rc, json.loads((out / "gate.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layers", [3, 5, 64])
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_a_folder_of_any_depth_passes_the_gate_with_the_proof_on(planned, model_type, layers, tmp_path):
    folder = save_tiny_model(tmp_path / "model", model_type, layers=layers)
    rc, report = gate(planned, {"path": str(folder)}, tmp_path / "gate")
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["weights"]["passed"], checks["weights"]["detail"]
    assert checks["collectives"]["passed"], checks["collectives"]["detail"]
    assert rc == 0, [c["detail"] for c in report["checks"] if not c["passed"]]
    proof = report["collectives"]
    depth = proof["depth"]
    assert depth["layers"] == layers
    if layers == 64:  # the scaled path: a proxy shallower than the folder, each class's count scaled to 64 layers
        assert proof["proxy_layers"] < layers and all(
            c["collectives_at_depth"] > c["collectives"] for c in proof["classes"]
        )


def test_a_config_json_with_fewer_layers_than_its_weights_fails_in_one_line(planned, tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "model", "llama", layers=5)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=3)))
    rc, report = gate(planned, {"path": str(folder)}, tmp_path / "gate")
    checks = {c["name"]: c for c in report["checks"]}
    assert rc != 0 and not checks["weights"]["passed"] and not checks["collectives"]["passed"]
    for name in ("weights", "collectives"):
        detail = checks[name]["detail"]
        assert "\n" not in detail and "checkpoint tensor(s) the model does not use" in detail, detail
        assert "model.layers.3." in detail and "num_hidden_layers 3" in detail, detail
    assert "Traceback" not in capsys.readouterr().err


# Qwen3-32B as its config.json publishes it (the fields the model builder reads)
QWEN3_32B_CONFIG = {
    **QWEN3_32B,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "pad_token_id": 0,
}


@pytest.mark.slow
def test_a_header_only_qwen3_32b_folder_passes_the_weights_check_and_the_proof(planned, tmp_path):
    """64 layers at full width (5120 hidden, 151,936-token vocabulary), bf16 on H100s: the proof dry-runs a
    1-layer proxy with FakeTensors (no memory) and scales by the period to 64."""
    root, corpus, tokenizer = planned
    folder = save_header_only_folder(tmp_path / "Qwen3-32B", QWEN3_32B_CONFIG)
    assert (folder / "model.safetensors").stat().st_size > 60e9  # sparse: its size, not its blocks
    config = run_config(gate_config(tokenizer, corpus, {"path": str(folder)}, gpu_model="H100"))
    weights = check_weights(config)
    assert weights.passed and "707 tensors" in weights.detail, weights.detail
    depth = layer_pattern(config.model)
    assert (depth.layers, depth.period, depth.head) == (64, 1, 0) and proxy_depths(depth) == (1, 2)
    proof = prove_collectives(config, root / "pretokenized", root / "plan").to_json()
    assert proof["passed"], proof["detail"]
    assert proof["proxy_layers"] == 1 and proof["depth"]["params"]["total"] > 32e9
    for c in proof["classes"]:
        assert c["collectives_at_depth"] > c["collectives"]

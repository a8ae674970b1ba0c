"""Gate check `weights` (issue 31, item 5): model.path's safetensors are checked against the model its config
builds before anything is submitted, from the headers alone, with the trainer's own checks (names, shapes,
dtypes, nothing unused); a random-init model passes with a note. Each mismatch is one line naming the file."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from wattgate.config import run_config
from wattgate.gate.run import run_gate
from wattgate.gate.weights_check import check_weights
from wattgate.records.run_config import RunConfig

from conftest import CADENCE, TINY, make_run


def saved_folder(path, cfg=TINY, dtype=torch.bfloat16):
    """A model folder as transformers saves it (config.json + model.safetensors), random init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).to(dtype)
    model.save_pretrained(path)
    return path


def config_for(folder) -> RunConfig:
    return run_config({"model": {"path": str(folder), "config": None}})


def edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, **changes)))


def edit_weights(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return saved_folder(tmp_path_factory.mktemp("weights") / "qwen3")


def test_random_init_passes_with_a_note():
    check = check_weights(run_config({"model": {"path": None, "config": TINY}}))
    assert check.passed and check.name == "weights" and "random init" in check.detail


def test_a_folder_transformers_saved_passes_from_its_headers_alone(folder, monkeypatch):
    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr("wattgate.train.checkpoint_layout.read_rows", no_read)
    check = check_weights(config_for(folder))
    assert check.passed, check.detail
    assert check.detail.startswith(f"25 tensors in 1 safetensors file(s) of {folder} match Qwen3ForCausalLM's names")
    assert "(25 bfloat16)" in check.detail and "no tensor loaded" in check.detail


@pytest.mark.parametrize(
    "config_change,weights_change,expected",
    [
        (
            {"num_hidden_layers": 1, "layer_types": ["full_attention"]},
            None,
            "11 checkpoint tensor(s) the model does not use (model.layers.1.",
        ),
        ({"intermediate_size": 48}, None, "has shape (64, 32), the model expects (48, 32); model.path and its"),
        (None, lambda t: t.pop("model.norm.weight"), "no tensor 'model.norm.weight' in the checkpoint"),
        (
            None,
            lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}),
            "'model.norm.weight' is int8, the model's tensor is float32; model.path holds quantized",
        ),
    ],
    ids=["fewer-layers", "shape", "missing", "int8"],
)
def test_weights_that_do_not_fit_the_config_fail_in_one_line(folder, tmp_path, config_change, weights_change, expected):
    mine = saved_folder(tmp_path / "m") if weights_change else tmp_path / "m"
    if not weights_change:
        mine.mkdir()
        for f in folder.iterdir():
            (mine / f.name).write_bytes(f.read_bytes())
    if config_change:
        edit_config(mine, **config_change)
    if weights_change:
        edit_weights(mine, weights_change)
    check = check_weights(config_for(mine))
    assert not check.passed and expected in check.detail and "\n" not in check.detail
    assert str(mine) in check.detail


def test_a_folder_without_safetensors_fails_naming_what_to_do(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    check = check_weights(config_for(tmp_path))
    assert not check.passed and "needs safetensors weights" in check.detail


def test_the_gate_fails_before_submission_when_the_weights_do_not_fit(folder, tmp_path):
    lengths = [20, 30, 40, 50] * 10
    plan, config = make_run(tmp_path, lengths, gpus=2, **CADENCE)
    mine = tmp_path / "m"
    mine.mkdir()
    for f in folder.iterdir():
        (mine / f.name).write_bytes(f.read_bytes())
    edit_config(mine, num_hidden_layers=1, layer_types=["full_attention"])
    config = config.replace(model=config.model.replace(path=str(mine), config=None))
    config = config.replace(gate=config.gate.replace(collectives=False))
    report = run_gate(config, tmp_path / "pretokenized", plan, tmp_path / "gate").to_json()
    check = next(c for c in report["checks"] if c["name"] == "weights")
    assert not report["passed"] and not check["passed"] and "does not use" in check["detail"]
    assert (
        not (tmp_path / "gate" / "PASSED").exists()
        and "| weights | **FAIL** |" in (tmp_path / "gate" / "gate.md").read_text()
    )


def test_a_head_transformers_renames_by_class_name_loads_once_fsdp_renamed_the_class(tmp_path):
    """GPT-NeoX saves its head as `embed_out`; transformers files that renaming under the class name
    GPTNeoXForCausalLM, which FSDP2 changes to FSDPGPTNeoXForCausalLM. The proof loads the folder as training
    does, after fully_shard: the head must still be found."""
    neox = dict(TINY, model_type="gpt_neox", tie_word_embeddings=False)
    del neox["head_dim"], neox["num_key_value_heads"]
    mine = saved_folder(tmp_path / "neox", neox)
    assert "embed_out.weight" in load_file(mine / "model.safetensors")
    plan, config = make_run(tmp_path, [20, 30, 40, 50] * 10, gpus=2, **CADENCE)
    config = config.replace(model=config.model.replace(path=str(mine), config=None))
    report = run_gate(config, tmp_path / "pretokenized", plan, tmp_path / "gate").to_json()
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["weights"]["passed"], checks["weights"]["detail"]
    assert checks["collectives"]["passed"], checks["collectives"]["detail"]

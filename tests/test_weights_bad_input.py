"""Weights checked before they are read (issue 25, section 3): safetensors headers against the file's bytes,
and a model config that disagrees with its checkpoint (tensors the model would not use)."""

import json
import struct

import pytest
import torch

from wattgate.errors import InputError
from wattgate.train.safetensors_io import SafetensorsStream, read_header, read_rows

from conftest import TINY  # the train tests' tiny Qwen3


def _two_tensors(path):
    a, b = torch.arange(8, dtype=torch.float32).reshape(2, 4), torch.full((2, 4), 7.0)
    stream = SafetensorsStream(path, [("a", (2, 4), torch.float32), ("b", (2, 4), torch.float32)])
    stream.write(a)
    stream.write(b)
    stream.close()
    return a, b


def _rewrite_header(path, edit) -> None:
    """The file with its JSON header changed by `edit` (the data bytes as they were)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _library_refuses(path) -> bool:
    from safetensors.torch import load_file

    try:
        load_file(path)
    except Exception:
        return True
    return False


def test_a_header_claiming_more_rows_than_its_bytes_is_refused_not_read_from_the_next_tensor(tmp_path):
    path = tmp_path / "m.safetensors"
    a, _ = _two_tensors(path)
    assert torch.equal(read_rows(path, read_header(path)["a"], 0, 2), a)  # the honest file reads back
    _rewrite_header(path, lambda h: h["a"].update(shape=[4, 4]))  # 4 rows claimed, 2 rows of bytes
    assert _library_refuses(path)
    with pytest.raises(InputError, match=r"m\.safetensors: tensor 'a' claims F32 \[4, 4\] \(64 bytes\) but its "):
        read_header(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h["a"].update(dtype="BF16"), r"tensor 'a' claims BF16 \[2, 4\] \(16 bytes\)"),
        (lambda h: h["b"].update(data_offsets=[16, 48]), r"tensor 'b' starts at data byte 16, expected 32"),
        (lambda h: h["b"].update(data_offsets=[48, 80]), r"tensor 'b' starts at data byte 48, expected 32"),
        (lambda h: h["a"].update(shape=[2, -4]), r"tensor 'a' shape \[2, -4\]"),
        (lambda h: h["a"].update(data_offsets=[0]), r"tensor 'a' data_offsets \[0\]"),
        (lambda h: h.update(a=[1, 2]), r"tensor 'a' is not an object"),
    ],
)
def test_every_header_entry_is_checked_against_the_file(tmp_path, edit, message):
    path = tmp_path / "m.safetensors"
    _two_tensors(path)
    _rewrite_header(path, edit)
    assert _library_refuses(path)
    with pytest.raises(InputError, match=message):
        read_header(path)


@pytest.mark.parametrize("cut, why", [(-8, "truncated"), (+8, "trailing bytes")])
def test_a_file_shorter_or_longer_than_its_header_says_is_refused(tmp_path, cut, why):
    path = tmp_path / "m.safetensors"
    _two_tensors(path)
    raw = path.read_bytes()
    path.write_bytes(raw[:cut] if cut < 0 else raw + b"\0" * cut)
    assert _library_refuses(path)
    with pytest.raises(InputError, match=rf"the header describes \d+ bytes, the file has \d+: {why}"):
        read_header(path)


def _saved_model(folder, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY, **config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _load(folder):
    from wattgate.train.model import build_meta_model
    from wattgate.train.weights import materialize

    model = build_meta_model({"path": str(folder)}, "sdpa")
    materialize(model, torch.device("cpu"), {"path": str(folder)}, seed=0)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_matching_its_config_loads_every_tensor(tmp_path, tied):
    ref = _saved_model(tmp_path, tie_word_embeddings=tied)
    model = _load(tmp_path)
    for name, p in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name


def test_a_config_with_fewer_layers_than_its_weights_is_an_error_naming_the_unused_tensors(tmp_path):
    _saved_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 1  # over 2-layer weights: before, a silent 1-layer model
    cfg.pop("layer_types", None)  # (with it, transformers refuses the config itself, in train/model.py)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"checkpoint tensor\(s\) the model does not use \(model\.layers\.1\.") as e:
        _load(tmp_path)
    assert "num_hidden_layers 1" in str(e.value)


def test_a_config_whose_layer_types_disagree_with_its_depth_is_one_line(tmp_path):
    """num_hidden_layers edited alone under a layer_types list: huggingface_hub's own validation error (not a
    ValueError) was raised raw on every rank; now one line naming the file."""
    import json

    from transformers import Qwen3Config

    from wattgate.errors import InputError
    from wattgate.train.model import model_hf_config

    cfg = Qwen3Config(**{k: v for k, v in TINY.items() if k != "model_type"}).to_dict()
    cfg["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"config\.json: not a usable transformers model config \(.*layer_type"):
        model_hf_config({"path": str(tmp_path)})

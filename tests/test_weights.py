"""Sharded load and export: each rank reads only its rows, random init independent of world size,
logits equal to a plain from_pretrained, bf16 sharded export that round-trips, measured RSS."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from wattgate.model_spec import ModelSpec
from wattgate.train.safetensors_io import SafetensorsStream, read_header, read_rows
from wattgate.train.weights import (
    ExportEntry,
    export_file_names,
    float32_kept,
    plan_export_files,
    seeded_normal_rows,
)

from conftest import TINY_3_LAYERS, save_hf_model

REPO = Path(__file__).resolve().parents[1]


def torchrun(ranks: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def write_config(path: Path, ranks: int, model: dict, **train) -> Path:
    path.write_text(
        yaml.safe_dump(
            {"run_name": "t", "model": model, "train": train, "cluster": {"nodes": 1, "gpus_per_node": ranks}}
        )
    )
    return path


def load_check(tmp: Path, ranks: int, model: dict, name: str, **train) -> dict:
    cfg = write_config(tmp / f"{name}.yaml", ranks, model, **train)
    torchrun(ranks, "-m", "wattgate", "load-check", "--config", str(cfg), "--out", str(tmp / name), "--export")
    return json.loads((tmp / name / "load-check.json").read_text())


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------- pure parts


def test_seeded_rows_are_the_same_however_the_tensor_is_cut():
    shape = (1000, 300)  # ~3.5k rows per block: several blocks, uneven cuts
    whole = seeded_normal_rows("w", shape, 0, shape[0], seed=3)
    for cuts in ([0, 333, 1000], [0, 1, 999, 1000], [0, 500, 501, 1000]):
        parts = [seeded_normal_rows("w", shape, a, b - a, seed=3) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(seeded_normal_rows("w", shape, 0, 10, seed=4), whole[:10])
    assert not torch.equal(seeded_normal_rows("v", shape, 0, 10, seed=3), whole[:10])


def test_streamed_safetensors_round_trip_and_row_reads(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(7, 5), "b": torch.randn(3), "c": torch.randn(4, 2, 3)}
    path = tmp_path / "x.safetensors"
    stream = SafetensorsStream(path, [(k, tuple(v.shape), torch.bfloat16) for k, v in tensors.items()])
    for v in tensors.values():
        stream.write(v)
    stream.close()
    loaded = load_file(path)  # the reference reader agrees with the header and data
    assert all(torch.equal(loaded[k], v.bfloat16()) for k, v in tensors.items())
    header = read_header(path)
    assert torch.equal(read_rows(path, header["a"], 2, 3), tensors["a"][2:5].bfloat16())
    assert torch.equal(read_rows(path, header["c"], 3, 1), tensors["c"][3:].bfloat16())
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_streamed_file_holds_each_tensor_in_its_own_dtype(tmp_path):
    from safetensors.torch import load_file

    tensors = {"w": (torch.randn(4, 3), torch.bfloat16), "router": (torch.randn(2, 3), torch.float32)}
    path = tmp_path / "x.safetensors"
    stream = SafetensorsStream(path, [(k, tuple(v.shape), d) for k, (v, d) in tensors.items()])
    for v, _ in tensors.values():
        stream.write(v)
    stream.close()
    loaded = load_file(path)
    assert {k: v.dtype for k, v in loaded.items()} == {"w": torch.bfloat16, "router": torch.float32}
    assert torch.equal(loaded["router"], tensors["router"][0])
    assert torch.equal(read_rows(path, read_header(path)["router"], 1, 1), tensors["router"][0][1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_export_keeps_in_float32_what_transformers_holds_in_float32(tmp_path, dtype):
    """DeepSeek-V3 keeps its router (`gate.weight`, `e_score_correction_bias`) in float32 whatever the model's
    dtype; GPT-OSS keeps its norms in float32 under float16 only. The export's rule gives what from_pretrained
    holds (and save_pretrained then writes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from support.architectures import tiny_config

    for model_type in ("deepseek_v3", "gpt_oss"):
        cfg = tiny_config(model_type)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
        model.save_pretrained(tmp_path / model_type)
        held = AutoModelForCausalLM.from_pretrained(tmp_path / model_type, dtype=dtype)  # its dtype plan applied
        kept = float32_kept(held, dtype)
        wanted = {n for n, t in held.state_dict().items() if t.dtype == torch.float32 and dtype != torch.float32}
        assert {n for n in held.state_dict() if kept(n)} == wanted, model_type
    assert wanted or dtype != torch.float16  # GPT-OSS's norms under float16: the rule is not vacuous


def test_export_files_are_planned_like_hugging_face():
    entries = [ExportEntry(f"t{i}", torch.empty(0), (10, 10), torch.bfloat16) for i in range(5)]  # 200 bytes each
    files = plan_export_files(entries, max_shard_bytes=450)
    assert [len(f) for f in files] == [2, 2, 1]
    assert export_file_names(3) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert export_file_names(1) == ["model.safetensors"]
    big = plan_export_files(entries, max_shard_bytes=100)  # a tensor over the limit: a file alone
    assert [len(f) for f in big] == [1] * 5


# ---------------------------------------------------------------- under torchrun


@pytest.mark.slow
def test_random_init_does_not_depend_on_world_size(tmp_path):
    model = {"config": dict(TINY_3_LAYERS, tie_word_embeddings=True)}
    one = load_check(tmp_path, 1, model, "w1", export_dtype="float32", export_max_shard_gib=1e-5)
    three = load_check(tmp_path, 3, model, "w3", export_dtype="float32", export_max_shard_gib=1e-5)
    assert one["world_size"] == 1 and three["world_size"] == 3
    files = sorted(p.name for p in (tmp_path / "w1/final").iterdir())
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    assert files == sorted(p.name for p in (tmp_path / "w3/final").iterdir())
    for name in files:  # byte for byte: same weights, same files
        assert (tmp_path / "w1/final" / name).read_bytes() == (tmp_path / "w3/final" / name).read_bytes(), name
    a = folder_tensors(tmp_path / "w1/final")
    emb = a["model.embed_tokens.weight"]
    assert 0.015 < emb.std().item() < 0.025 and "lm_head.weight" not in a  # initializer_range; tied
    assert torch.equal(a["model.norm.weight"], torch.ones(32))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_sharded_load_gives_the_logits_of_from_pretrained(tmp_path, tied):
    # a sharded bf16 checkpoint; 3 ranks cut every matrix unevenly (hidden 32, vocab 96 / 3 ranks...)
    path = save_hf_model(tmp_path / "model", seed=1, shard="20KB", tie_word_embeddings=tied)
    assert (path / "model.safetensors.index.json").exists()
    cfg = write_config(tmp_path / "c.yaml", 3, {"path": str(path)}, activation_checkpointing=True)
    torchrun(3, str(REPO / "tests/dist/sharded_load_forward.py"), str(cfg), str(tmp_path / "probe"))
    probe = json.loads((tmp_path / "probe/probe.json").read_text())
    assert probe["world"] == 3 and probe["max_abs_delta"] == 0.0  # rotary inv_freq, ties and every slice right


@pytest.mark.slow
def test_export_in_the_input_dtype_round_trips_through_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_hf_model(tmp_path / "model", seed=2, dtype=torch.float16, tie_word_embeddings=False)
    report = load_check(tmp_path, 2, {"path": str(path)}, "ex", export_max_shard_gib=2e-5)
    assert report["export_dtype"] == "float16"  # the checkpoint's own dtype, not fp32
    final = tmp_path / "ex/final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(folder_tensors(path))
    exported, source = folder_tensors(final), folder_tensors(path)
    assert all(exported[k].dtype == torch.float16 and torch.equal(exported[k], source[k]) for k in source)
    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    assert model.dtype == torch.float16 and json.loads((final / "config.json").read_text())["dtype"] == "float16"
    override = load_check(tmp_path, 2, {"path": str(path)}, "ex32", export_dtype="float32")
    assert override["export_dtype"] == "float32"
    assert folder_tensors(tmp_path / "ex32/final")["lm_head.weight"].dtype == torch.float32


QWEN_SHAPED = {
    "model_type": "qwen3",
    "vocab_size": 16384,
    "hidden_size": 768,
    "intermediate_size": 2304,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 96,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


@pytest.mark.slow
def test_four_ranks_load_a_bf16_folder_within_their_shard_plus_one_layer(tmp_path):
    path = save_hf_model(tmp_path / "model", seed=0, **{k: v for k, v in QWEN_SHAPED.items() if k != "model_type"})
    spec = ModelSpec.from_hf_config(QWEN_SHAPED, "test")
    report = load_check(tmp_path, 4, {"path": str(path)}, "rss")
    assert report["params"] == spec.num_params
    shard = spec.num_params * 4 / 4
    layer = spec.layer_params * 4
    whole = spec.num_params * 4
    slack = 32 << 20  # allocator and interpreter noise, measured ~7 MiB
    gib = 1 << 30
    for r in report["memory"]["per_rank"]:
        load = r["phases"]["load"]
        grown = (load["host_peak_gib"] - load["host_at_start_gib"]) * gib
        assert grown <= shard + layer + slack, (r["rank"], grown / 2**20, (shard + layer) / 2**20)
        assert grown < whole / 2  # far from today's whole fp32 model per rank


def test_unsharded_reference_model_keeps_tied_embeddings_and_rotary_buffers():
    from transformers import AutoConfig, AutoModelForCausalLM

    from wattgate.train.model import build_unsharded_model

    model = build_unsharded_model({"config": dict(TINY_3_LAYERS, tie_word_embeddings=True)}, "sdpa", seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = dict(TINY_3_LAYERS)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)

"""What trains is what the gate verified: before the first step every rank hashes its share of the shards against
manifest.json's shard_hashes (which the gate checked) and of model.path's chunks against gate.json model_files, one
rank checks the tokenizer against the manifest, and all ranks stop with one line naming the changed file. A byte
flipped in a shard or a weight after the gate trained silently; a changed tokenizer was found only at the export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from support.runs import pretokenize_and_pack

from conftest import CADENCE, fake_pretokenized, make_run, save_hf_model, torchrun, train_config
from wattgate.cli import main
from wattgate.config import run_config, validate_config
from wattgate.pack.plan import build_plan

BIN = Path(sys.executable).parent

LENGTHS = np.random.default_rng(4).integers(5, 60, 60).tolist()


def train(tmp, out) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(torchrun(tmp, 2, out), capture_output=True, text=True, env=env, timeout=300)


def flip_a_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def wattgate_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("wattgate train: ")]


def test_a_shard_changed_after_the_plan_stops_every_rank_before_the_first_step(tmp_path):
    make_run(tmp_path, LENGTHS, gpus=2, **CADENCE)
    shards = sorted((tmp_path / "pretokenized").glob("shard-*.parquet"))
    flip_a_byte(shards[-1])  # the last one: the second rank's share
    proc = train(tmp_path, tmp_path / "run")
    assert proc.returncode != 0
    said = "\n".join(wattgate_lines(proc))
    assert f"{shards[-1]}: content hash" in said and "the gate verified" in said, proc.stderr[-2000:]
    assert "snakemake reruns pretokenize, pack and gate" in said
    assert not (tmp_path / "run" / "metrics.parquet").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_ranks_share_a_models_chunks_and_the_one_holding_a_changed_byte_names_its_offset(
    tmp_path, monkeypatch, world
):
    import wattgate.train.model_hashes as M

    monkeypatch.setattr(M, "CHUNK_BYTES", 4096)
    folder = tmp_path / "model"
    folder.mkdir()
    rng = np.random.default_rng(0)
    (folder / "model-00001-of-00002.safetensors").write_bytes(rng.bytes(4096 * 5 + 100))  # 6 chunks, a short last
    (folder / "model-00002-of-00002.safetensors").write_bytes(rng.bytes(4096 * 2))
    (folder / "config.json").write_text("{}")
    (folder / "README.md").write_text("not read by a run")
    hashes, read = M.hash_model_folder(folder)
    assert sorted(hashes.files) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert [len(f.chunks) for f in hashes.files.values()] == [1, 6, 2] and read == 4096 * 7 + 100 + 2
    assert all(M.changed_model_files(hashes, r, world) == [] for r in range(world))
    path = folder / "model-00001-of-00002.safetensors"
    raw = bytearray(path.read_bytes())
    raw[4096 * 5 + 7] ^= 0x10  # in the short last chunk
    path.write_bytes(bytes(raw))
    found = {r: M.changed_model_files(hashes, r, world) for r in range(world)}
    assert sum(len(v) for v in found.values()) == 1, found
    assert f"{path}: bytes from offset {4096 * 5} differ" in next(line for v in found.values() for line in v)
    again, read = M.hash_model_folder(folder, hashes)  # the gate again: only the written file is read
    assert (
        read == path.stat().st_size
        and again.files["model-00002-of-00002.safetensors"] == hashes.files["model-00002-of-00002.safetensors"]
    )
    (folder / "extra.safetensors").write_bytes(b"x")
    assert any("extra.safetensors: not there when the gate" in line for line in M.changed_model_files(hashes, 0, world))


def test_a_weight_changed_after_the_gate_stops_the_launch_before_the_first_step(tmp_path):
    model = save_hf_model(tmp_path / "model", seed=3)
    fake_pretokenized(tmp_path / "pretokenized", LENGTHS)
    config = run_config(
        {
            "run_name": "t",
            "train": train_config(**CADENCE),
            "model": {"path": str(model)},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "gate": {"collectives": False},
            "telemetry": {"enabled": False},
            "watcher": {"enabled": False},
        }
    )
    build_plan(config, tmp_path / "pretokenized", tmp_path / "plan")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    args = ["--pretokenized", str(tmp_path / "pretokenized"), "--plan", str(tmp_path / "plan")]
    assert main(["gate", "--config", str(tmp_path / "config.yaml"), *args, "--out", str(tmp_path / "gate")]) == 0
    gated = json.loads((tmp_path / "gate" / "gate.json").read_text())["model_files"]
    assert set(gated["files"]) == {"config.json", "generation_config.json", "model.safetensors"}
    flip_a_byte(model / "model.safetensors")
    launch = [str(BIN / "wattgate"), "launch", "--config", str(tmp_path / "gate" / "config.yaml"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*launch, "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{model / 'model.safetensors'}: bytes from offset 0 differ from what the gate verified" in last, last
    assert "the gate for model.path" in last
    assert json.loads((tmp_path / "run" / "model-hashes.json").read_text())["files"] == gated["files"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_tokenizer_changed_after_pretokenize_stops_every_rank_before_the_first_step(tmp_path, tokenizer_dir):
    import shutil

    tokenizer = shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"document {i} about the quick brown fox"}) + "\n" for i in range(80))
    )
    config = validate_config(
        {
            "run_name": "t",
            "data": {"inputs": [str(corpus)]},
            "tokenizer": {"path": str(tokenizer)},
            "train": train_config(**CADENCE),
            "model": {
                "config": {
                    "model_type": "qwen3",
                    "vocab_size": 600,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 16,
                }
            },
            "cluster": {"nodes": 1, "gpus_per_node": 2},
        }
    )
    pretokenize_and_pack(tmp_path, config)
    (tmp_path / "config-2.yaml").write_text((tmp_path / "config.yaml").read_text())
    (tmp_path / "plan-2").symlink_to(tmp_path / "plan")
    with (tokenizer / "tokenizer.json").open("a") as f:
        f.write(" ")
    proc = train(tmp_path, tmp_path / "run")
    assert proc.returncode != 0
    said = "\n".join(wattgate_lines(proc))
    assert f"{tokenizer}: the tokenizer files changed since pretokenize" in said, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()

"""What trains is what the gate verified: before the first step every rank hashes its share of the shards against
manifest.json's shard_hashes (which the gate checked) and the tokenizer against the manifest's tokenizer_sha256, and
all ranks stop with one line naming the changed file. A byte flipped in a shard after the gate trained silently; a
changed tokenizer was refused only at the export, after every step."""

import os
import shutil
import subprocess

import numpy as np
import yaml

from wattgate.config import validate_config
from wattgate.pack.plan import build_plan

from conftest import CADENCE, make_run, torchrun

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
    assert "rerun pretokenize, pack and gate" in said
    assert not (tmp_path / "run" / "metrics.parquet").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_a_tokenizer_changed_after_pretokenize_stops_the_run_before_the_first_step(tmp_path, tokenizer_dir):
    from wattgate.cli import main
    from wattgate.data.demo_corpus import write_demo_corpus

    tok = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, tok)
    write_demo_corpus(tmp_path / "corpus.jsonl", num_docs=40, seed=3, max_turns=2)
    config = validate_config(
        {
            "run_name": "t",
            "data": {"inputs": [str(tmp_path / "corpus.jsonl")]},
            "tokenizer": {"path": str(tok)},
            "train": dict(CADENCE, seq_len=256, warmup_steps=0),
            "model": {"config": {"model_type": "qwen3", "vocab_size": 600, "hidden_size": 32, "num_hidden_layers": 2,
                                 "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 8}},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
        }
    )  # fmt: skip
    (tmp_path / "config-2.yaml").write_text(yaml.safe_dump(config))
    assert (
        main(["pretokenize", "--config", str(tmp_path / "config-2.yaml"), "--out", str(tmp_path / "pretokenized")]) == 0
    )
    build_plan(config, tmp_path / "pretokenized", tmp_path / "plan-2")
    (tok / "tokenizer_config.json").write_text((tok / "tokenizer_config.json").read_text() + "\n")
    proc = train(tmp_path, tmp_path / "run")
    assert proc.returncode != 0
    said = "\n".join(wattgate_lines(proc))
    assert f"{tok.resolve()}: the tokenizer files changed since pretokenize" in said, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.parquet").exists()

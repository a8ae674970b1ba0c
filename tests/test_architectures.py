"""Each tested architecture goes through the whole chain as a user's own checkpoint would: a local transformers
folder (bf16, random init) -> pretokenize -> pack -> gate (the collective proof on) -> train on 2 gloo ranks ->
export. Then, against transformers itself:

- the validation loss wattgate reports is the exported model's own forward on the held-out documents;
- final/ has the input's tensor names, shapes and dtypes;
- the first step's gradient norm is a single process's on the same documents.

The learning rate is far below bf16's resolution, so the exported bf16 weights are the weights validation scored
(a float32 export after a real step is tested in test_model_objectives.py). The table in docs/architectures.md
is generated from the same matrix (tests/support/architectures.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from support.architectures import ARCHITECTURES, save_tiny_model, tiny_config
from support.runs import pretokenize_and_pack
from support.scoring import reference_grad_norm, scored_by_transformers

from wattgate.cli import main
from wattgate.config import validate_config
from wattgate.data.demo_corpus import write_demo_corpus

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
TRAIN = dict(seq_len=128, micro_batch_size=2, grad_accum=2, max_steps=1, lr=1e-12, warmup_steps=0, log_every=1)


def arch_config(tokenizer: Path, corpus: Path, model: dict) -> dict:
    return validate_config(
        {
            "run_name": "arch",
            "data": {"inputs": [str(corpus)], "validation": {"fraction": 0.2}},
            "tokenizer": {"path": str(tokenizer)},
            "model": model,
            "train": dict(TRAIN, checkpoint_every=1, eval_every=1),
            "cluster": {"nodes": 1, "gpus_per_node": 2},
        }
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_dir):
    """The corpus pretokenized and planned once: the model does not enter either stage."""
    root = tmp_path_factory.mktemp("architectures")
    corpus = root / "corpus.jsonl"
    write_demo_corpus(corpus, num_docs=120, seed=5, max_turns=3)
    pretokenize_and_pack(root, arch_config(tokenizer_dir, corpus, {"config": tiny_config("qwen3")}))
    return root, corpus, tokenizer_dir


def safetensors_layout(folder: Path) -> dict[str, tuple]:
    """name -> (shape, dtype) from the safetensors headers of `folder`."""
    layout = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        layout.update({k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    return layout


def first_step_docs(plan: Path) -> list[int]:
    packs = pq.read_table(plan / "packs.parquet", columns=["epoch", "step", "doc_ids"]).to_pylist()
    return [d for row in packs if row["epoch"] == 0 and row["step"] == 0 for d in row["doc_ids"]]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_the_architecture_trains_on_its_own_objective_and_exports_its_own_layout(prepared, model_type, tmp_path):
    root, corpus, tokenizer = prepared
    model = save_tiny_model(tmp_path / "model", model_type)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(arch_config(tokenizer, corpus, {"path": str(model)})))
    pretokenized, plan = root / "pretokenized", root / "plan"

    t = time.perf_counter()
    argv = ["gate", "--config", str(config), "--pretokenized", str(pretokenized), "--plan", str(plan)]
    assert main([*argv, "--out", str(tmp_path / "gate")]) == 0
    gate_s = time.perf_counter() - t
    checks = {c["name"]: c for c in json.loads((tmp_path / "gate" / "gate.json").read_text())["checks"]}
    assert checks["collectives"]["passed"], checks["collectives"]["detail"]

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "wattgate"]
    cmd += ["train", "--config", str(config), "--pretokenized", str(pretokenized), "--plan", str(plan)]
    cmd += ["--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "run"

    assert safetensors_layout(run / "final") == safetensors_layout(model)
    reported = pq.read_table(run / "eval.parquet").to_pylist()[-1]["loss"]
    own = scored_by_transformers(run / "final", pretokenized)
    norm = pq.read_table(run / "metrics.parquet", columns=["step", "grad_norm"]).to_pylist()[0]
    reference = reference_grad_norm(model, pretokenized, first_step_docs(plan))
    print(
        f"{model_type}: gate {gate_s:.1f} s; validation loss {reported:.9f} vs transformers {own:.9f} "
        f"(rel {abs(reported - own) / own:.1e}); grad norm {norm['grad_norm']:.9f} vs {reference:.9f}"
    )
    assert abs(reported - own) <= RTOL * own
    assert norm["step"] == 1 and abs(norm["grad_norm"] - reference) <= 1e-4 * reference

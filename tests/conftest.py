import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from wattgate.config import validate_config  # noqa: E402
from wattgate.data.demo_corpus import generate  # noqa: E402
from wattgate.data.records import Record  # noqa: E402
from wattgate.data.tokenizer import save_hf_tokenizer, train_bpe, training_texts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def copy_workflow(work: Path) -> Path:
    """A runnable copy of the workflow (Snakefile, rules, schema, config) in `work`."""
    import shutil

    shutil.copy(REPO / "Snakefile", work)
    shutil.copytree(REPO / "workflow", work / "workflow", symlinks=False)
    shutil.copytree(REPO / "config", work / "config")
    return work


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


@pytest.fixture(scope="session")
def demo_docs():
    return generate(num_docs=300, seed=1, max_turns=8)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, demo_docs):
    """A small BPE tokenizer trained on the demo corpus plus some plain text."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    records = [Record("x", messages=d["messages"]) for d in demo_docs]
    texts = list(training_texts(iter(records))) + ["The quick brown fox jumps over the lazy dog."] * 20
    save_hf_tokenizer(train_bpe(texts, vocab_size=600, min_frequency=2), out)
    return out


@pytest.fixture
def make_config():
    def make(**sections):
        config = {"data": {"inputs": ["unused.jsonl"]}, "train": {"seq_len": 256}}
        for key, value in sections.items():
            if isinstance(value, dict):
                config.setdefault(key, {}).update(value)
            else:
                config[key] = value
        return validate_config(config)

    return make


@pytest.fixture
def h200_run(tmp_path):
    """A copy of the recorded H200 run folder (tests/data/h200/train) under tmp_path/results/train/, to edit."""
    import shutil

    run = tmp_path / "results" / "train" / "h200"
    shutil.copytree(REPO / "tests" / "data" / "h200" / "train", run)
    return run

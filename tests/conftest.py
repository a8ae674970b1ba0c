import json
import shutil
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from wattgate.config import run_config  # noqa: E402
from wattgate.data.demo_corpus import generate  # noqa: E402
from wattgate.data.records import CorpusRecord  # noqa: E402
from wattgate.data.tokenizer import save_hf_tokenizer, train_bpe, training_texts  # noqa: E402

# helpers and fixtures the test modules share (tests/support/), taken from here: `from conftest import make_run`
from support.attention import (  # noqa: E402, F401 (reference_flash_kernel is a fixture)
    DOC_LENGTHS,
    PACKS,
    SCHEMA_CHOICES,
    SEQ_LEN,
    reference_flash_attn_func,
    reference_flash_kernel,
)
from support.logs import gpu_rows, write_log  # noqa: E402, F401
from support.models import QWEN3_32B, QWEN3_SETTINGS, TINY, TINY_3_LAYERS, TINY_MODEL, save_hf_model  # noqa: E402, F401
from support.runs import (  # noqa: E402, F401 (proof_run is a fixture)
    assert_resumed_as_straight,
    assert_trained_as,
    CADENCE,
    config_for,
    fake_pretokenized,
    final_params,
    killed_after_first_checkpoint,
    make_run,
    proof_run,
    published_checkpoints,
    run_train,
    steps_and_tokens,
    torchrun,
    train_config,
    with_extra_validation_micro_batch,
    with_micro_batches_changed,
    without_rows,
)
from support.processes import command_line, dead_pid, process_tree  # noqa: E402, F401
from support.tables import set_column  # noqa: E402, F401
from support.workflow import BIN, snakemake  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[1]

# The modules of a minute or more, longest first. `make test` runs two xdist workers, each taking a whole module
# at a time in this order (--dist loadfile --no-loadscope-reorder): started early, the long ones end beside the
# short ones instead of after them. Alone (`pytest` without -n) the order changes nothing: no test depends on it.
LONGEST_MODULES = (
    "test_slurm",
    "test_workflow",
    "test_architectures",
    "test_proof_depths",
    "test_benchmarks",
    "test_resume_resize",
    "test_graceful_stop",
    "test_forecast",
    "test_run_failures",
    "test_train",
    "test_hsdp",
    "test_moe",
    "test_one_document_rows",
    "test_expert_parallel_resume",
    "test_expert_parallel_proof",
    "test_expert_parallel",
    "test_context_parallel",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module keeps its own order


def copy_workflow(work: Path) -> Path:
    """A runnable copy of the workflow (Snakefile, rules, schema, config) in `work`."""
    import shutil

    shutil.copy(REPO / "Snakefile", work)
    shutil.copytree(REPO / "workflow", work / "workflow", symlinks=False)
    shutil.copytree(REPO / "config", work / "config")
    return work


def tokenizer_refusing(tmp_path: Path, tokenizer_dir: Path, condition: str, message: str) -> Path:
    """A copy of the test tokenizer whose chat template raises `message` for a turn `m` where the Jinja
    `condition` holds (a template error: a bad record)."""
    strict = tmp_path / "strict_tok"
    shutil.copytree(tokenizer_dir, strict)
    template = (strict / "chat_template.jinja").read_text()
    (strict / "chat_template.jinja").write_text(
        f"{{%- for m in messages %}}{{%- if {condition} %}}{{{{- raise_exception({message}) }}}}{{%- endif %}}"
        "{%- endfor %}" + template
    )
    return strict


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
    records = [CorpusRecord("x", messages=d["messages"]) for d in demo_docs]
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
        return run_config(config)

    return make


@pytest.fixture
def h200_run(tmp_path):
    """A copy of the recorded H200 run folder (tests/data/h200/train) under tmp_path/results/train/, to edit."""
    import shutil

    run = tmp_path / "results" / "train" / "h200"
    shutil.copytree(REPO / "tests" / "data" / "h200" / "train", run)
    return run


# `wattgate launch` as a real process (its signal handlers, locks, Slurm timer and final verdict) around a stand-in
# job: the gate check is skipped and the run identity is empty (there is no plan to gate or to identify the run by),
# and the job is the argv given.
_FAKE_LAUNCH = """
import json, sys
import wattgate.train.launch as launch
from wattgate.records.checkpoint import RunIdentity
job = json.loads(sys.argv[1])
launch.check_gate_marker = lambda *a, **k: None
launch.this_run_identity = lambda *a, **k: (RunIdentity(), None)
launch.build_launch_command = lambda *a, **k: job
from wattgate.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture
def fake_launch(tmp_path, make_config):
    """start(job_argv, out, env=None, **config_sections) -> the `wattgate launch` Popen (text pipes)."""
    import subprocess
    import sys

    import yaml

    def start(job, out, env=None, **sections):
        config = tmp_path / "launch-config.yaml"
        config.write_text(yaml.safe_dump(make_config(**sections).to_json()))
        for name in ("pretokenized", "plan"):
            (tmp_path / name).mkdir(exist_ok=True)
        argv = ["launch", "--config", str(config), "--pretokenized", str(tmp_path / "pretokenized")]
        argv += ["--plan", str(tmp_path / "plan"), "--run-dir", str(out)]
        return subprocess.Popen(
            [sys.executable, "-c", _FAKE_LAUNCH, json.dumps(job), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **(env or {})),
        )

    return start


def _wait_until(condition, timeout_s: float = 60.0, what: str = "condition"):
    """Poll `condition` until it returns a true value (returned) or the deadline passes (AssertionError)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not met within {timeout_s:.0f} s"
        time.sleep(0.05)


def _catches(pid: int, *signals) -> bool:
    """Whether process `pid` has handlers for all `signals` (SigCgt in /proc/<pid>/status): a signal sent before
    they exist would take its default action."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return all(mask >> (int(s) - 1) & 1 for s in signals)


@pytest.fixture
def wait_until():
    """wait_until(condition, timeout_s=60, what=...): poll with a deadline, never a fixed sleep."""
    return _wait_until


@pytest.fixture
def catches():
    """catches(pid, *signals): whether the process has handlers for them (wait for this before signalling)."""
    return _catches

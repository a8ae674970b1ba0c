"""CPU training runs for the tests: synthetic pretokenized shards, a plan and a config file for a tiny Qwen3,
the `wattgate train` command under torchrun on gloo ranks, and the plan edits the guards must catch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support.models import TINY
from wattgate.records.run_config import RunConfig

# one epoch of ~13 steps, one micro-batch each: a log at step 1 and the last, validation and a checkpoint every 5
# and at the end; activation checkpointing off (it only repeats forward ops): four classes, a few seconds a proof
CADENCE = dict(
    micro_batch_size=2,
    grad_accum=1,
    epochs=1,
    checkpoint_every=5,
    eval_every=5,
    log_every=100,
    activation_checkpointing=False,
)


def fake_pretokenized(path: Path, lengths, seed=0, vocab=96, validation_fraction=0.0, sources=None) -> Path:
    """`sources`: (name, documents) in order (a mixture's sources); None: one source."""
    from wattgate.data.synthetic import write_random_pretokenized

    # several shards and row groups even for small corpora
    return write_random_pretokenized(
        path, lengths, vocab, seed, shard_docs=7, validation_fraction=validation_fraction, sources=sources
    )


def train_config(**train) -> dict:
    base = {
        "seq_len": 64,
        "micro_batch_size": 1,
        "grad_accum": 2,
        "epochs": 1,
        "warmup_steps": 0,
        "checkpoint_every": 100,
        "lr": 1e-2,
        "log_every": 1,
    }
    base.update(train)
    return base


def make_run(
    tmp: Path, lengths, gpus: int, seed=0, validation_fraction=0.0, mixture=None, **train
) -> tuple[Path, RunConfig]:
    """Pretokenized data + plan + config file for a CPU run with `gpus` ranks. `mixture`: data.inputs mappings
    (`name` and a share each); the documents split over them in order by each one's `docs`."""
    import yaml

    from wattgate.config import run_config
    from wattgate.pack.plan import build_plan

    pretok = tmp / "pretokenized"
    sources = [(m["name"], m["docs"]) for m in mixture] if mixture else None
    mixture = [{k: v for k, v in m.items() if k != "docs"} for m in mixture] if mixture else None
    if not pretok.exists():
        fake_pretokenized(pretok, lengths, seed, validation_fraction=validation_fraction, sources=sources)
    data = {"data": {"inputs": mixture}} if mixture else {}
    config = run_config(
        {
            "run_name": "t",
            "train": train_config(**train),
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": gpus},
            **data,
        }
    )
    plan = tmp / f"plan-{gpus}"
    build_plan(config, pretok, plan)
    (tmp / f"config-{gpus}.yaml").write_text(yaml.safe_dump(config.to_json()))
    return plan, config


def with_sections(tmp: Path, gpus: int, **sections) -> None:
    """make_run's config-{gpus}.yaml with these top-level sections replaced (parallel, model, ...): the same plan
    trained another way."""
    import yaml

    path = tmp / f"config-{gpus}.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(path.read_text()) | sections))


def torchrun(tmp: Path, gpus: int, out: Path, **popen) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        "-m",
        "wattgate",
        "train",
        "--config",
        str(tmp / f"config-{gpus}.yaml"),
        "--pretokenized",
        str(tmp / "pretokenized"),
        "--plan",
        str(tmp / f"plan-{gpus}"),
        "--run-dir",
        str(out),
    ]


def run_train(tmp: Path, gpus: int, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun(tmp, gpus, out), capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def final_params(out: Path) -> dict:
    """Every tensor of the run's final/ export, by name."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "final").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def proof_run(tmp_path_factory):
    """The collective proof tests' plan: (pretokenized, plan, config) of 2 ranks at CADENCE, with validation;
    made once per test module."""
    tmp = tmp_path_factory.mktemp("proof")
    lengths = np.random.default_rng(3).integers(5, 60, 120).tolist()
    plan, config = make_run(tmp, lengths, gpus=2, validation_fraction=0.1, **CADENCE)
    return tmp / "pretokenized", plan, config


def config_for(gpus: int, remainder: str = "rebin", **train) -> RunConfig:
    """The resize tests' config: TINY on `gpus` ranks, two epochs, a checkpoint every step."""
    from wattgate.config import run_config

    t = {"seq_len": 64, "micro_batch_size": 1, "grad_accum": 2, "epochs": 2, "warmup_steps": 0, "lr": 1e-2}
    return run_config(
        {
            "run_name": "t",
            "train": t | {"checkpoint_every": 1} | train,
            "pack": {"remainder": remainder},
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": gpus},
        }
    )


def with_extra_validation_micro_batch(plan_dir, rank: int) -> None:
    """A planner bug on purpose: `rank` runs one more validation micro-batch (a copy of its first pack), and
    plan.json is made to agree, so only the gate's validation_steps (turned off here) would see it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from wattgate.artifacts import sha256_file
    from wattgate.run_files import EVAL_PACKS

    path = plan_dir / EVAL_PACKS
    rows = pq.read_table(path).to_pylist()
    extra = dict(next(r for r in rows if r["rank"] == rank), micro=max(r["micro"] for r in rows) + 1)
    pq.write_table(pa.Table.from_pylist(rows + [extra], schema=pq.read_schema(path)), path)
    plan = json.loads((plan_dir / "plan.json").read_text())
    plan["validation"]["packs_sha256"] = sha256_file(path)
    (plan_dir / "plan.json").write_text(json.dumps(plan))


def without_rows(packs, rows):
    """The gate's loaded packs (gate.inputs) with the rows at `rows` removed, offsets recomputed."""
    import dataclasses

    keep = np.ones(len(packs), dtype=bool)
    keep[rows] = False
    entry_keep = np.repeat(keep, packs.docs_per_row)
    offsets = np.concatenate(([0], np.cumsum(packs.docs_per_row[keep])))
    return dataclasses.replace(
        packs,
        **{f: getattr(packs, f)[keep] for f in ("epoch", "step", "micro", "rank", "slot", "num_tokens")},
        doc_ids=packs.doc_ids[entry_keep],
        doc_lengths=packs.doc_lengths[entry_keep],
        offsets=offsets,
        length_offsets=offsets,
    )


def with_micro_batches_changed(plan_dir, rank: int, step: int, more: bool) -> None:
    """A planner bug on purpose: `rank` gets one micro-batch more (a copy of its first pack) or fewer (its last one
    dropped) in `step` of epoch 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = plan_dir / "packs.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()

    def here(r) -> bool:
        return r["rank"] == rank and r["epoch"] == 0 and r["step"] == step

    last = max(r["micro"] for r in rows if here(r))
    if more:
        rows.append(dict(next(r for r in rows if here(r)), micro=last + 1, slot=0))
    else:
        rows = [r for r in rows if not (here(r) and r["micro"] == last)]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


def pretokenize_and_pack(root: Path, config: dict) -> None:
    """`config` written to root/config.yaml, then the CLI's pretokenize and pack into root/pretokenized and
    root/plan (a module's corpus prepared once, for stages the model does not enter)."""
    import yaml

    from wattgate.cli import main

    (root / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["pretokenize", "--config", str(root / "config.yaml"), "--out", str(root / "pretokenized")]) == 0
    argv = ["pack", "--config", str(root / "config.yaml"), "--pretokenized", str(root / "pretokenized")]
    assert main([*argv, "--out", str(root / "plan")]) == 0


def published_checkpoints(out: Path) -> list[Path]:
    """The run's published checkpoints: step-<n>/ after its rename, never the step-<n>.tmp/ being written."""
    return [p for p in out.glob("checkpoints/step-*/state.json") if re.fullmatch(r"step-\d+", p.parent.name)]


def killed_after_first_checkpoint(tmp: Path, gpus: int, out: Path) -> None:
    """`wattgate train` on `gpus` ranks killed (the whole job, no clean shutdown) once its first checkpoint is
    published."""
    job = subprocess.Popen(
        torchrun(tmp, gpus, out),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not published_checkpoints(out):
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint published"
        time.sleep(0.01)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert not (out / "TRAINED").exists()


def steps_and_tokens(out: Path) -> list[dict]:
    """Every (step, rank, tokens) row of the run's metrics, in one order: what a run saw of the data."""
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "metrics.parquet", columns=["step", "rank", "tokens"]).to_pylist()
    return sorted(rows, key=str)


def assert_resumed_as_straight(out: Path, straight: Path, param_tolerance: float) -> dict:
    """A run resumed under another layout trained as the uninterrupted one: every step once on every rank with the
    plan's tokens (the data seen exactly once), the same losses (1e-4), and final/ the same float32 tensors by name
    (within `param_tolerance`); returns final/'s tensors."""
    import pyarrow.parquet as pq
    import torch

    assert steps_and_tokens(out) == steps_and_tokens(straight)
    a = pq.read_table(straight / "metrics.parquet", columns=["step", "rank", "loss"]).to_pandas()
    b = pq.read_table(out / "metrics.parquet", columns=["step", "rank", "loss"]).to_pandas()
    merged = a.merge(b, on=["step", "rank"])
    assert len(merged) == len(a) and np.allclose(merged["loss_x"], merged["loss_y"], atol=1e-4)
    before, after = final_params(straight), final_params(out)
    assert before.keys() == after.keys()
    assert max((before[k] - after[k]).abs().max().item() for k in before) < param_tolerance
    assert all(after[k].dtype == torch.float32 for k in after)
    return after


# Another mesh sums the same gradients in another order (fp32 on gloo): the first step's losses are the same
# forward (bit-equal but for the all-gathered weights, which are exact copies) and its gradient norm differs by
# reduction order only, ~1e-7 relative; after 8+ Adam steps the held-out loss moves within 1e-4 relative.
FIRST_STEP_RTOL, VALIDATION_RTOL = 1e-6, 1e-4
# final/ loaded by transformers and scored document by document against what the run reported (as the
# architecture matrix checks): the same weights, one forward per document instead of packed rows
SCORED_RTOL = 1e-5


def assert_trained_as(out: Path, reference: Path, pretokenized: Path) -> dict:
    """A run on another mesh trained as `reference` (the 1-D run on the same inputs): the first step's losses and
    gradient norm, the last validation loss after 8+ steps, and final/ scored by transformers' own forward equal
    to the validation loss the run reported. Returns the figures (for the test's log)."""
    import pyarrow.parquet as pq

    from support.scoring import scored_by_transformers

    def first_step(run: Path) -> list[dict]:
        rows = pq.read_table(run / "metrics.parquet", columns=["step", "rank", "loss", "grad_norm"]).to_pylist()
        return sorted((r for r in rows if r["step"] == 1), key=lambda r: r["rank"])

    def last_validation(run: Path) -> dict:
        return pq.read_table(run / "eval.parquet", columns=["step", "loss"]).to_pylist()[-1]

    mine, theirs = first_step(out), first_step(reference)
    assert [r["rank"] for r in mine] == [r["rank"] for r in theirs] and mine
    for a, b in zip(mine, theirs):
        assert abs(a["loss"] - b["loss"]) <= FIRST_STEP_RTOL * abs(b["loss"]), (mine, theirs)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= FIRST_STEP_RTOL * b["grad_norm"], (mine, theirs)
    val, ref_val = last_validation(out), last_validation(reference)
    assert val["step"] == ref_val["step"] >= 8
    assert abs(val["loss"] - ref_val["loss"]) <= VALIDATION_RTOL * ref_val["loss"], (val, ref_val)
    scored = scored_by_transformers(out / "final", pretokenized)
    assert abs(scored - val["loss"]) <= SCORED_RTOL * scored, (scored, val)
    return {
        "grad_norm_rel": abs(mine[0]["grad_norm"] - theirs[0]["grad_norm"]) / theirs[0]["grad_norm"],
        "validation_rel": abs(val["loss"] - ref_val["loss"]) / ref_val["loss"],
        "scored_rel": abs(scored - val["loss"]) / scored,
        "steps": val["step"],
    }

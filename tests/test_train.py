"""Train stage: packed attention equals separate documents, loss normalization across layouts,
bitwise resume after kill -9, checkpoint validation, export, heartbeats and metrics."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from wattgate.artifacts import write_json_atomic
from wattgate.cadence import checkpoint_steps
from wattgate.train.checkpoint import file_hash, latest_complete
from wattgate.train.data import IGNORE, DocStore, build_batch, read_rank_plan
from wattgate.train.model import build_unsharded_model

from conftest import TINY, fake_pretokenized, final_params, make_run, published_checkpoints, run_train, torchrun


# ---------------------------------------------------------------- packing: attention stays in documents


def test_labels_and_positions_of_a_pack(tmp_path):
    pretok = fake_pretokenized(tmp_path / "p", [5, 4])
    store = DocStore(pretok)
    batch = build_batch(store, [np.array([0, 1])], seq_len=12)
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert batch.labels[0, 0] == IGNORE and batch.labels[0, 5] == IGNORE  # each document's first token
    assert (batch.labels[0, 9:] == IGNORE).all()  # padding
    for d, start in ((0, 0), (1, 5)):
        ids, mask = store.get(d)
        expect = np.where(mask.astype(bool), ids, IGNORE)
        expect[0] = IGNORE
        assert batch.labels[0, start : start + len(ids)].tolist() == expect.tolist()
    assert batch.num_tokens == 9 and batch.num_loss_tokens == int((batch.labels != IGNORE).sum())


def test_rank_reads_only_its_rows_in_order(tmp_path):
    plan, _ = make_run(tmp_path, [20] * 40, gpus=2, micro_batch_size=2, grad_accum=2, epochs=2)
    rows = pq.read_table(plan / "packs.parquet").to_pandas()
    for rank in (0, 1):
        mine = read_rank_plan(plan, rank)
        keys = [(m.epoch, m.step, m.micro) for m in mine]
        assert keys == sorted(keys) and all(len(m.packs) == 2 for m in mine)
        assert sum(len(m.packs) for m in mine) == int((rows["rank"] == rank).sum())


# ---------------------------------------------------------------- loss normalization across layouts


@pytest.mark.slow
def test_one_step_same_parameters_world1_ga2_and_world2_ga1(tmp_path):
    # 4 documents that pack into exactly 2 packs of different loss-token counts: one global batch
    lengths = [40, 20, 30, 30]
    kw = dict(
        optimizer="sgd", lr=1.0, grad_clip=1e9, weight_decay=0.0, epochs=1, micro_batch_size=1, export_dtype="float32"
    )
    make_run(tmp_path, lengths, gpus=1, grad_accum=2, **kw)
    make_run(tmp_path, lengths, gpus=2, grad_accum=1, **kw)
    run_train(tmp_path, 1, tmp_path / "w1")
    run_train(tmp_path, 2, tmp_path / "w2")
    a, b = final_params(tmp_path / "w1"), final_params(tmp_path / "w2")
    init = build_unsharded_model({"config": TINY}, "sdpa", seed=0).state_dict()
    moved = max((a[k] - init[k]).abs().max().item() for k in a)
    assert moved > 1e-3  # the step really changed the weights
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


# ---------------------------------------------------------------- checkpoint, kill -9, resume


@pytest.mark.slow
def test_kill_and_resume_is_bitwise_identical(tmp_path):
    lengths = np.random.default_rng(1).integers(5, 60, 400).tolist()
    make_run(
        tmp_path,
        lengths,
        gpus=2,
        grad_accum=2,
        epochs=2,
        checkpoint_every=3,
        checkpoint_keep=2,
        validation_fraction=0.1,
        eval_every=4,
    )
    straight = tmp_path / "straight"
    run_train(tmp_path, 2, straight)
    total = json.loads((straight / "TRAINED").read_text())["steps"]
    assert total >= 40

    killed = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        torchrun(tmp_path, 2, killed),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while not published_checkpoints(killed):
        assert job.poll() is None and time.time() < deadline, "no checkpoint published"
        time.sleep(0.005)
    os.killpg(job.pid, signal.SIGKILL)  # the whole job: launcher and every rank
    job.wait()
    assert not (killed / "TRAINED").exists()

    proc = run_train(tmp_path, 2, killed)
    summary = json.loads((killed / "TRAINED").read_text())
    assert 3 <= summary["resumed_from_step"] < total, proc.stdout
    cols = ["step", "rank", "loss", "tokens"]
    a = pq.read_table(straight / "metrics.parquet", columns=cols).to_pylist()
    b = pq.read_table(killed / "metrics.parquet", columns=cols).to_pylist()
    assert a == b  # every step once, same losses to the last bit
    # validation on the same schedule (every 4 steps, each epoch end, the last step), no pass twice, same losses
    cols = ["step", "epoch", "loss", "perplexity", "tokens"]
    ea = pq.read_table(straight / "eval.parquet", columns=cols).to_pylist()
    eb = pq.read_table(killed / "eval.parquet", columns=cols).to_pylist()
    assert ea == eb and len({r["step"] for r in eb}) == len(eb)
    assert [r["step"] for r in ea] == sorted({*range(4, total + 1, 4), total // 2, total})
    assert summary["validation"]["final_step"] == total and summary["validation"]["evaluations"] == len(eb)
    pa_, pb = final_params(straight), final_params(killed)
    assert all(torch.equal(pa_[k], pb[k]) for k in pa_)

    # contracts the watcher and the report read
    hb = json.loads((killed / "heartbeat/rank-1.json").read_text())
    assert hb["step"] == total and hb["phase"] == "done" and hb["rank"] == 1
    assert {"step", "rank", "loss", "tokens", "step_time_s", "data_wait_s", "time"} <= set(
        pq.read_schema(killed / "metrics.parquet").names
    )
    # the newest checkpoint_keep, and (train.keep_best) the one with the best validation loss among those taken
    # at a step that ran validation
    ckpts = checkpoint_steps(total, 3, [total // 2, total], True)
    scored = [r for r in eb if r["step"] in ckpts]
    best = min(scored, key=lambda r: (r["loss"], -r["step"]))["step"]
    kept = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert kept == sorted({f"step-{n}" for n in (*ckpts[-2:], best)})

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(killed / "final"), local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_incomplete_checkpoint_is_skipped_with_a_warning(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (3, 6):
        d = root / f"step-{step}"
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x" * 10)
        (d / ".metadata").write_bytes(b"m")
        files = {
            name: {"bytes": (d / name).stat().st_size, "hash": file_hash(d / name)}
            for name in ("__0_0.distcp", ".metadata")
        }
        write_json_atomic(d / "state.json", {"step": step, "files": files, "hash_algorithm": "xxh3_128"})
    (root / "step-9.tmp").mkdir()  # an interrupted save: never a candidate
    assert latest_complete(root).name == "step-6"
    (root / "step-6" / "__0_0.distcp").unlink()
    assert latest_complete(root).name == "step-3"
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "missing __0_0.distcp" in err
    (root / "step-3" / ".metadata").write_bytes(b"")  # truncated
    assert latest_complete(root) is None


@pytest.mark.slow
def test_local_data_cache_and_activation_checkpointing_train_the_same(tmp_path):
    lengths = np.random.default_rng(2).integers(5, 60, 60).tolist()
    make_run(tmp_path, lengths, gpus=1, grad_accum=2, epochs=1)
    run_train(tmp_path, 1, tmp_path / "shared")
    scratch = tmp_path / "scratch"
    make_run(
        tmp_path,
        lengths,
        gpus=1,
        grad_accum=2,
        epochs=1,
        data_cache="local",
        local_cache_dir=str(scratch),
        activation_checkpointing=True,
    )
    proc = run_train(tmp_path, 1, tmp_path / "local")
    summary = json.loads((tmp_path / "local/TRAINED").read_text())
    assert summary["data_cache"] == "local" and summary["data_copy_s"] >= 0 and summary["tokens_per_s"] > 0
    assert "data_cache local (copy" in proc.stdout
    copies = list(scratch.glob("wattgate-*/manifest.json"))
    assert len(copies) == 1
    a = pq.read_table(tmp_path / "shared/metrics.parquet").to_pandas()
    b = pq.read_table(tmp_path / "local/metrics.parquet").to_pandas()
    assert a["step"].tolist() == b["step"].tolist()
    assert np.allclose(a["loss"], b["loss"], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- export: dtype, values, kill and rerun


def trained_params(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The fp32 model parameters of a DCP checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dest = checkpoint.parent.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(dest))
    state = torch.load(dest, weights_only=False)["model"]
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in state.items()}


def set_tokenizer_dir(tmp: Path, tokenizer: Path, plan: Path, config: dict) -> None:
    """The synthetic data's manifest names `tokenizer` and its hash, as pretokenize's does (the export checks it),
    and the plan is made again from it (a job refuses a manifest other than the one its plan was made from)."""
    from wattgate.data.tokenizer import tokenizer_sha256
    from wattgate.pack.plan import build_plan

    manifest = tmp / "pretokenized/manifest.json"
    record = dict(
        json.loads(manifest.read_text()), tokenizer_path=str(tokenizer), tokenizer_sha256=tokenizer_sha256(tokenizer)
    )
    write_json_atomic(manifest, record)
    build_plan(config, tmp / "pretokenized", plan)


@pytest.mark.slow
def test_export_is_the_trained_model_in_bf16_and_a_killed_export_reruns(tmp_path):
    lengths = np.random.default_rng(3).integers(5, 60, 60).tolist()
    plan, config = make_run(tmp_path, lengths, gpus=2, epochs=1, export_max_shard_gib=1e-5)  # a file per tensor or two
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"model": "stand-in tokenizer file"}')
    set_tokenizer_dir(tmp_path, tokenizer, plan, config)
    straight = tmp_path / "straight"
    run_train(tmp_path, 2, straight)
    summary = json.loads((straight / "TRAINED").read_text())
    final = straight / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in final.glob("*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values())) and len(shards) > 2
    assert (final / "tokenizer.json").read_text() == (tokenizer / "tokenizer.json").read_text()

    # the values are the trained fp32 parameters (the last checkpoint) cast to bf16
    exported = final_params(straight)
    trained = trained_params(straight / "checkpoints" / f"step-{summary['steps']}")
    assert set(exported) == set(trained)
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], trained[k].bfloat16()) for k in trained)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    assert model.dtype == torch.bfloat16

    # TRAINED: every rank's memory per phase, load and export times
    assert summary["export_dtype"] == "bfloat16" and summary["load_s"] > 0 and summary["export_s"] > 0
    ranks = summary["memory"]["per_rank"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(set(r["phases"]) == {"load", "steady", "export"} for r in ranks)
    assert all(p["host_peak_gib"] >= p["host_at_start_gib"] > 0 for r in ranks for p in r["phases"].values())

    # kill during the export: once the ranks have checked the tokenizer (before the first step) its file becomes a
    # FIFO, so rank 0 blocks copying it after every shard is written, with final.tmp/ complete but unpublished. A
    # deterministic point inside the export. (the manifest is left as it is: it is part of the run identity, so
    # editing it would start anew)
    killed = tmp_path / "killed"
    content = (tokenizer / "tokenizer.json").read_text()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        torchrun(tmp_path, 2, killed),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while heartbeat_phase(killed, 0) not in ("train", "eval", "checkpoint", "export"):
        assert job.poll() is None and time.time() < deadline, "the run never reached its first step"
        time.sleep(0.02)
    (tokenizer / "tokenizer.json").unlink()
    os.mkfifo(tokenizer / "tokenizer.json")
    while not (killed / "final.tmp" / "config.json").exists():
        assert job.poll() is None and time.time() < deadline, "the export never reached the tokenizer copy"
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert not (killed / "final").exists() and not (killed / "TRAINED").exists()
    assert len(list((killed / "final.tmp").glob("*.safetensors"))) == len(shards)

    (tokenizer / "tokenizer.json").unlink()
    (tokenizer / "tokenizer.json").write_text(content)
    proc = run_train(tmp_path, 2, killed)
    assert json.loads((killed / "TRAINED").read_text())["resumed_from_step"] == summary["steps"], proc.stdout
    assert not (killed / "final.tmp").exists()
    assert sorted(p.name for p in (killed / "final").iterdir()) == sorted(p.name for p in final.iterdir())
    for p in final.iterdir():  # byte for byte the uninterrupted run's export
        assert (killed / "final" / p.name).read_bytes() == p.read_bytes(), p.name


def heartbeat_phase(run, rank: int) -> str | None:
    try:
        return json.loads((run / "heartbeat" / f"rank-{rank}.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None

"""How stages publish outputs (issue 13): the pack pair as one set, stale temporaries of killed writers, file
modes, strict JSON. What an --out may replace is the output guard (test_output_guard.py)."""

import json
import os
import socket
import stat
import time

import pytest

from wattgate import artifacts
from wattgate.artifacts import (
    atomic_dir,
    atomic_path,
    canonical_json,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)

from conftest import dead_pid, write_jsonl

OUTPUT_MARKER = getattr(artifacts, "OUTPUT_MARKER", ".wattgate-output")


def host():
    import re

    return (re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host")[:48]


# --- pack publishes plan.json and packs.parquet as one set ---------------------------------------


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory, tokenizer_dir, demo_docs):
    from wattgate.config import run_config
    from wattgate.data.pretokenize import pretokenize

    work = tmp_path_factory.mktemp("outputs")
    config = run_config(
        {"data": {"inputs": [str(write_jsonl(work / "c.jsonl", demo_docs))]}, "train": {"seq_len": 256}}
    )
    pretokenize(config, tokenizer_dir, work / "pretokenized", progress=False)
    return work / "pretokenized"


def plan_config(seed):
    from wattgate.config import run_config

    return run_config(
        {
            "data": {"inputs": ["unused.jsonl"]},
            "train": {"seq_len": 256, "micro_batch_size": 2, "grad_accum": 2, "epochs": 1},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "pack": {"seed": seed},
        }
    )


@pytest.mark.parametrize("killed_at", ["packs.parquet", "plan.json"])
def test_pack_killed_between_renames_never_leaves_a_mixed_pair(tmp_path, pretokenized, monkeypatch, killed_at):
    from wattgate.pack.plan import build_plan

    out = tmp_path / "plan"
    build_plan(plan_config(1), pretokenized, out)
    (out / "pack.log").write_text("snakemake's log of this run\n")  # not pack's: kept
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == killed_at:
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        build_plan(plan_config(2), pretokenized, out)
    monkeypatch.setattr(os, "replace", real_replace)
    if (out / "plan.json").exists():  # a plan.json on disk always describes the packs beside it
        assert json.loads((out / "plan.json").read_text())["packs_sha256"] == sha256_file(out / "packs.parquet")
    assert (out / "pack.log").exists()
    plan = build_plan(plan_config(2), pretokenized, out)  # a rerun completes the set
    assert plan.packs_sha256 == sha256_file(out / "packs.parquet")
    assert json.loads((out / "plan.json").read_text()) == plan.to_json()
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "history", "pack.log", "packs.parquet", "plan.json"]
    # every published plan is kept by its hash (pack/segments.py: a resized run continues from it)
    kept = out / "history" / plan.packs_sha256[:16]
    assert sha256_file(kept / "packs.parquet") == plan.packs_sha256
    assert (kept / "plan.json").read_bytes() == (out / "plan.json").read_bytes()


# --- stale temporaries of killed writers are swept -------------------------------------------


def test_publishing_sweeps_temps_of_dead_writers_and_keeps_live_ones(tmp_path):
    dead, live = dead_pid(), os.getpid()
    old = time.time() - 2 * 3600
    stale = [
        tmp_path / f".out.{dead}@{host()}.abcd1234.tmp",
        tmp_path / f".out.{dead}@{host()}.efgh5678.old",
        tmp_path / ".out.legacy12.tmp",
        tmp_path / f".out.{live}@other-node.oldtemp1.tmp",
    ]
    kept = [
        tmp_path / f".out.{live}@{host()}.live1234.tmp",  # a live writer on this host
        tmp_path / f".out.{dead}@other-node.fresh123.tmp",  # another host, recently touched
        tmp_path / ".out.legacy99.tmp",  # no pid, recently touched
        tmp_path / f".outer.{dead}@{host()}.abcd1234.tmp",  # another destination's temp
        tmp_path / "notes.tmp",
    ]
    for p in stale[:2] + kept[:3]:
        p.mkdir()
        (p / "x").write_text("partial")
    for p in stale[2:] + kept[3:]:
        p.write_text("partial")
    for p in stale[2:]:
        os.utime(p, (old, old))
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("1")
    assert [p for p in stale if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    # atomic_path sweeps beside files the same way
    leftover = tmp_path / f".f.json.{dead}@{host()}.zzzz9999.tmp"
    leftover.write_text("{")
    write_json_atomic(tmp_path / "f.json", {"a": 1})
    assert not leftover.exists()


def test_temp_names_carry_pid_and_host(tmp_path):
    with atomic_path(tmp_path / "f.bin") as tmp:
        assert tmp.name.startswith(f".f.bin.{os.getpid()}@{host()}.") and tmp.name.endswith(".tmp")
        tmp.write_bytes(b"1")


# --- files and folders follow the umask ---------------------------------------------------------


def test_outputs_are_created_with_the_umask(tmp_path, monkeypatch):
    monkeypatch.setattr(artifacts, "UMASK", 0o002, raising=False)
    write_bytes_atomic(tmp_path / "f.bin", b"1")
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "g").write_text("2")
    assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == 0o664
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o775
    assert stat.S_IMODE((tmp_path / "d" / OUTPUT_MARKER).stat().st_mode) == 0o664


def test_umask_is_read_from_the_process():
    mask = os.umask(0)
    os.umask(mask)
    assert artifacts.UMASK == mask


# --- strict JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_json_outputs_are_strict(tmp_path, bad):
    with pytest.raises(ValueError, match=r"\$\['stats'\]\['x'\]\[1\]"):
        canonical_json({"stats": {"x": [1.0, bad]}})
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "f.json", {"a": bad})
    assert list(tmp_path.iterdir()) == []
    write_json_atomic(tmp_path / "f.json", {"a": bad, "b": [1.5]}, nonfinite="null")  # a writer's deliberate choice
    assert json.loads((tmp_path / "f.json").read_text()) == {"a": None, "b": [1.5]}

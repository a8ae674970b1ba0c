"""How stages publish outputs (issue 13): what `--out` may replace, the pack pair as one set,
stale temporaries of killed writers, file modes, strict JSON."""

import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from wattgate import artifacts
from wattgate.artifacts import (
    atomic_dir,
    atomic_path,
    canonical_json,
    sha256_file,
    sha256_tree,
    write_bytes_atomic,
    write_json_atomic,
)
from wattgate.cli import main
from wattgate.errors import InputError

from conftest import write_jsonl

OUTPUT_MARKER = getattr(artifacts, "OUTPUT_MARKER", ".wattgate-output")


def host():
    import re

    return (re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host")[:48]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- item 7: --out never deletes what wattgate did not write -----------------------------------


def test_out_refuses_a_folder_wattgate_did_not_write(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.jsonl").write_text('{"text": "precious"}\n')
    with pytest.raises(InputError) as exc:
        with atomic_dir(data) as tmp:
            (tmp / "manifest.json").write_text("{}")
    message = str(exc.value)
    assert str(data) in message and "\n" not in message
    assert "empty or new folder" in message and "remove it yourself" in message
    assert (data / "corpus.jsonl").read_text() == '{"text": "precious"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no temp left behind


def test_out_refuses_a_file(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("x\n")
    with pytest.raises(InputError):
        with atomic_dir(corpus):
            pass
    assert corpus.read_text() == "x\n"


def test_pretokenize_out_at_the_corpus_folder_keeps_the_corpus(tmp_path, tokenizer_dir, demo_docs):
    (tmp_path / "corpus").mkdir()
    corpus = write_jsonl(tmp_path / "corpus" / "c.jsonl", demo_docs[:20])
    before = corpus.read_bytes()
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"data": {"inputs": [str(corpus)]}, "train": {"seq_len": 256}}))
    rc = main(["pretokenize", "--config", str(config), "--tokenizer", str(tokenizer_dir), "--out", str(corpus.parent)])
    assert rc == 2
    assert corpus.read_bytes() == before


def test_out_replaces_its_own_output_and_accepts_an_empty_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # empty: fine
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker["written_by"] == "wattgate" and marker["format_version"] == 1
    assert marker["stage"] == "test_output_publishing"  # the calling module
    with atomic_dir(out) as tmp:  # its own previous output: replaced
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == sorted([OUTPUT_MARKER, "b.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # another stage's output (a run folder's checkpoints, a pretokenized corpus) is never replaced
    with pytest.raises(InputError, match="output exists and is the output of wattgate test_output_publishing"):
        with atomic_dir(out, stage="pretokenize") as tmp:
            (tmp / "c.txt").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == sorted([OUTPUT_MARKER, "b.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_marker_is_invisible_to_folder_hashes_and_reruns_are_byte_identical(tmp_path):
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    (by_hand / "shard.bin").write_bytes(b"abc")
    for name in ("one", "two"):
        with atomic_dir(tmp_path / name, stage="pretokenize") as tmp:
            (tmp / "shard.bin").write_bytes(b"abc")
    assert (tmp_path / "one" / OUTPUT_MARKER).read_bytes() == (tmp_path / "two" / OUTPUT_MARKER).read_bytes()
    assert sha256_tree([tmp_path / "one"]) == sha256_tree([tmp_path / "two"]) == sha256_tree([by_hand])


# --- item 10: pack publishes plan.json and packs.parquet as one set ---------------------------


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory, tokenizer_dir, demo_docs):
    from wattgate.config import validate_config
    from wattgate.data.pretokenize import pretokenize

    work = tmp_path_factory.mktemp("outputs")
    config = validate_config(
        {"data": {"inputs": [str(write_jsonl(work / "c.jsonl", demo_docs))]}, "train": {"seq_len": 256}}
    )
    pretokenize(config, tokenizer_dir, work / "pretokenized", progress=False)
    return work / "pretokenized"


def plan_config(seed):
    from wattgate.config import validate_config

    return validate_config(
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
    assert plan["packs_sha256"] == sha256_file(out / "packs.parquet")
    assert json.loads((out / "plan.json").read_text()) == plan
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "history", "pack.log", "packs.parquet", "plan.json"]
    # every published plan is kept by its hash (pack/segments.py: a resized run continues from it)
    kept = out / "history" / plan["packs_sha256"][:16]
    assert sha256_file(kept / "packs.parquet") == plan["packs_sha256"]
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

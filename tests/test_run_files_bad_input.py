"""Hand-edited run files the gate reads: plan.json's shape and format_version, packs.parquet's column types and
list lengths, the shards' token ids and loss masks, and the manifest's format_version and max_token_id; a gate
stopped by any of them writes nothing in --out and leaves no earlier verdict there."""

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan
from wattgate.run_files import read_manifest, read_marker_hashes, read_packs, read_plan

from conftest import TINY_MODEL

MODEL = TINY_MODEL | {"vocab_size": 1024}  # the gate tests' tiny Qwen3, with room for the synthetic ids


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Synthetic shards and a plan from them, made once; tests edit copies."""
    root = tmp_path_factory.mktemp("made")
    lengths = np.random.default_rng(2).integers(5, 60, 40)
    pretok = write_random_pretokenized(root / "pretokenized", lengths, vocab=1000, seed=4, shard_docs=25)
    config = run_config(
        {
            "train": {"seq_len": 256, "micro_batch_size": 1, "grad_accum": 1, "epochs": 1, "warmup_steps": 0},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "model": {"config": MODEL},
            "gate": {"collectives": False},
        }
    )
    build_plan(config, pretok, root / "plan")
    return config, pretok, root / "plan"


@pytest.fixture
def dirs(made, tmp_path):
    import shutil

    config, pretok, plan = made
    shutil.copytree(pretok, tmp_path / "pretokenized")
    shutil.copytree(plan, tmp_path / "plan")
    return config, tmp_path / "pretokenized", tmp_path / "plan"


def edit_json(path: Path, edit) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))  # json.dumps writes NaN, as a hand edit may


def one_line_error(call) -> str:
    with pytest.raises(InputError) as exc:
        call()
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- plan.json


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("attn_weight", "x", "'attn_weight'"),
        ("attn_weight", math.nan, "'attn_weight'"),
        ("attn_weight", -1.0, "'attn_weight'"),
        ("eval_micro_batch_size", "x", "'eval_micro_batch_size'"),
        ("validation", "x", "'validation'"),
        ("validation", {"packs_sha256": "ab"}, "'validation.packs'"),
        ("segments", [{}], "'segments[0].world_size'"),
        ("world_size", True, "'world_size'"),
        ("seq_len", 0, "'seq_len'"),
        ("grad_accum", 2.5, "'grad_accum'"),
        ("stats", {"dropped": {"remainder": {"docs": "x"}}}, "'stats.dropped.remainder.docs'"),
        ("stats", {"dropped_doc_ids": [1, "2"]}, "'stats.dropped_doc_ids[1]'"),
        ("remainder", None, "'remainder'"),
    ],
)
def test_a_hand_edited_plan_is_one_input_error_naming_file_and_key(dirs, key, value, named):
    _, _, plan = dirs
    edit_json(plan / "plan.json", lambda p: p.__setitem__(key, value))
    message = one_line_error(lambda: read_plan(plan))
    assert "plan.json" in message and named in message and "rerun pack" in message, message


def test_a_continued_plan_needs_its_segment_steps_and_resume_point(dirs):
    _, _, plan = dirs
    segment = {"world_size": 2, "grad_accum": 1, "micro_batch_size": 1, "first_step": 0, "end_step": 3}
    edit_json(plan / "plan.json", lambda p: p.__setitem__("segments", [dict(segment, packs="packs.parquet")]))
    assert "'segment_steps'" in one_line_error(lambda: read_plan(plan))
    edit_json(plan / "plan.json", lambda p: p.update(segment_steps={"zero": 3}))
    assert "'segment_steps.zero'" in one_line_error(lambda: read_plan(plan))
    edit_json(plan / "plan.json", lambda p: p.update(segment_steps={"0": 3}, resumed_from={"step": "3"}))
    assert "'resumed_from.step'" in one_line_error(lambda: read_plan(plan))


def test_the_gate_exits_before_writing_anything_for_a_bad_plan(dirs, tmp_path):
    config, pretok, plan = dirs
    edit_json(plan / "plan.json", lambda p: p.__setitem__("attn_weight", math.nan))
    with pytest.raises(InputError, match="attn_weight"):
        run_gate(config, pretok, plan, tmp_path / "gate")
    assert not (tmp_path / "gate" / "gate.json").exists()


@pytest.mark.parametrize("version", [99, "1", True, 1.0, None])
def test_a_plan_of_another_format_version_is_refused(dirs, version):
    _, _, plan = dirs
    edit_json(
        plan / "plan.json",
        lambda p: p.pop("format_version") if version is None else p.__setitem__("format_version", version),
    )
    message = one_line_error(lambda: read_plan(plan))
    assert "written by another wattgate version: rerun pack" in message, message


def test_reader_and_writers_agree_on_format_versions():
    from wattgate.data import pretokenize
    from wattgate.pack import plan
    from wattgate.run_files import MANIFEST_FORMAT_VERSION, PLAN_FORMAT_VERSION

    assert (plan.FORMAT_VERSION, pretokenize.FORMAT_VERSION) == (PLAN_FORMAT_VERSION, MANIFEST_FORMAT_VERSION)


# ---------------------------------------------------------------- packs.parquet


def rewrite_packs(plan: Path, column: str, values: pa.Array) -> None:
    path = plan / "packs.parquet"
    table = pq.read_table(path)
    path.unlink()
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, values), path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    edit_json(plan / "plan.json", lambda p: p.__setitem__("packs_sha256", digest))


def test_doc_lengths_shorter_than_doc_ids_is_an_input_error_naming_the_column(dirs, tmp_path):
    config, pretok, plan = dirs
    lengths = pq.read_table(plan / "packs.parquet").column("doc_lengths").to_pylist()
    rewrite_packs(plan, "doc_lengths", pa.array([x[:-1] for x in lengths], pa.list_(pa.int32())))
    message = one_line_error(lambda: run_gate(config, pretok, plan, tmp_path / "gate"))
    assert "packs.parquet" in message and "'doc_lengths'" in message and "row 0" in message, message


@pytest.mark.parametrize(
    "make",
    [
        lambda n: pa.array(np.arange(n) % 2 + 0.5, pa.float64()),
        lambda n: pa.array([str(i % 2) for i in range(n)]),
        lambda n: pa.array([None] + [0] * (n - 1), pa.int32()),
    ],
    ids=["float", "string", "null"],
)
def test_a_rank_column_off_contract_is_refused(dirs, make):
    _, _, plan = dirs
    rewrite_packs(plan, "rank", make(pq.read_metadata(plan / "packs.parquet").num_rows))
    message = one_line_error(lambda: read_packs(plan / "packs.parquet"))
    assert "packs.parquet" in message and "'rank'" in message and "rerun pack" in message, message


def test_null_entries_in_doc_ids_are_refused(dirs):
    _, _, plan = dirs
    ids = pq.read_table(plan / "packs.parquet").column("doc_ids").to_pylist()
    ids[0][0] = None
    rewrite_packs(plan, "doc_ids", pa.array(ids, pa.list_(pa.int64())))
    assert "'doc_ids' holds 1 null" in one_line_error(lambda: read_packs(plan / "packs.parquet"))


# ---------------------------------------------------------------- shards and manifest


def rewrite_shard(pretok: Path, plan: Path, edit) -> None:
    """Edit the first shard's rows, then re-hash it into the manifest and re-pin the plan (a foreign writer)."""
    path = pretok / "shard-00000.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    manifest = json.loads((pretok / "manifest.json").read_text())
    manifest["shard_hashes"] = {n: xxhash.xxh3_128((pretok / n).read_bytes()).hexdigest() for n in manifest["shards"]}
    raw = json.dumps(manifest).encode()
    (pretok / "manifest.json").write_bytes(raw)
    digest = hashlib.sha256(raw).hexdigest()
    edit_json(plan / "plan.json", lambda p: p.__setitem__("pretokenized_manifest_sha256", digest))


def negative_id(rows):
    rows[0]["input_ids"][1] = -5


def short_mask(rows):
    rows[0]["loss_mask"] = rows[0]["loss_mask"][:-1]


def mask_of_two(rows):
    rows[0]["loss_mask"] = [2 if m else 0 for m in rows[0]["loss_mask"]]


def loss_count_wrong(rows):
    rows[0]["num_loss_tokens"] += 1


@pytest.mark.parametrize(
    ("edit", "said"),  # per document; per row group (from the Parquet metadata)
    [
        (negative_id, ("negative token id (-5)", "negative token id (-5)")),
        (short_mask, ("loss_mask entries for", "loss_mask values for")),
        (mask_of_two, ("loss_mask holds values other than 0 and 1", "loss_mask values 0..2")),
    ],
)
@pytest.mark.parametrize("full", [True, False], ids=["per-document", "per-row-group"])
def test_damaged_shards_fail_provenance_naming_the_shard(dirs, tmp_path, monkeypatch, edit, said, full):
    config, pretok, plan = dirs
    if not full:
        monkeypatch.setattr("wattgate.gate.inputs.FULL_CONTENT_CHECK_TOKENS", 0)
    rewrite_shard(pretok, plan, edit)
    report = run_gate(config, pretok, plan, tmp_path / "gate").to_json()
    provenance = next(c for c in report["checks"] if c["name"] == "provenance")
    assert not provenance["passed"] and "shard-00000.parquet" in provenance["detail"], provenance["detail"]
    assert said[0 if full else 1] in provenance["detail"], provenance["detail"]


@pytest.mark.parametrize(("key", "value"), [("max_token_id", None), ("max_token_id", "7"), ("num_docs", -1)])
def test_a_manifest_field_of_the_wrong_type_is_an_input_error(dirs, key, value):
    _, pretok, _ = dirs
    edit_json(pretok / "manifest.json", lambda m: m.__setitem__(key, value))
    message = one_line_error(lambda: read_manifest(pretok))
    assert "manifest.json" in message and f"'{key}'" in message and "rerun pretokenize" in message, message


@pytest.mark.parametrize("version", [2, "1"])
def test_a_manifest_of_another_format_version_is_refused(dirs, version):
    _, pretok, _ = dirs
    edit_json(pretok / "manifest.json", lambda m: m.__setitem__("format_version", version))
    assert "written by another wattgate version: rerun pretokenize" in one_line_error(lambda: read_manifest(pretok))


def test_num_loss_tokens_disagreeing_with_the_mask_fails_provenance(dirs, tmp_path):
    config, pretok, plan = dirs
    rewrite_shard(pretok, plan, loss_count_wrong)
    report = run_gate(config, pretok, plan, tmp_path / "gate").to_json()
    provenance = next(c for c in report["checks"] if c["name"] == "provenance")
    assert not provenance["passed"] and "num_loss_tokens says" in provenance["detail"], provenance["detail"]


def test_a_shard_without_loss_mask_is_one_line(dirs, tmp_path):
    config, pretok, plan = dirs
    path = pretok / "shard-00000.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["loss_mask"]), path)
    message = one_line_error(lambda: run_gate(config, pretok, plan, tmp_path / "gate"))
    assert "shard-00000.parquet" in message and "missing column(s) loss_mask" in message, message


def test_a_shard_without_num_loss_tokens_or_content_hash_is_one_line(dirs, tmp_path):
    config, pretok, plan = dirs
    path = pretok / "shard-00000.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["num_loss_tokens", "content_hash"]), path)
    message = one_line_error(lambda: run_gate(config, pretok, plan, tmp_path / "gate"))
    assert "shard-00000.parquet: missing column(s) num_loss_tokens, content_hash; rerun pretokenize" in message


def test_a_verdict_marker_naming_no_config_is_one_line(tmp_path):
    marker = tmp_path / "PASSED"
    marker.write_text("all gate checks passed; see gate.md\nplan.json sha256 a\npacks.parquet sha256 b\n")
    assert (
        one_line_error(lambda: read_marker_hashes(marker)) == f"{marker}: names no config.yaml sha256; rerun the gate"
    )
    marker.write_text(marker.read_text() + "config.yaml sha256 c\n")
    assert read_marker_hashes(marker) == {"plan.json": "a", "packs.parquet": "b", "config.yaml": "c"}


# ---------------------------------------------------------------- what a gate stopped by bad input leaves in --out


VERDICT_FILES = ("gate.json", "gate.md", "PASSED", "UNENFORCED")


def test_a_gate_stopped_by_bad_input_leaves_no_previous_verdict(dirs, tmp_path):
    config, pt, plan = dirs
    out = tmp_path / "gate"
    assert run_gate(config, pt, plan, out).to_json()["passed"] and (out / "PASSED").exists()
    (plan / "packs.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError):
        run_gate(config, pt, plan, out)
    assert [name for name in VERDICT_FILES if (out / name).exists()] == []


def test_a_gate_stopped_by_bad_input_does_not_create_its_out(dirs, tmp_path):
    config, pt, plan = dirs
    (plan / "packs.parquet").unlink()
    with pytest.raises(InputError):
        run_gate(config, pt, plan, tmp_path / "gate")
    assert not (tmp_path / "gate").exists()

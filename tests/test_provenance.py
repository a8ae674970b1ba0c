"""Content provenance (issue 13): shard hashes, true lengths and token ids, doc_id lookup in the trainer."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from wattgate.config import run_config
from wattgate.records.run_config import RunConfig
from wattgate.data.pretokenize import pretokenize
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan
from wattgate.run_files import read_manifest
from wattgate.train.data import DocStore, build_batch, read_rank_plan

from support.architectures import TINY_SHAPE

from conftest import write_jsonl

VOCAB = 2048
MODEL = dict(model_type="qwen3", vocab_size=VOCAB, **TINY_SHAPE)


def make_config() -> RunConfig:
    return run_config(
        {
            "train": {
                "seq_len": 512,
                "micro_batch_size": 1,
                "grad_accum": 1,
                "epochs": 1,
                "warmup_steps": 0,
                "checkpoint_every": 1,
            },
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "model": {"config": MODEL},
        }
    )


@pytest.fixture
def run_dirs(tmp_path):
    """Synthetic shards (2 shards, several row groups each) and a plan made from them."""
    lengths = np.random.default_rng(1).integers(5, 60, 40)
    pretok = write_random_pretokenized(tmp_path / "pretokenized", lengths, vocab=1000, seed=3, shard_docs=25)
    config = make_config()
    build_plan(config, pretok, tmp_path / "plan")
    return config, pretok, tmp_path / "plan"


def rewrite_shard(path: Path, edit) -> None:
    """Rewrite a shard with edit(rows) applied to its rows (a list of dicts), keeping the schema."""
    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


def restamp(pretok: Path, plan_dir: Path) -> None:
    """What a foreign writer would do: hash the edited shards into the manifest and re-pin the plan to it."""
    manifest = json.loads((pretok / "manifest.json").read_text())
    manifest["shard_hashes"] = {n: xxhash.xxh3_128((pretok / n).read_bytes()).hexdigest() for n in manifest["shards"]}
    raw = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    (pretok / "manifest.json").write_bytes(raw)
    plan = json.loads((plan_dir / "plan.json").read_text())
    plan["pretokenized_manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (plan_dir / "plan.json").write_text(json.dumps(plan))


def provenance(report: dict):
    return next(c for c in report["checks"] if c["name"] == "provenance")


def failed(report: dict) -> list[str]:
    return sorted(c["name"] for c in report["checks"] if not c["passed"])


def grow_first_doc(rows):
    rows[0]["input_ids"] = rows[0]["input_ids"] + [7] * 400
    rows[0]["loss_mask"] = rows[0]["loss_mask"] + [1] * 400


def big_token_id(rows):
    rows[3]["input_ids"][1] = 5000


EDITS = {"reversed_rows": lambda rows: rows.reverse(), "grown_document": grow_first_doc, "token_id_5000": big_token_id}


# ---------------------------------------------------------------- pretokenize records content


def test_pretokenize_records_shard_hashes_and_the_true_max_token_id(tmp_path, tokenizer_dir, demo_docs):
    config = run_config(
        {"data": {"inputs": [str(write_jsonl(tmp_path / "c.jsonl", demo_docs))]}, "pretokenize": {"shard_docs": 50}}
    )
    manifest = pretokenize(config, tokenizer_dir, tmp_path / "p", progress=False)
    assert len(manifest.shards) > 1 and manifest.shard_hash_algorithm == "xxh3_128"
    assert manifest.shard_hashes == {
        n: xxhash.xxh3_128((tmp_path / "p" / n).read_bytes()).hexdigest() for n in manifest.shards
    }
    ids = [max(x) for n in manifest.shards for x in pq.read_table(tmp_path / "p" / n).column("input_ids").to_pylist()]
    assert manifest.max_token_id == max(ids) < manifest.vocab_size


# ---------------------------------------------------------------- the gate


def test_untouched_synthetic_run_passes(run_dirs, tmp_path):
    config, pretok, plan = run_dirs
    report = run_gate(config, pretok, plan, tmp_path / "gate").to_json()
    assert failed(report) == []  # the tiny model's checkpoints need 0.01 GiB: any test disk holds them
    space = next(c for c in report["checks"] if c["name"] == "checkpoint_space")
    assert space["detail"].startswith("need 0.01 GiB (2+1 x 0.00 GiB checkpoints")
    assert "shard hashes match" in provenance(report)["detail"]


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_gate_rejects_a_shard_edited_after_pretokenize(run_dirs, tmp_path, edit):
    config, pretok, plan = run_dirs
    rewrite_shard(pretok / "shard-00000.parquet", EDITS[edit])
    report = run_gate(config, pretok, plan, tmp_path / "gate").to_json()
    assert not report["passed"] and "provenance" in failed(report)
    assert "shard-00000.parquet: content hash differs from the manifest" in provenance(report)["detail"]


@pytest.mark.parametrize(
    "shard, edit, expected",
    [
        ("shard-00001.parquet", grow_first_doc, ["shard-00001.parquet: doc_id 25 holds 4", "num_tokens says"]),
        ("shard-00000.parquet", big_token_id, ["token id 5000", "vocab_size 2048"]),
    ],
    ids=["true lengths", "true max token id"],
)
def test_gate_checks_content_even_when_the_hash_was_restamped(run_dirs, tmp_path, shard, edit, expected):
    config, pretok, plan = run_dirs
    rewrite_shard(pretok / shard, edit)
    restamp(pretok, plan)
    report = run_gate(config, pretok, plan, tmp_path / "gate").to_json()
    assert "provenance" in failed(report)
    assert all(text in provenance(report)["detail"] for text in expected), provenance(report)["detail"]


def test_gate_rejects_a_manifest_without_shard_hashes_in_one_line_naming_the_key(run_dirs, tmp_path):
    config, pretok, plan = run_dirs
    manifest = json.loads((pretok / "manifest.json").read_text())
    del manifest["shard_hashes"]
    (pretok / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"manifest\.json.*shard_hashes.*rerun pretokenize"):
        run_gate(config, pretok, plan, tmp_path / "gate")


# ---------------------------------------------------------------- the trainer


def test_docstore_finds_documents_by_doc_id_not_row_position(run_dirs):
    _, pretok, _ = run_dirs
    before = {d: DocStore(pretok).get(d)[0].tolist() for d in (0, 1, 24, 25, 39)}
    rewrite_shard(pretok / "shard-00000.parquet", lambda rows: rows.reverse())
    store = DocStore(pretok)
    assert {d: store.get(d)[0].tolist() for d in before} == before


def test_docstore_rejects_a_document_whose_length_differs_from_the_plan(run_dirs):
    _, pretok, plan = run_dirs
    rewrite_shard(pretok / "shard-00000.parquet", grow_first_doc)
    store = DocStore(pretok)
    micro = next(m for r in (0, 1) for m in read_rank_plan(plan, r) if any(0 in p.tolist() for p in m.packs))
    with pytest.raises(InputError) as err:
        build_batch(store, micro.packs, 512)
    msg = str(err.value)
    assert "\n" not in msg and "shard-00000.parquet" in msg and "doc_id 0" in msg
    assert "rerun pretokenize/pack/gate" in msg


def test_row_group_metadata_catches_a_grown_document_and_the_true_max_without_decoding(run_dirs):
    from wattgate.gate.inputs import verify_shards

    _, pretok, plan = run_dirs
    rewrite_shard(pretok / "shard-00001.parquet", grow_first_doc)
    rewrite_shard(pretok / "shard-00000.parquet", big_token_id)
    restamp(pretok, plan)
    manifest, _ = read_manifest(pretok)
    content = verify_shards(pretok, manifest, full=False)
    assert content.scope == "per row group" and content.max_token_id == 5000
    assert any("shard-00001.parquet: row group 0" in p and "num_tokens sum to" in p for p in content.problems)
    assert verify_shards(pretok, manifest, full=True).max_token_id == 5000

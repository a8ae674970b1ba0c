"""The pack stage on real pretokenized shards: contract fields, hashes, errors."""

import json

import pyarrow.parquet as pq
import pytest
import yaml

from wattgate.artifacts import sha256_file
from wattgate.cli import main
from wattgate.data.pretokenize import pretokenize

from conftest import write_jsonl

PLAN_KEYS = {
    "format_version",
    "world_size",
    "seq_len",
    "micro_batch_size",
    "grad_accum",
    "epochs",
    "steps_per_epoch",
    "strategy",
    "pretokenized_manifest_sha256",
    "packs_sha256",
    "stats",
}
PACK_COLUMNS = {
    "epoch": "int32",
    "step": "int32",
    "micro": "int32",
    "rank": "int32",
    "slot": "int32",
    "doc_ids": "list<element: int64>",
    "doc_lengths": "list<element: int32>",
    "num_tokens": "int32",
}


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory, tokenizer_dir, demo_docs):
    from wattgate.config import validate_config

    work = tmp_path_factory.mktemp("pack")
    corpus = write_jsonl(work / "c.jsonl", demo_docs)
    config = validate_config({"data": {"inputs": [str(corpus)]}, "train": {"seq_len": 256}})
    pretokenize(config, tokenizer_dir, work / "pretokenized", progress=False)
    return work / "pretokenized"


def write_config(path, **sections):
    config = {
        "train": {"seq_len": 256, "micro_batch_size": 2, "grad_accum": 2, "epochs": 2},
        "cluster": {"nodes": 2, "gpus_per_node": 2},
    }
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(config))
    return str(path)


def run_pack(tmp_path, pretokenized, out, **sections):
    config = write_config(tmp_path / "c.yaml", **sections)
    return main(["pack", "--config", config, "--pretokenized", str(pretokenized), "--out", str(out)])


def test_plan_follows_the_contract(tmp_path, pretokenized):
    assert run_pack(tmp_path, pretokenized, tmp_path / "plan") == 0
    plan = json.loads((tmp_path / "plan/plan.json").read_text())
    assert PLAN_KEYS <= set(plan)
    assert plan["world_size"] == 4 and plan["strategy"] == "bfd+rebin"
    assert plan["packs_sha256"] == sha256_file(tmp_path / "plan/packs.parquet")
    assert plan["pretokenized_manifest_sha256"] == sha256_file(pretokenized / "manifest.json")
    schema = pq.read_schema(tmp_path / "plan/packs.parquet")
    assert {f.name: str(f.type) for f in schema} == PACK_COLUMNS
    stats = plan["stats"]
    assert stats["per_rank_steps_per_epoch"] == [[plan["steps_per_epoch"]] * 2] * 4
    assert sum(stats["per_rank_tokens"]) == 2 * stats["num_tokens"]
    assert 0 < stats["efficiency"] <= 1 and stats["max_rank_cost_ratio_step"] >= 1


def test_rerun_is_byte_identical(tmp_path, pretokenized):
    run_pack(tmp_path, pretokenized, tmp_path / "a")
    run_pack(tmp_path, pretokenized, tmp_path / "b")
    for name in ("plan.json", "packs.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_drop_lists_dropped_documents(tmp_path, pretokenized):
    assert run_pack(tmp_path, pretokenized, tmp_path / "plan", pack={"remainder": "drop"}) == 0
    plan = json.loads((tmp_path / "plan/plan.json").read_text())
    dropped = plan["stats"]["dropped"]
    if plan["stats"]["dropped_doc_ids"]:
        assert dropped["remainder"]["docs"] == len(plan["stats"]["dropped_doc_ids"])
    rows = pq.read_table(tmp_path / "plan/packs.parquet").to_pydict()
    used = {d for e, ids in zip(rows["epoch"], rows["doc_ids"]) if e == 0 for d in ids}
    assert used.isdisjoint(plan["stats"]["dropped_doc_ids"])
    assert len(used) + len(plan["stats"]["dropped_doc_ids"]) == plan["stats"]["num_docs"]


def test_none_control_is_uneven(tmp_path, pretokenized):
    assert (
        run_pack(
            tmp_path,
            pretokenized,
            tmp_path / "plan",
            pack={"remainder": "none"},
            cluster={"nodes": 1, "gpus_per_node": 3},
        )
        == 0
    )
    steps = json.loads((tmp_path / "plan/plan.json").read_text())["stats"]["per_rank_micro_batches_per_epoch"]
    assert len({tuple(s) for s in steps}) > 1


def test_documents_longer_than_seq_len_are_refused(tmp_path, pretokenized, capsys):
    assert run_pack(tmp_path, pretokenized, tmp_path / "plan", train={"seq_len": 16}) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "> train.seq_len 16" in err and "pretokenize" in err


def test_missing_pretokenized_is_exit_2(tmp_path, capsys):
    assert run_pack(tmp_path, tmp_path / "nothing", tmp_path / "plan") == 2
    assert "run pretokenize first" in capsys.readouterr().err

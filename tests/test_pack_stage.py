"""The pack stage on real pretokenized shards: contract fields, hashes, errors."""

import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from wattgate.artifacts import sha256_file
from wattgate.cli import main
from wattgate.data.pretokenize import pretokenize
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.pack.bfd import pack_bfd
from wattgate.pack.plan import build_plan

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
    from wattgate.config import run_config

    work = tmp_path_factory.mktemp("pack")
    corpus = write_jsonl(work / "c.jsonl", demo_docs)
    config = run_config({"data": {"inputs": [str(corpus)]}, "train": {"seq_len": 256}})
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


# ---------------------------------------------------------------- shard lengths pack cannot use; the packer's memory


def _zero_lengths(table):
    return table.set_column(
        table.schema.get_field_index("num_tokens"), "num_tokens", pa.array([0] * len(table), pa.int32())
    )


def _null_lengths(table):
    return table.set_column(
        table.schema.get_field_index("num_tokens"), "num_tokens", pa.array([None] * len(table), pa.int32())
    )


def _float_lengths(table):
    values = [float(x) + 0.5 for x in table.column("num_tokens").to_pylist()]
    return table.set_column(table.schema.get_field_index("num_tokens"), "num_tokens", pa.array(values, pa.float64()))


def _no_lengths(table):
    return table.drop(["num_tokens"])


@pytest.mark.parametrize(
    "edit, expected",
    [
        (_zero_lengths, "doc_id 0 has num_tokens 0 (25 document(s) with num_tokens < 1)"),
        (_null_lengths, "column num_tokens has 25 null value(s)"),
        (_float_lengths, "column num_tokens has type double"),
        (_no_lengths, "shard has no num_tokens column"),
    ],
)
def test_pack_refuses_shard_lengths_it_cannot_pack_in_one_line(tmp_path, make_config, edit, expected):
    pt = write_random_pretokenized(tmp_path / "pt", [5] * 30, vocab=600, shard_docs=25)
    shard = pt / "shard-00000.parquet"
    pq.write_table(edit(pq.read_table(shard)), shard)
    with pytest.raises(InputError) as err:
        config = make_config(
            train={"seq_len": 512, "micro_batch_size": 1, "grad_accum": 1, "epochs": 1, "warmup_steps": 0},
            cluster={"nodes": 1, "gpus_per_node": 2},
        )
        build_plan(config, pt, tmp_path / "plan")
    message = str(err.value)
    assert message.startswith(f"{shard}: ") and expected in message and message.endswith("rerun pretokenize")
    assert "\n" not in message
    assert not (tmp_path / "plan").exists()


def test_bfd_memory_does_not_grow_with_the_capacity():
    capacity = 5_000_000  # a list per possible room would take hundreds of MB here
    lengths = np.array([3_000_000, 2_500_000, 2_000_000, 1_500_000, 7, 7])
    tracemalloc.start()
    try:
        packed = pack_bfd(lengths, capacity)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000
    # best fit: 2.0M joins 3.0M (room 2.0M), 1.5M joins 2.5M (room 2.5M), the 7s take bin 1's 1.0M, the only room left
    assert packed.tolist() == [0, 1, 0, 1, 1, 1]

"""Pretokenize: loss mask alignment, overlong policies, bad records, input formats, reproducibility."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from wattgate.data.pretokenize import pretokenize
from wattgate.data.tokenizer import load_tokenizer
from wattgate.errors import InputError

from conftest import tokenizer_refusing, write_jsonl


def read_shards(out: Path):
    manifest = json.loads((out / "manifest.json").read_text())
    table = pa.concat_tables(pq.read_table(out / s) for s in manifest["shards"])
    return manifest, table.to_pydict()


def run(make_config, tokenizer_dir, out, inputs, **sections):
    config = make_config(data={"inputs": [str(p) for p in inputs]}, **sections)
    pretokenize(config, tokenizer_dir, out, progress=False)
    return read_shards(out)


def test_chat_loss_mask_matches_transformers_assistant_mask(tmp_path, make_config, tokenizer_dir, demo_docs):
    corpus = write_jsonl(tmp_path / "chat.jsonl", demo_docs[:80])
    manifest, rows = run(make_config, tokenizer_dir, tmp_path / "out", [corpus], train={"seq_len": 4096})
    tok = load_tokenizer(tokenizer_dir)
    assert manifest["num_docs"] == 80 and rows["doc_id"] == list(range(80))
    assert rows["num_loss_tokens"] == [sum(m) for m in rows["loss_mask"]]
    assert manifest["num_loss_tokens"] == sum(rows["num_loss_tokens"])
    for doc, ids, mask in zip(demo_docs[:80], rows["input_ids"], rows["loss_mask"]):
        ref = tok.apply_chat_template(
            doc["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == list(ref["input_ids"])
        expected = list(ref["assistant_masks"])
        expected[0] = 0
        assert mask == expected
        # what the mask covers is exactly the assistant contents, each closed by <|im_end|>
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        answers = "".join(m["content"] + "<|im_end|>" for m in doc["messages"] if m["role"] == "assistant")
        assert trained == answers


def test_loss_on_all_and_position_zero_never_trained(tmp_path, make_config, tokenizer_dir, demo_docs):
    corpus = write_jsonl(tmp_path / "chat.jsonl", demo_docs[:10])
    _, rows = run(
        make_config, tokenizer_dir, tmp_path / "out", [corpus], train={"seq_len": 4096}, pretokenize={"loss_on": "all"}
    )
    for mask in rows["loss_mask"]:
        assert mask[0] == 0 and all(mask[1:])


def test_text_documents_get_eos_and_keep_input_order(tmp_path, make_config, tokenizer_dir, demo_docs):
    rows_in = [{"text": "The quick brown fox."}, demo_docs[0], {"text": "lazy dog jumps"}]
    corpus = write_jsonl(tmp_path / "mixed.jsonl", rows_in)
    _, rows = run(make_config, tokenizer_dir, tmp_path / "out", [corpus], train={"seq_len": 4096})
    tok = load_tokenizer(tokenizer_dir)
    assert rows["input_ids"][0] == tok("The quick brown fox.")["input_ids"] + [tok.eos_token_id]
    assert rows["input_ids"][2][-1] == tok.eos_token_id
    assert rows["loss_mask"][0] == [0] + [1] * (len(rows["input_ids"][0]) - 1)
    assert rows["num_tokens"] == [len(x) for x in rows["input_ids"]]


@pytest.mark.parametrize("policy", ["truncate", "split", "drop"])
def test_overlong_policies_are_counted(tmp_path, make_config, tokenizer_dir, policy):
    long_text = " ".join(["fox"] * 200)
    corpus = write_jsonl(tmp_path / "t.jsonl", [{"text": "short one"}, {"text": long_text}])
    manifest, rows = run(
        make_config, tokenizer_dir, tmp_path / "out", [corpus], pretokenize={"overlong": policy, "max_tokens": 64}
    )
    assert manifest["overlong"]["documents"] == 1
    assert all(n <= 64 for n in rows["num_tokens"])
    full = len(load_tokenizer(tokenizer_dir)(long_text)["input_ids"]) + 1
    if policy == "truncate":
        assert rows["num_tokens"][1] == 64 and manifest["num_docs"] == 2
    elif policy == "split":
        assert sum(rows["num_tokens"][1:]) == full
        assert manifest["overlong"]["split_chunks"] == manifest["num_docs"] - 1 == -(-full // 64)
        assert all(m[0] == 0 for m in rows["loss_mask"])
    else:
        assert manifest["num_docs"] == 1 and manifest["dropped"] == {"overlong": 1}


def test_documents_without_targets_are_dropped_and_counted(tmp_path, make_config, tokenizer_dir):
    corpus = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": "no answer here"}]},
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        ],
    )
    manifest, rows = run(make_config, tokenizer_dir, tmp_path / "out", [corpus])
    assert manifest["num_docs"] == 1 and manifest["dropped"] == {"no_loss_tokens": 1}


BAD_RECORDS = {
    "malformed_json": b'{"text": "unclosed\n',
    "not_an_object": b'["a list"]\n',
    "missing_field": b'{"body": "x"}\n',
    "wrong_type": b'{"text": 42}\n',
    "undecodable_bytes": b'{"text": "caf\xe9"}\n',
    "empty_document": b'{"text": "   "}\n',
}
BAD_MESSAGES = {
    "wrong_type": b'{"messages": "not a list"}\n',
    "empty_document": b'{"messages": []}\n',
}


@pytest.mark.parametrize(
    "reason,line",
    list(BAD_RECORDS.items())
    + [
        ("wrong_type", b'{"messages": [{"role": "user"}]}\n'),
        ("empty_document", b'{"messages": [{"role": "user", "content": ""}]}\n'),
    ],
)
def test_each_bad_record_class_is_named_with_file_and_line(tmp_path, make_config, tokenizer_dir, reason, line):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"text": "fine"}\n\n' + line + b'{"text": "also fine"}\n')
    with pytest.raises(InputError, match=rf"bad.jsonl:3: .*\[{reason}\]"):
        run(make_config, tokenizer_dir, tmp_path / "out", [corpus])
    assert not (tmp_path / "out").exists()  # nothing half-written
    manifest, rows = run(make_config, tokenizer_dir, tmp_path / "out", [corpus], pretokenize={"on_bad_record": "skip"})
    assert manifest["num_docs"] == 2
    assert manifest["dropped"] == {f"bad_record:{reason}": 1}


def test_template_errors_are_bad_records(tmp_path, make_config, tokenizer_dir):
    strict = tokenizer_refusing(
        tmp_path, tokenizer_dir, "m['role'] not in ['user', 'assistant']", "'unknown role ' + m['role']"
    )
    corpus = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"messages": [{"role": "system", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        ],
    )
    config = make_config(data={"inputs": [str(corpus)]})
    with pytest.raises(InputError, match=r"c.jsonl:2: chat template failed: unknown role system \[template_error\]"):
        pretokenize(config, strict, tmp_path / "out", progress=False)


def test_template_that_rewrites_content_falls_back_to_prefix_rendering(tmp_path, make_config, tokenizer_dir):
    trimming = tmp_path / "trim_tok"
    shutil.copytree(tokenizer_dir, trimming)
    tpl = trimming / "chat_template.jinja"
    tpl.write_text(tpl.read_text().replace("message['content']", "message['content'] | trim"))
    doc = {"messages": [{"role": "user", "content": "  pad me  "}, {"role": "assistant", "content": "  42  "}]}
    corpus = write_jsonl(tmp_path / "c.jsonl", [doc])
    config = make_config(data={"inputs": [str(corpus)]})
    pretokenize(config, trimming, tmp_path / "out", progress=False)
    _, rows = read_shards(tmp_path / "out")
    tok = load_tokenizer(trimming)
    ref = tok.apply_chat_template(doc["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert rows["input_ids"][0] == list(ref["input_ids"])
    assert tok.decode([i for i, m in zip(rows["input_ids"][0], rows["loss_mask"][0]) if m]).startswith("42")


def test_parquet_and_datasets_inputs_match_jsonl(tmp_path, make_config, tokenizer_dir, demo_docs):
    from datasets import Dataset

    docs = demo_docs[:40]
    jsonl = write_jsonl(tmp_path / "c.jsonl", docs)
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "c.parquet")
    Dataset.from_list(docs).save_to_disk(str(tmp_path / "c"))  # one stem: the shards' source column is "c"
    outs = []
    for i, src in enumerate([jsonl, tmp_path / "c.parquet", tmp_path / "c"]):
        outs.append(run(make_config, tokenizer_dir, tmp_path / f"out{i}", [src])[1])
    assert outs[0] == outs[1] == outs[2]


def test_parquet_bad_row_is_named(tmp_path, make_config, tokenizer_dir):
    pq.write_table(pa.table({"text": ["fine", None, "ok"]}), tmp_path / "c.parquet")
    with pytest.raises(InputError, match=r"c.parquet:row 1: missing field"):
        run(make_config, tokenizer_dir, tmp_path / "out", [tmp_path / "c.parquet"])


def test_rerun_is_byte_identical_and_sharded(tmp_path, make_config, tokenizer_dir, demo_docs):
    corpus = write_jsonl(tmp_path / "c.jsonl", demo_docs)
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run(make_config, tokenizer_dir, out, [corpus], pretokenize={"shard_docs": 100, "batch_size": 64})
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert len([f for f in files if f.startswith("shard-")]) >= 3
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_cli_reports_one_line_and_exit_2(tmp_path, tokenizer_dir):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"text": "ok"}\n{"text": \n')
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"inputs": [str(corpus)]}}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wattgate",
            "pretokenize",
            "--config",
            str(config),
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "bad.jsonl:2: malformed JSON" in proc.stderr


def test_model_folder_as_tokenizer_path_hashes_only_tokenizer_files(tmp_path, tokenizer_dir):
    from wattgate.data.tokenizer import tokenizer_sha256

    model_dir = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    before = tokenizer_sha256(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\0" * 1024)
    assert tokenizer_sha256(model_dir) == before
    assert load_tokenizer(model_dir).eos_token == "<|im_end|>"
    (model_dir / "tokenizer_config.json").write_text(
        (model_dir / "tokenizer_config.json").read_text().replace("<|im_end|>", "<|endoftext|>", 1)
    )
    assert tokenizer_sha256(model_dir) != before


def test_missing_tokenizer_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="tokenizer folder not found"):
        load_tokenizer(tmp_path / "nope")


def test_row_groups_are_bounded_by_tokens_so_reading_one_document_decodes_little():
    from wattgate.data.shards import row_group_bounds

    lengths = np.array([100] * 50 + [1000] + [30] * 40)
    bounds = row_group_bounds(lengths, max_tokens=1000, max_docs=16)
    groups = [lengths[a:b] for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == len(lengths)
    assert sum(len(g) for g in groups) == len(lengths)
    assert all(len(g) >= 1 and len(g) <= 16 for g in groups)
    assert all(g.sum() <= 1000 for g in groups)  # the 1000-token document fills a group alone
    assert [1000] in [g.tolist() for g in groups]
    assert row_group_bounds(np.array([5000]), max_tokens=1000) == [0, 1]  # one overlong document: a group of its own
    assert row_group_bounds(np.array([], dtype=np.int64)) == [0]


def test_shards_of_many_documents_are_written_in_token_bounded_row_groups(tmp_path):
    from wattgate.data.shards import ROW_GROUP_TOKENS
    from wattgate.data.synthetic import write_random_pretokenized
    from wattgate.train.data import DocStore

    lengths = np.random.default_rng(3).integers(200, 4000, 3000)
    folder = tmp_path / "pretokenized"
    write_random_pretokenized(folder, lengths.tolist(), 512, 0, shard_docs=2000)
    shard = pq.ParquetFile(folder / "shard-00000.parquet")
    per_group = [
        int(shard.read_row_group(g, ["num_tokens"]).column(0).to_numpy().sum()) for g in range(shard.num_row_groups)
    ]
    assert shard.metadata.num_rows == 2000 and len(per_group) > 1
    assert max(per_group) <= ROW_GROUP_TOKENS
    store = DocStore(folder)
    for doc in (0, 1999, 2000, 2999):  # by doc_id across the row groups and shards
        ids, _ = store.get(doc)
        assert len(ids) == lengths[doc]

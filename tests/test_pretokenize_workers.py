"""Pretokenize on worker processes (a large chat corpus) writes what one thread writes: the same shard bytes and
manifest, the same bad-record counts, and under `on_bad_record: error` the first bad record in input order;
and the chat template called directly renders what `apply_chat_template` renders, or is not used."""

import gzip
import json
import os
from pathlib import Path

import pytest

import wattgate.data.encode as encode
from wattgate.data.chat import ChatRenderer
from wattgate.data.pretokenize import pretokenize
from wattgate.data.records import Fields
from wattgate.data.tokenizer import load_tokenizer
from wattgate.errors import InputError, StageFailed

from conftest import tokenizer_refusing, write_jsonl

WORKERS = 3  # more than this machine may have: workers share cores, which changes nothing but speed


@pytest.fixture
def on_workers(monkeypatch):
    """Every chat corpus goes to WORKERS processes, whatever its size and the cores here."""

    def use(workers: bool) -> None:
        monkeypatch.setattr(encode, "WORKER_MIN_INPUT_BYTES", 0 if workers else 1 << 60)
        monkeypatch.setattr(encode, "usable_cores", lambda: WORKERS)
        monkeypatch.setattr(encode, "fork_allowed", lambda: True)  # even if an earlier test left a thread

    return use


@pytest.fixture
def strict_tokenizer(tmp_path, tokenizer_dir) -> Path:
    """The test tokenizer with a template that refuses a turn saying REFUSED (a template error, a bad record)."""
    return tokenizer_refusing(tmp_path, tokenizer_dir, "m['content'] == 'REFUSED'", "'refused turn'")


def _mixed_corpus(path: Path, demo_docs) -> Path:
    """Chats (some refused by the template), text, blank lines and bad records of several kinds, interleaved."""
    rows = []
    for i, doc in enumerate(demo_docs[:120]):
        rows.append(doc)
        if i % 9 == 4:
            rows.append({"text": f"plain text record {i}, between chats"})
        if i % 17 == 8:
            rows.append('{"messages": [{"role": "user", "content": "unclosed"')  # malformed JSON
        if i % 23 == 11:
            rows.append({"messages": "not a list"})
        if i % 29 == 3:
            rows.append("")
        if i % 31 == 7:
            rows.append({"messages": [{"role": "user", "content": "REFUSED"}, {"role": "assistant", "content": "ok"}]})
    return write_jsonl(path, rows)


def _stage_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_worker_processes_write_the_same_bytes_as_one_thread(
    tmp_path, make_config, strict_tokenizer, demo_docs, on_workers
):
    corpus = _mixed_corpus(tmp_path / "mixed.jsonl", demo_docs)
    config = make_config(
        data={"inputs": [str(corpus)]}, pretokenize={"on_bad_record": "skip", "batch_size": 7, "shard_docs": 40}
    )
    outputs = {}
    for workers in (False, True, True):
        on_workers(workers)
        assert encode.encode_workers([corpus], Fields()) == (WORKERS if workers else 0)
        out = tmp_path / f"out-{len(outputs)}"
        pretokenize(config, strict_tokenizer, out, progress=False)
        outputs[out.name] = _stage_bytes(out)
    one_thread, on_workers_once, on_workers_again = outputs.values()
    assert on_workers_once == one_thread and on_workers_again == one_thread
    manifest = json.loads(one_thread["manifest.json"])
    assert set(manifest["dropped"]) == {
        "bad_record:malformed_json",
        "bad_record:wrong_type",
        "bad_record:template_error",
    }
    assert manifest["num_docs"] > 120 and len(manifest["shards"]) > 2


@pytest.mark.parametrize("workers", [False, True], ids=["one-thread", "workers"])
def test_the_first_bad_record_in_input_order_stops_the_stage(
    tmp_path, make_config, strict_tokenizer, demo_docs, on_workers, workers
):
    """A template error early, a malformed line later, then a truncated gzip, all within the batches of 4 that
    several processes have in flight when the reader meets the cut: the error named is the earliest, and
    nothing is written."""
    on_workers(workers)
    rows = [json.dumps(d) for d in demo_docs[:20]]
    rows[2] = json.dumps({"messages": [{"role": "user", "content": "REFUSED"}, {"role": "assistant", "content": "ok"}]})
    rows[9] = "{not json"
    data = gzip.compress(("\n".join(rows) + "\n").encode())
    corpus = tmp_path / "c.jsonl.gz"
    corpus.write_bytes(data[: len(data) - 20])  # the tail cut: the reader stops near the end
    config = make_config(data={"inputs": [str(corpus)]}, pretokenize={"batch_size": 4})
    with pytest.raises(InputError, match=r"c\.jsonl\.gz:3: chat template failed: refused turn \[template_error\]"):
        pretokenize(config, strict_tokenizer, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    rows[2] = json.dumps(demo_docs[0])
    corpus.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    with pytest.raises(InputError, match=r"c\.jsonl\.gz:10: malformed JSON"):
        pretokenize(config, strict_tokenizer, tmp_path / "out", progress=False)


def test_a_small_or_text_corpus_is_encoded_beside_the_reader(tmp_path, demo_docs, monkeypatch):
    monkeypatch.setattr(encode, "usable_cores", lambda: WORKERS)
    monkeypatch.setattr(encode, "fork_allowed", lambda: True)
    chats = write_jsonl(tmp_path / "chats.jsonl", demo_docs[:50])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "words " * 50}] * 50)
    assert encode.encode_workers([chats], Fields()) == 0  # small
    monkeypatch.setattr(encode, "WORKER_MIN_INPUT_BYTES", 0)
    assert encode.encode_workers([chats], Fields()) == WORKERS
    assert encode.encode_workers([text], Fields()) == 0  # the tokenizer uses every core from one thread
    assert encode.encode_workers([text, chats], Fields()) == WORKERS
    assert encode.encode_workers([tmp_path / "missing.jsonl"], Fields()) == 0  # the reader names it
    monkeypatch.setattr(encode, "fork_allowed", lambda: False)  # another Python thread runs
    assert encode.encode_workers([chats], Fields()) == 0
    monkeypatch.setattr(encode, "fork_allowed", lambda: True)
    monkeypatch.setattr(encode, "usable_cores", lambda: 1)
    assert encode.encode_workers([chats], Fields()) == 0


def test_direct_template_rendering_matches_apply_chat_template(tokenizer_dir, demo_docs):
    tok = load_tokenizer(tokenizer_dir)
    renderer = ChatRenderer(tok, str(tokenizer_dir))
    for doc in demo_docs:
        text, _ = renderer.render(doc["messages"])
        assert text == tok.apply_chat_template(doc["messages"], tokenize=False)
    assert renderer._direct is not None and renderer._direct_checked  # the fast path was taken


def test_direct_template_rendering_is_dropped_when_it_differs(tokenizer_dir, demo_docs):
    """A transformers that passes the template other variables than the direct call does: the first
    conversation shows the difference, and every conversation renders through apply_chat_template."""
    tok = load_tokenizer(tokenizer_dir)
    renderer = ChatRenderer(tok, str(tokenizer_dir))
    renderer._direct.compiled = renderer._direct.compiled.environment.from_string("{{ messages | length }}")
    for doc in demo_docs[:40]:
        text, _ = renderer.render(doc["messages"])
        assert text == tok.apply_chat_template(doc["messages"], tokenize=False)
    assert renderer._direct is None


def _die(raw):
    os._exit(9)  # a worker the OS killed (out of memory, say)


def test_a_worker_that_dies_ends_the_stage_in_one_line(
    tmp_path, make_config, tokenizer_dir, demo_docs, on_workers, monkeypatch
):
    on_workers(True)
    monkeypatch.setattr(encode, "_encode_in_worker", _die)  # forked after this: the workers run it
    corpus = write_jsonl(tmp_path / "c.jsonl", demo_docs[:40])
    config = make_config(data={"inputs": [str(corpus)]}, pretokenize={"batch_size": 8})
    with pytest.raises(StageFailed, match=r"^pretokenize: an encode worker process ended abruptly \(killed by the OS"):
        pretokenize(config, tokenizer_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()

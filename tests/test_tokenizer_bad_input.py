"""Probe findings on the data stages and the throughput ledger: tokenizer faults stop the stage instead of
being counted as bad records, empty corpora are refused, outputs and inputs are named for what they are."""

import json
import shutil

import pytest
import yaml

from conftest import write_jsonl
from wattgate.cli import main
from wattgate.data.demo_corpus import write_demo_corpus
from wattgate.data.pretokenize import pretokenize
from wattgate.data.tokenizer import train_tokenizer
from wattgate.errors import InputError
from wattgate.ledger import append_ledger, read_ledger

CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}


def _with_template(tokenizer_dir, tmp_path, template: str):
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    (tok / "chat_template.jinja").write_text(template)
    return tok


def _mixed_corpus(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", [CHAT] * 5 + [{"text": "a plain document"}])


def test_a_template_that_does_not_compile_stops_pretokenize_naming_the_file(tmp_path, make_config, tokenizer_dir):
    tok = _with_template(tokenizer_dir, tmp_path, "{{ x ")
    config = make_config(data={"inputs": [str(_mixed_corpus(tmp_path))]}, pretokenize={"on_bad_record": "skip"})
    with pytest.raises(InputError, match=r"tok/chat_template\.jinja: chat template does not compile \(.*line 1\)"):
        pretokenize(config, tok, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_template_failing_on_every_chat_record_stops_pretokenize(tmp_path, make_config, tokenizer_dir):
    tok = _with_template(tokenizer_dir, tmp_path, "{{ raise_exception('broken template') }}")
    config = make_config(data={"inputs": [str(_mixed_corpus(tmp_path))]}, pretokenize={"on_bad_record": "skip"})
    with pytest.raises(
        InputError, match=r"tok/chat_template\.jinja: the chat template failed on all 5 chat records .*broken template"
    ):
        pretokenize(config, tok, tmp_path / "out", progress=False)
    # one that fails on some records only still drops just those, as bad records
    template = (tokenizer_dir / "chat_template.jinja").read_text()
    picky = "{%- if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
    (tok / "chat_template.jinja").write_text(picky + template)
    system_first = {"messages": [{"role": "system", "content": "be terse"}] + CHAT["messages"]}
    write_jsonl(tmp_path / "c.jsonl", [CHAT, system_first, CHAT])  # the file config names
    manifest = pretokenize(config, tok, tmp_path / "out", progress=False)
    assert manifest["num_docs"] == 2 and manifest["dropped"] == {"bad_record:template_error": 1}


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_train_tokenizer_refuses_a_corpus_without_records(tmp_path, make_config, content):
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text(content)
    with pytest.raises(InputError, match=r"empty\.jsonl \(--corpus\): no document to train .*no records in it"):
        train_tokenizer(make_config(), tmp_path / "tok", [corpus])
    assert not (tmp_path / "tok").exists()


def test_train_tokenizer_refuses_a_corpus_whose_records_were_all_dropped(tmp_path, make_config):
    corpus = write_jsonl(tmp_path / "bad.jsonl", ['{"other": 1}', "[]"])
    config = make_config(data={"inputs": [str(corpus)]}, pretokenize={"on_bad_record": "skip"})
    with pytest.raises(InputError, match=r"bad\.jsonl \(data\.inputs\): .*2 bad record\(s\) dropped"):
        train_tokenizer(config, tmp_path / "tok")


def test_train_tokenizer_warns_when_the_corpus_is_too_small_for_the_vocab(tmp_path, make_config, capsys):
    corpus = write_jsonl(tmp_path / "tiny.jsonl", [{"text": "hello world"}])
    tok = train_tokenizer(make_config(tokenizer={"vocab_size": 600}), tmp_path / "tok", [corpus])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train-tokenizer: warning: ")
    assert f"vocab of only {tok.get_vocab_size()}, not tokenizer.vocab_size 600" in err[0]
    assert (tmp_path / "tok" / "tokenizer.json").is_file()  # a short vocab still works


def test_train_tokenizer_names_the_corpus_option_for_a_missing_file(tmp_path, make_config):
    with pytest.raises(InputError, match=r"nope\.jsonl: input not found \(--corpus\)"):
        train_tokenizer(make_config(), tmp_path / "tok", [tmp_path / "nope.jsonl"])


@pytest.mark.parametrize("name", ["d.parquet", "d.jsonl.gz", "d.json", "corpus"])
def test_demo_corpus_refuses_an_out_that_names_another_format(tmp_path, name, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"demo_corpus": {"num_docs": 5}}))
    out = tmp_path / name
    assert main(["demo-corpus", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"wattgate demo-corpus: error: {out}: demo-corpus writes plain JSONL; give --out a name ending in .jsonl"
    ]
    assert not out.exists()
    assert write_demo_corpus(tmp_path / "d.jsonl", 5, 0, 2) == 5


def test_a_non_utf8_ledger_is_an_input_error_naming_the_line(tmp_path):
    ledger = tmp_path / "throughput.jsonl"
    ledger.write_bytes(json.dumps({"cost_per_s": 1.0}).encode() + b"\n\xff\n")
    with pytest.raises(InputError, match=r"throughput\.jsonl:2: the throughput ledger is not UTF-8 text"):
        read_ledger(ledger)


def test_a_ledger_that_is_a_folder_is_an_input_error(tmp_path):
    folder = tmp_path / "ledger"
    folder.mkdir()
    with pytest.raises(InputError, match=r"ledger: forecast\.ledger is not a file"):
        read_ledger(folder)
    with pytest.raises(InputError, match=r"ledger: forecast\.ledger is not a file"):
        append_ledger(folder, {"cost_per_s": 1.0})
    assert read_ledger(tmp_path / "missing.jsonl") == []

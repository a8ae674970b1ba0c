"""The tokenizer stages on bad input: a chat template that does not compile, or fails on every chat record,
stops pretokenize instead of being counted as bad records; train-tokenizer refuses a corpus without records (or
whose records were all dropped), names the option a missing file came from, and warns when the corpus is too small
for the vocabulary."""

import shutil

import pytest

from conftest import write_jsonl
from wattgate.data.pretokenize import pretokenize
from wattgate.data.tokenizer import train_tokenizer
from wattgate.errors import InputError

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
    assert manifest.num_docs == 2 and manifest.dropped == {"bad_record:template_error": 1}


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

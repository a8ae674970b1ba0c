"""Issue 13: corpus inputs that used to end in a traceback or pass silently (data/records.py, data/chat.py)."""

import gzip
import json
from collections import Counter

import pytest

from conftest import write_jsonl
from wattgate.data import records as records_mod
from wattgate.data.records import BadRecordPolicy, Fields, read_records
from wattgate.errors import InputError


def read(paths, mode="error", **fields):
    policy = BadRecordPolicy(mode, Counter())
    out = list(read_records(paths, Fields(**fields), policy))
    return out, policy


def gz_corpus(path, n=200):
    data = b"".join(json.dumps({"text": f"document number {i} " * 20}).encode() + b"\n" for i in range(n))
    path.write_bytes(gzip.compress(data))
    return path


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_truncated_gzip_is_one_line_error_naming_the_file(tmp_path, mode):
    path = gz_corpus(tmp_path / "c.jsonl.gz")
    path.write_bytes(path.read_bytes()[:-40])  # a download cut short
    with pytest.raises(InputError, match=r"c\.jsonl\.gz:\d+: .*(truncated|corrupt).*re-download"):
        read([path], mode)


def test_corrupt_gzip_body_is_one_line_error(tmp_path):
    path = gz_corpus(tmp_path / "c.jsonl.gz")
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0xFF  # the CRC32 in the trailer: every line decodes, the check at the end fails
    path.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"c\.jsonl\.gz:\d+: .*corrupt.*CRC"):
        read([path])


def test_not_gzip_at_all_is_one_line_error(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(b'{"text": "plain"}\n')
    with pytest.raises(InputError, match=r"c\.jsonl\.gz.*not a gzip file"):
        read([path])


def test_deeply_nested_line_is_a_bad_record(tmp_path):
    deep = '{"text": "x", "meta": ' + "[" * 200_000 + "]" * 200_000 + "}"
    path = write_jsonl(tmp_path / "deep.jsonl", [{"text": "fine"}, deep, {"text": "also fine"}])
    with pytest.raises(InputError, match=r"deep\.jsonl:2: .*nested.*\[too_deeply_nested\]"):
        read([path])
    out, policy = read([path], "skip")
    assert [r.text for r in out] == ["fine", "also fine"]
    assert policy.dropped == {"bad_record:too_deeply_nested": 1}


def test_huge_integer_literal_is_a_bad_record_not_a_traceback(tmp_path):
    path = write_jsonl(tmp_path / "int.jsonl", ['{"text": "x", "n": ' + "9" * 5000 + "}"])
    with pytest.raises(InputError, match=r"int\.jsonl:1: .*\[malformed_json\]"):
        read([path])


def test_os_error_while_reading_names_the_file(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"text": "b"}])

    class Failing:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def __iter__(self):
            yield b'{"text": "a"}\n'
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(records_mod, "open", Failing, raising=False)
    with pytest.raises(InputError, match=r"c\.jsonl:2: cannot read: .*Input/output error"):
        read([path])


def test_permission_denied_on_open_names_the_file(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(records_mod, "open", denied, raising=False)
    with pytest.raises(InputError, match=r"c\.jsonl: cannot read: .*Permission denied"):
        read([path])


def chat(*roles):
    return {"messages": [{"role": r, "content": f"{r} says hi"} for r in roles]}


def test_unknown_role_is_a_bad_record_naming_line_and_role(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat("user", "assistant"), chat("human", "gpt")])
    with pytest.raises(InputError, match=r"c\.jsonl:2: .*messages\[0\]\.role.*'human'.*\[unknown_role\]"):
        read([path])
    out, policy = read([path], "skip")
    assert len(out) == 1 and policy.dropped == {"bad_record:unknown_role": 1}


def test_non_alternating_turns_are_accepted_and_counted(tmp_path):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            chat("system", "user", "assistant"),
            chat("user", "user", "assistant"),
            chat("assistant", "user", "assistant"),
            chat("system", "assistant", "user", "assistant", "assistant"),
            chat("user", "assistant", "tool", "tool", "assistant"),
        ],
    )
    out, policy = read([path])
    assert len(out) == 5 and not policy.dropped
    assert policy.noted == {"chat:assistant_first": 2, "chat:consecutive_user": 1, "chat:consecutive_assistant": 1}


def test_overlong_document_in_characters_is_a_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"text": "x" * 1001}, chat("user", "assistant")])
    with pytest.raises(InputError, match=r"c\.jsonl:2: .*1001 characters.*1000.*\[too_many_chars\]"):
        read([path], max_chars=1000)
    out, policy = read([path], "skip", max_chars=1000)
    assert len(out) == 2 and policy.dropped == {"bad_record:too_many_chars": 1}
    big_chat = {"messages": [{"role": "user", "content": "y" * 600}, {"role": "assistant", "content": "z" * 600}]}
    path2 = write_jsonl(tmp_path / "d.jsonl", [big_chat])
    with pytest.raises(InputError, match=r"d\.jsonl:1: .*1200 characters.*\[too_many_chars\]"):
        read([path2], max_chars=1000)


def test_default_character_limit_is_bounded():
    assert 0 < Fields().max_chars <= 16_000_000


def test_pretokenize_skip_counts_deep_and_unknown_role(tmp_path, make_config, tokenizer_dir):
    from wattgate.data.pretokenize import pretokenize

    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = write_jsonl(
        tmp_path / "c.jsonl", [{"text": "fine text"}, deep, chat("user", "bot"), chat("user", "assistant")]
    )
    config = make_config(data={"inputs": [str(path)]}, pretokenize={"on_bad_record": "skip"})
    manifest = pretokenize(config, tokenizer_dir, tmp_path / "out", progress=False)
    assert manifest.num_docs == 2
    assert manifest.dropped == {"bad_record:too_deeply_nested": 1, "bad_record:unknown_role": 1}


def test_template_that_drops_a_turn_is_a_template_error_not_silent_loss(tmp_path, make_config, tokenizer_dir):
    import shutil

    from wattgate.data.pretokenize import pretokenize

    dropping = tmp_path / "drop_tok"
    shutil.copytree(tokenizer_dir, dropping)
    tpl = dropping / "chat_template.jinja"
    text = tpl.read_text()
    assert text.startswith("{%- for message in messages -%}") and "{%- endfor -%}" in text
    tpl.write_text(
        text.replace(
            "{%- for message in messages -%}",
            "{%- for message in messages -%}{%- if message['role'] != 'system' -%}",
            1,
        ).replace("{%- endfor -%}", "{%- endif -%}{%- endfor -%}", 1)
    )
    path = write_jsonl(tmp_path / "c.jsonl", [chat("user", "assistant"), chat("system", "user", "assistant")])
    config = make_config(data={"inputs": [str(path)]})
    with pytest.raises(
        InputError,
        match=r"c\.jsonl:2: .*drops the content of messages\[0\] \(role 'system'\)"
        r".*\[template_error\]",
    ):
        pretokenize(config, dropping, tmp_path / "out", progress=False)
    config = make_config(data={"inputs": [str(path)]}, pretokenize={"on_bad_record": "skip"})
    manifest = pretokenize(config, dropping, tmp_path / "out", progress=False)
    assert manifest.num_docs == 1 and manifest.dropped == {"bad_record:template_error": 1}


def test_damaged_parquet_page_is_one_line_error_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(
        pa.table({"text": [f"doc {i} " * 50 for i in range(5000)]}), path, row_group_size=1000, compression="none"
    )
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 2000] = b"\x07" * 2000
    path.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"c\.parquet:row \d+: cannot read"):
        read([path])


def test_cli_truncated_gzip_and_deep_nesting_exit_2_with_one_line(tmp_path, tokenizer_dir):
    import subprocess
    import sys

    import yaml

    gz = gz_corpus(tmp_path / "c.jsonl.gz")
    gz.write_bytes(gz.read_bytes()[:-40])
    deep = write_jsonl(tmp_path / "deep.jsonl", [{"text": "ok"}, '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    for corpus, expect in ((gz, "c.jsonl.gz:"), (deep, "deep.jsonl:2: ")):
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
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and expect in proc.stderr and "Traceback" not in proc.stderr

"""Chat records (issue 25, section 3): tool calls reach the template (and the loss mask), other message
fields pass through, and a lone surrogate is a bad record under both policies."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_jsonl
from wattgate.data.pretokenize import pretokenize
from wattgate.data.records import Fields, parse_record
from wattgate.data.tokenizer import load_tokenizer
from wattgate.errors import InputError

# Qwen-style: an assistant turn renders its tool calls after its content, a tool turn names its call
TOOL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- '<tool_call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- if message.tool_call_id -%}{{- ' [' + message.tool_call_id + ']' -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}


@pytest.fixture
def tool_tokenizer(tmp_path, tokenizer_dir):
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    (tok / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return tok


def _targets(out, tok) -> list[str]:
    manifest = json.loads((out / "manifest.json").read_text())
    table = pa.concat_tables(pq.read_table(out / s) for s in manifest["shards"]).to_pydict()
    tokenizer = load_tokenizer(tok)
    return [
        tokenizer.decode([i for i, m in zip(ids, mask) if m])
        for ids, mask in zip(table["input_ids"], table["loss_mask"])
    ]


@pytest.mark.parametrize("content", ["", None])
def test_an_assistant_tool_call_with_empty_content_is_rendered_and_trained(
    tmp_path, make_config, tool_tokenizer, content
):
    chat = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": content, "tool_calls": [CALL]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It rains."},
    ]
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}])
    out = tmp_path / "out"
    pretokenize(make_config(data={"inputs": [str(corpus)]}), tool_tokenizer, out, progress=False)
    (target,) = _targets(out, tool_tokenizer)
    # the tool call is part of what the assistant learns to say; before, its turn was empty
    assert '<tool_call>weather {"city": "Oslo"}</tool_call>' in target
    assert "It rains." in target and "Weather in Oslo" not in target and "[c1]" not in target


def test_other_message_fields_pass_through_to_the_template():
    rec = parse_record(
        {"messages": [{"role": "tool", "content": "rain", "tool_call_id": "c1", "name": "weather"}]},
        Fields(),
        "f:1",
    )
    assert rec.messages == [{"role": "tool", "content": "rain", "tool_call_id": "c1", "name": "weather"}]


LONE = [
    '{"text": "a\\ud800b"}',
    '{"messages": [{"role": "user", "content": "x\\udc00"}, {"role": "assistant", "content": "y"}]}',
    '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",'
    ' "tool_calls": [{"function": {"name": "f", "arguments": "\\ud83d"}}]}]}',
]


@pytest.mark.parametrize("line", LONE, ids=["text", "content", "tool_call"])
def test_a_lone_surrogate_is_a_bad_record_under_both_policies(tmp_path, make_config, tokenizer_dir, line):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n' + line + '\n{"text": "a pair \\ud83d\\ude00 is fine"}\n')
    with pytest.raises(InputError, match=r"c\.jsonl:2: field '.*' holds a lone UTF-16 surrogate .*\[lone_surrogate\]"):
        pretokenize(make_config(data={"inputs": [str(corpus)]}), tokenizer_dir, tmp_path / "a", progress=False)
    config = make_config(data={"inputs": [str(corpus)]}, pretokenize={"on_bad_record": "skip"})
    manifest = pretokenize(config, tokenizer_dir, tmp_path / "b", progress=False)
    assert manifest.num_docs == 2 and manifest.dropped == {"bad_record:lone_surrogate": 1}

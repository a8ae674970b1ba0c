"""The gate checks that the pretokenized data was made from the inputs the gated config names, as they are now: a
config naming a missing corpus, another corpus, or a corpus edited since pretokenize fails the gate in one line
(it passed on the old data when Snakemake did not rerun pretokenize), and a rerun of the gate rereads only what
was written since. Likewise the settings that shaped the data and the plan (check `settings`)."""

import json
import shutil

import pytest
import yaml
from support.runs import pretokenize_and_pack

from conftest import TINY_MODEL, write_jsonl
from wattgate.cli import main
from wattgate.config import validate_config

DOCS = [{"text": f"The quick brown fox {i} jumps over the lazy dog {i * 7}."} for i in range(120)]


@pytest.fixture(scope="module")
def made(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("sources")
    corpus = write_jsonl(root / "corpus.jsonl", DOCS)
    config = validate_config(
        {
            "run_name": "sources",
            "data": {"inputs": [str(corpus)]},
            "tokenizer": {"path": str(tokenizer_dir)},
            "model": {"config": TINY_MODEL},
            "train": {"seq_len": 128, "micro_batch_size": 1, "grad_accum": 1, "epochs": 1},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "gate": {"collectives": False},
        }
    )
    pretokenize_and_pack(root, config)
    return root, config


def gate(root, config, tmp_path, capsys, name="sources") -> tuple[int, dict, str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["gate", "--config", str(path), "--pretokenized", str(root / "pretokenized"), "--plan", str(root / "plan")]
    rc = main([*argv, "--out", str(tmp_path / "gate")])
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    check = next(c for c in report["checks"] if c["name"] == name)
    return rc, check, report, capsys.readouterr().err


def with_inputs(config: dict, *inputs) -> dict:
    changed = json.loads(json.dumps(config))
    changed["data"]["inputs"] = [str(p) for p in inputs]
    return changed


def test_the_config_that_was_pretokenized_passes_and_a_rerun_rereads_nothing(made, tmp_path, capsys):
    root, config = made
    rc, check, report, _ = gate(root, config, tmp_path, capsys)
    assert rc == 0 and check["passed"], check
    assert [v["size"] for v in report["source_files"].values()] == [(root / "corpus.jsonl").stat().st_size]
    rc, check, again, _ = gate(root, config, tmp_path, capsys)
    assert rc == 0 and again["source_files"] == report["source_files"]


def test_a_missing_corpus_fails_the_gate_in_one_line(made, tmp_path, capsys):
    root, config = made
    missing = tmp_path / "no-such-corpus.jsonl"
    rc, check, _, err = gate(root, with_inputs(config, missing), tmp_path, capsys)
    assert rc == 1 and not check["passed"]
    assert check["detail"] == f"data.inputs: {missing}: not found; fix the config's path, or restore the file"


def test_another_corpus_fails_naming_both_and_what_to_rerun(made, tmp_path, capsys):
    root, config = made
    other = shutil.copy(root / "corpus.jsonl", tmp_path / "other.jsonl")  # the same bytes, another input
    rc, check, _, _ = gate(root, with_inputs(config, other), tmp_path, capsys)
    assert rc == 1
    assert check["detail"] == (
        f"data.inputs names {other}, the pretokenized data was made from {root / 'corpus.jsonl'}; rerun pretokenize "
        "(snakemake --forcerun pretokenize) or point the config at the inputs it was made from"
    )


def test_a_corpus_edited_after_pretokenize_fails(made, tmp_path, capsys):
    root, config = made
    work = tmp_path / "work"
    work.mkdir()
    corpus = write_jsonl(work / "corpus.jsonl", DOCS)
    local = with_inputs(config, corpus)
    pretokenize_and_pack(work, local)
    write_jsonl(corpus, DOCS[:-1])  # edited after pretokenize: one document fewer
    rc, check, _, _ = gate(work, local, tmp_path, capsys)
    assert rc == 1 and check["detail"].startswith(f"data.inputs ({corpus}) changed since pretokenize (sha256 differs)")


def changed(config: dict, **keys) -> dict:
    """A copy of `config` with dotted keys set: changed(c, **{"pack.seed": 3})."""
    out = json.loads(json.dumps(config))
    for dotted, value in keys.items():
        section, key = dotted.split(".")
        out[section][key] = value
    return out


def test_the_settings_check_passes_the_config_that_made_the_data_and_plan(made, tmp_path, capsys):
    root, config = made
    rc, check, _, _ = gate(root, config, tmp_path, capsys, "settings")
    assert rc == 0 and check["passed"], check


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"pretokenize.loss_on": "all"}, "pretokenize.loss_on: pretokenized with 'assistant', the config says 'all'"),
        ({"pretokenize.append_eos": False}, "pretokenize.append_eos: pretokenized with True, the config says False"),
        ({"data.text_field": "body"}, "data.text_field: pretokenized with 'text', the config says 'body'"),
        ({"pack.seed": 3}, "pack.seed: planned with 0, the config says 3"),
        ({"pack.attn_weight": 0.5}, "pack.attn_weight: planned with 1e-05, the config says 0.5"),
    ],
)
def test_a_setting_the_data_or_plan_was_not_made_with_fails_naming_the_key(made, tmp_path, capsys, keys, named):
    root, config = made
    rc, check, _, _ = gate(root, changed(config, **keys), tmp_path, capsys, "settings")
    assert rc == 1 and not check["passed"]
    assert check["detail"].startswith(named + f" ({root / 'pretokenized'}); rerun "), check["detail"]
    rerun = "pack_and_balance" if "pack." in named else "pretokenize"
    assert check["detail"].endswith(f"(snakemake --forcerun {rerun})")


def test_another_tokenizer_than_the_data_was_made_with_fails_the_settings_check(made, tmp_path, capsys):
    root, config = made
    other = tmp_path / "other-tok"
    shutil.copytree(config["tokenizer"]["path"], other)
    rc, check, _, _ = gate(root, changed(config, **{"tokenizer.path": str(other)}), tmp_path, capsys, "settings")
    assert rc == 0 and check["passed"]  # the same files elsewhere: the same tokenizer
    special = json.loads((other / "tokenizer_config.json").read_text())
    special["model_max_length"] = 17
    (other / "tokenizer_config.json").write_text(json.dumps(special))
    rc, check, _, _ = gate(root, changed(config, **{"tokenizer.path": str(other)}), tmp_path, capsys, "settings")
    assert rc == 1 and check["detail"].startswith(
        f"tokenizer.path {other}: not the tokenizer the data was pretokenized with (sha256 differs)"
    )

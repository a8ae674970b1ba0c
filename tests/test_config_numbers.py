"""A config file's numbers in exponent notation are numbers (issue 31): PyYAML follows YAML 1.1, where 1.0e9,
1e9 and 1e-3 are strings that then failed the schema as "not of type number"; YAML 1.2 and JSON read numbers."""

import pytest

from wattgate.config import load_config
from wattgate.errors import InputError


def test_exponent_numbers_in_a_config_file_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "run_name: t\n"
        "model: {config: {model_type: qwen3}}\n"
        "train: {lr: 3e-4, collective_timeout_s: 1.2e3, export_max_shard_gib: 1.0e1}\n"
        "pack: {attn_weight: 1E-5}\n"
    )
    config = load_config(path)
    assert config["train"]["lr"] == 3e-4
    assert config["train"]["collective_timeout_s"] == 1200.0
    assert config["train"]["export_max_shard_gib"] == 10.0
    assert config["pack"]["attn_weight"] == 1e-5


def test_a_quoted_exponent_stays_a_string_and_the_error_names_its_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run_name: t\nmodel: {config: {model_type: qwen3}}\ntrain: {lr: '3e-4'}\n")
    with pytest.raises(InputError, match=r"c.yaml: key 'train.lr': '3e-4' is not of type 'number'"):
        load_config(path)


@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("watcher: {hang_after_s: .nan}", "watcher.hang_after_s"),
        ("train: {lr: .inf}", "train.lr"),
        ("train: {betas: [0.9, .nan]}", "train.betas.1"),
        ("forecast: {assumed_mfu: .nan}", "forecast.assumed_mfu"),
    ],
)
def test_config_refuses_nan_and_infinity_naming_the_key(tmp_path, yaml_text, key):
    path = tmp_path / "c.yaml"
    path.write_text("data: {inputs: [x.jsonl]}\n" + yaml_text + "\n")
    with pytest.raises(InputError, match=rf"c.yaml: key '{key}': .* is not a finite number"):
        load_config(path)


def test_config_refuses_a_poll_period_that_would_overflow_the_wait(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {inputs: [x.jsonl]}\nwatcher: {poll_s: 1.0e+12}\n")
    with pytest.raises(InputError, match="key 'watcher.poll_s': .* greater than the maximum"):
        load_config(path)

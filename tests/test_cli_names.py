"""One name per concept on the command line (issue 32, item 5): the run folder is --run-dir on every command that
writes or reads it (train and launch write it, watch writes its verdict into it, triage and report read it), and
triage's hang limit is --hang-after, as the config's watcher.hang_after_s. The old names (--out on train and
launch, --run on watch, triage and report, triage's --deadlock-after) still work for one release, each printing
one deprecation line, and are left out of --help. --run-dir passes through torchrun, where --run cannot."""

import json
import re
import subprocess
import sys

import pytest
from real_traces import H200_DATA

from wattgate.artifacts import check_stage_output, claim_stage_output
from wattgate.cli import build_parser, main
from wattgate.errors import InputError

TRAIN = H200_DATA / "train"
STAGE_ARGS = {
    "train": ["--config", "c.yaml", "--pretokenized", "pt", "--plan", "plan"],
    "launch": ["--config", "c.yaml", "--pretokenized", "pt", "--plan", "plan"],
    "watch": ["--config", "c.yaml"],
    "triage": ["--trace", "t.parquet", "--out", "power"],
    "report": ["--out", "report"],
}
OLD_RUN_FLAG = {"train": "--out", "launch": "--out", "watch": "--run", "triage": "--run", "report": "--run"}


def parse(capsys, *argv):
    args = build_parser().parse_args(list(argv))
    return args, capsys.readouterr().err.strip().splitlines()


def help_of(capsys, stage: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([stage, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("stage", STAGE_ARGS)
def test_the_run_folder_is_run_dir_on_every_command_that_takes_it(capsys, stage):
    args, err = parse(capsys, stage, *STAGE_ARGS[stage], "--run-dir", "results/train/demo")
    assert str(args.run) == "results/train/demo" and err == []
    assert "--run-dir DIR" in help_of(capsys, stage)


@pytest.mark.parametrize("stage", STAGE_ARGS)
def test_the_old_name_of_the_run_folder_is_a_deprecated_alias(capsys, stage):
    old = OLD_RUN_FLAG[stage]
    args, err = parse(capsys, stage, *STAGE_ARGS[stage], old, "results/train/demo")
    assert str(args.run) == "results/train/demo"
    assert err == [
        f"wattgate {stage}: warning: {old} is deprecated, use --run-dir (the old name goes in the next release)"
    ]
    assert not re.search(re.escape(old) + r"(?![-\w])", help_of(capsys, stage))  # --help shows --run-dir alone


@pytest.mark.parametrize("stage", STAGE_ARGS)
def test_the_run_folder_is_given_once(capsys, stage):
    with pytest.raises(SystemExit) as exc:
        parse(capsys, stage, *STAGE_ARGS[stage], "--run-dir", "a", OLD_RUN_FLAG[stage], "b")
    assert exc.value.code == 2
    assert f"argument {OLD_RUN_FLAG[stage]}: not allowed with argument --run-dir" in capsys.readouterr().err
    if stage in ("train", "launch", "watch"):
        with pytest.raises(SystemExit) as exc:
            parse(capsys, stage, *STAGE_ARGS[stage])
        assert exc.value.code == 2 and "--run-dir is required" in capsys.readouterr().err


def test_the_run_folder_reaches_a_rank_under_torchrun(tmp_path):
    """torchrun's parser refuses `--run` anywhere on its command line (an ambiguous abbreviation of --run-path):
    the rank gets --run-dir, and fails on its own (a missing config), not in torchrun's parser."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "wattgate"]
    cmd += ["train", "--config", str(tmp_path / "none.yaml"), "--pretokenized", "pt", "--plan", "plan"]
    proc = subprocess.run([*cmd, "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "wattgate train: error: " in proc.stderr and "none.yaml" in proc.stderr


def test_a_refused_run_folder_names_run_dir_and_other_outputs_name_out(tmp_path):
    claim_stage_output(tmp_path / "pt", "pretokenize")
    with pytest.raises(InputError, match=r"choose another --run-dir$"):
        check_stage_output(tmp_path / "pt", "train", flag="--run-dir")
    with pytest.raises(InputError, match=r"choose another --out$"):
        check_stage_output(tmp_path / "pt", "triage")


def test_triage_takes_the_hang_limit_as_hang_after_and_deadlock_after_for_one_release(tmp_path, capsys):
    args, err = parse(capsys, "triage", *STAGE_ARGS["triage"], "--hang-after", "45")
    assert args.hang_after == 45.0 and err == []
    args, err = parse(capsys, "triage", *STAGE_ARGS["triage"], "--deadlock-after", "45")
    assert args.hang_after == 45.0
    assert err == [
        "wattgate triage: warning: --deadlock-after is deprecated, use --hang-after (the old name goes in the next "
        "release)"
    ]
    help_text = help_of(capsys, "triage")
    assert "--hang-after" in help_text and "--deadlock-after" not in help_text
    # the value reaches triage: triage.json's limit, the same under either name
    limits = []
    for flag in ("--hang-after", "--deadlock-after"):
        out = tmp_path / flag.strip("-")
        assert main(["triage", "--trace", str(TRAIN / "telemetry"), flag, "45", "--out", str(out)]) == 0
        limits.append(json.loads((out / "triage.json").read_text())["deadlock_after_s"])
    assert limits == [45.0, 45.0]
    assert capsys.readouterr().err.count("deprecated") == 1


def test_every_subcommands_help_says_what_it_does_and_what_each_flag_is():
    import argparse

    from wattgate.cli.parser import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(commands) >= 16
    for name, command in commands.items():
        assert command.description and command.description.endswith("."), name
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"wattgate {name}: {action.option_strings or action.dest} has no help"

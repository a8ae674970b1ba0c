"""Every --out honours the `.wattgate-output` guard (issue 25, section 4): the stages that write their files
into --out in place (pack, gate, train, triage, report, compare) refuse a folder they did not write, before
any work and without writing anything there; they rerun into their own output, accept the workflow's log and
benchmark files, and adopt a folder of their own files from before the marker. A file --out at a folder, and
a damaged heartbeat under `triage --run`, are one-line answers too."""

import json
import shutil

import pytest
import yaml
from real_traces import H200_DATA

from conftest import TINY_MODEL, write_jsonl

from wattgate.artifacts import OUTPUT_MARKER, check_stage_output
from wattgate.cli import main
from wattgate.config import validate_config
from wattgate.data.pretokenize import pretokenize
from wattgate.errors import InputError
from wattgate.pack.plan import build_plan

TRAIN = H200_DATA / "train"


@pytest.fixture(scope="module")
def work(tmp_path_factory, tokenizer_dir, demo_docs):
    """Pretokenized demo shards, a plan, and the config (1 node x 2 ranks, the gate tests' tiny model)."""
    work = tmp_path_factory.mktemp("outputs")
    config = {
        "data": {"inputs": [str(write_jsonl(work / "c.jsonl", demo_docs))]},
        "train": {"seq_len": 256, "micro_batch_size": 2, "grad_accum": 2, "epochs": 1, "warmup_steps": 1},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "model": {"config": TINY_MODEL},
        "gate": {"collectives": False},
    }
    (work / "c.yaml").write_text(yaml.safe_dump(config))
    config = validate_config(config)
    pretokenize(config, tokenizer_dir, work / "pretokenized", progress=False)
    build_plan(config, work / "pretokenized", work / "plan")
    return work


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _argv(stage: str, work, out) -> list[str]:
    cfg = ["--config", str(work / "c.yaml")]
    return {
        "pack": ["pack", *cfg, "--pretokenized", str(work / "pretokenized")],
        "gate": ["gate", *cfg, "--pretokenized", str(work / "pretokenized"), "--plan", str(work / "plan")],
        "triage": ["triage", "--trace", str(TRAIN / "telemetry"), "--run", str(TRAIN)],
        "report": ["report", "--run", str(TRAIN)],
        "compare": ["compare", "--experiment", "scaling", "--runs", str(TRAIN)],
    }[stage] + ["--out", str(out)]


STAGES = ["pack", "gate", "triage", "report", "compare"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_folder_the_stage_did_not_write_is_refused_untouched(stage, work, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "gate.md").write_text("my own gate.md")  # a name the gate writes: never overwritten either
    before = _tree(out)
    assert main(_argv(stage, work, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{out}: output exists and is a folder wattgate {stage} did not write (it holds " in err[0]
    assert "notes.txt; no .wattgate-output" in err[0]
    assert "choose another --out" in err[0]
    assert _tree(out) == before and not (out / OUTPUT_MARKER).exists()


@pytest.mark.parametrize("stage", ["pack", "gate", "triage", "report"])
def test_another_stages_output_is_refused(stage, work, tmp_path, capsys):
    other = tmp_path / "tokenizer"
    shutil.copytree(work / "pretokenized", other)  # a published folder: marked by pretokenize
    before = _tree(other)
    assert main(_argv(stage, work, other)) == 2
    assert "is the output of wattgate pretokenize" in capsys.readouterr().err
    assert _tree(other) == before


@pytest.mark.parametrize("stage", ["pack", "gate", "triage", "report"])
def test_the_stage_reruns_into_its_own_output_beside_the_workflows_files(stage, work, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # Snakemake writes the rule's log before (or while) the stage runs, and a benchmark file after it
    (out / f"{stage}.log").write_text("log")
    (out / f"{stage}.benchmark.tsv").write_text("s\n1\n")
    assert main(_argv(stage, work, out)) == 0
    assert json.loads((out / OUTPUT_MARKER).read_text())["stage"] == stage
    first = _tree(out)
    assert main(_argv(stage, work, out)) == 0
    assert (out / f"{stage}.log").read_text() == "log"
    if stage == "pack":  # the others state how long they took or when they ran
        assert _tree(out) == first


def test_an_output_from_before_the_marker_is_adopted(work, tmp_path):
    out = tmp_path / "gate"
    assert main(_argv("gate", work, out)) == 0
    (out / OUTPUT_MARKER).unlink()  # what a wattgate from before the marker left
    (out / "gate.log").write_text("log")
    assert main(_argv("gate", work, out)) == 0
    assert json.loads((out / OUTPUT_MARKER).read_text())["stage"] == "gate" and (out / "PASSED").is_file()


def test_train_refuses_a_folder_it_did_not_write_before_any_rank_starts(work, tmp_path):
    from wattgate.train.loop import train

    out = tmp_path / "run"
    out.mkdir()
    (out / "final").mkdir()
    (out / "final" / "model.safetensors").write_bytes(b"someone's model")
    (out / "paper.tex").write_text("mine")
    before = _tree(out)
    config = validate_config(yaml.safe_load((work / "c.yaml").read_text()))
    with pytest.raises(InputError, match="a folder wattgate train did not write \\(it holds paper.tex; no"):
        train(config, work / "pretokenized", work / "plan", out)
    assert _tree(out) == before


def test_launch_refuses_a_folder_it_did_not_write_before_the_job_starts(work, tmp_path, capsys):
    gate = work / "gate"
    if not (gate / "PASSED").exists():
        assert main(_argv("gate", work, gate)) == 0
        capsys.readouterr()
    out = tmp_path / "run"
    out.mkdir()
    (out / "data.csv").write_text("1,2\n")
    argv = ["launch", "--config", str(work / "c.yaml"), "--pretokenized", str(work / "pretokenized")]
    argv += ["--plan", str(work / "plan"), "--gate", str(gate), "--out", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "a folder wattgate train did not write (it holds data.csv" in captured.err
    assert "launch: " not in captured.out  # the job's command line, printed as it starts
    assert sorted(p.name for p in out.iterdir()) == ["data.csv"]


def test_the_check_accepts_only_own_names_workflow_files_and_wattgate_temporaries(tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    for name in ("plan.json", "history", "pack.log", "pack.benchmark.tsv", ".plan.json.123@node-1.abcd_123.tmp"):
        (out / name).write_text("")
    check_stage_output(out, "pack", ("plan.json", "history"))
    (out / "plan.json.tmp").write_text("")  # not a name wattgate gives its temporaries
    with pytest.raises(InputError, match=r"it holds plan\.json\.tmp; no \.wattgate-output"):
        check_stage_output(out, "pack", ("plan.json", "history"))


def test_compare_accepts_the_variant_folders_it_reads(tmp_path):
    from wattgate.run_files import check_output

    out = tmp_path / "scaling"
    (out / "w2" / "train").mkdir(parents=True)
    (out / "compare.log").write_text("")
    check_output(out, "compare", ["w2"])
    with pytest.raises(InputError, match="it holds w2"):
        check_output(out, "compare")


def test_a_file_out_at_a_folder_names_the_out(tmp_path, capsys):
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "mine.jsonl").write_text("{}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"demo_corpus": {"num_docs": 5}}))
    assert main(["demo-corpus", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"wattgate demo-corpus: error: {out}: is a folder; this output is a file: give a file name"]
    assert sorted(p.name for p in out.iterdir()) == ["mine.jsonl"]


def test_triage_skips_and_names_a_bad_heartbeat_line(tmp_path, capsys):
    run = tmp_path / "train"
    shutil.copytree(TRAIN, run)
    events = run / "heartbeat" / "rank-0.events.jsonl"
    n = len(events.read_text().splitlines())
    with events.open("a") as f:
        f.write('{"time": "soon", "rank": 0, "phase": "train"}\n')
    out = tmp_path / "power"
    assert main(["triage", "--trace", str(run / "telemetry"), "--run", str(run), "--out", str(out)]) == 0
    reference = tmp_path / "reference"
    assert main(["triage", "--trace", str(TRAIN / "telemetry"), "--run", str(TRAIN), "--out", str(reference)]) == 0
    err = capsys.readouterr().err
    assert f"triage: warning: {events}:{n + 1}: not a heartbeat event" in err
    result = json.loads((out / "triage.json").read_text())
    assert len(result["notes"]) == 1 and f"rank-0.events.jsonl:{n + 1}" in result["notes"][0]
    assert result["phases"] == json.loads((reference / "triage.json").read_text())["phases"]
    assert "## Notes" in (out / "triage.md").read_text()
    # a file with no heartbeat event in it is another file, not damage: still an error naming it
    events.write_text("[1]\n")
    assert main(["triage", "--trace", str(run / "telemetry"), "--run", str(run), "--out", str(out)]) == 2
    assert f"{events}:1: not a heartbeat event" in capsys.readouterr().err


def test_a_publishing_stage_never_replaces_another_stages_output(work, tokenizer_dir, tmp_path, capsys):
    from wattgate.run_files import claim_output

    run = claim_output(tmp_path / "run", "train")  # a run folder, marked as train's
    (run / "checkpoints" / "step-5").mkdir(parents=True)
    (run / "checkpoints" / "step-5" / "state.json").write_text("{}")
    before = _tree(run)
    argv = ["pretokenize", "--config", str(work / "c.yaml"), "--tokenizer", str(tokenizer_dir), "--out", str(run)]
    assert main(argv) == 2
    assert f"{run}: output exists and is the output of wattgate train" in capsys.readouterr().err
    assert _tree(run) == before


def _user_files(tmp_path) -> dict:
    """A file of the user's at each kind of file --out: a Parquet table, a YAML config, a chat corpus, a JSON."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {name: tmp_path / name for name in ("mine.parquet", "mine.yaml", "mine.jsonl", "mine.json")}
    pq.write_table(pa.table({"time": [1.0], "power_w": [100.0]}), files["mine.parquet"])
    files["mine.yaml"].write_text("data: {inputs: [my.jsonl]}\n")
    write_jsonl(files["mine.jsonl"], [{"messages": [{"role": "user", "content": "my data"}]}])
    files["mine.json"].write_text('{"verdict": "mine"}')
    return files


def test_a_file_out_never_replaces_a_file_the_stage_did_not_write(tmp_path, capsys):
    files = _user_files(tmp_path)
    log = tmp_path / "power.csv"
    log.write_text("timestamp,gpu,power_w\n2025-01-01T00:00:00Z,0,100\n2025-01-01T00:00:01Z,0,110\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"demo_corpus": {"num_docs": 5}}))
    cases = {
        "import-trace": (["import-trace", "--from", "csv", str(log)], "mine.parquet"),
        "sample": (["sample", "--duration", "0.1"], "mine.parquet"),
        "variant": (["variant", "--config", str(cfg), "--experiment", "scaling", "--variant", "w2"], "mine.yaml"),
        "demo-corpus": (["demo-corpus", "--config", str(cfg)], "mine.jsonl"),
        "watch": (["watch", "--config", str(cfg), "--run", str(tmp_path), "--pid", "1"], "mine.json"),
        "calibrate": (["calibrate", "--gpu-model", "h100", "--seconds", "0.1"], "mine.yaml"),
    }
    before = {name: path.read_bytes() for name, path in files.items()}
    for stage, (argv, name) in cases.items():
        assert main([*argv, "--out", str(files[name])]) == 2, stage
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"wattgate {stage}: error: {files[name]}: output exists and is a file wattgate {stage} did not write; "
            f"{stage} replaces only its own earlier output: choose another --out, or remove it yourself"
        ], stage
    assert (
        main(
            [
                "calibrate",
                "--gpu-model",
                "h100",
                "--out",
                str(tmp_path / "t.yaml"),
                "--samples",
                str(files["mine.parquet"]),
            ]
        )
        == 2
    )
    assert {name: path.read_bytes() for name, path in files.items()} == before


def test_a_file_out_replaces_the_stages_own_earlier_output(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"demo_corpus": {"num_docs": 5}, "scaling": {"world_sizes": [1, 2]}}))
    log = tmp_path / "power.csv"
    log.write_text("timestamp,gpu,power_w\n2025-01-01T00:00:00Z,0,100\n2025-01-01T00:00:01Z,0,110\n")
    runs = {
        "demo.jsonl": ["demo-corpus", "--config", str(cfg)],
        "variant.yaml": ["variant", "--config", str(cfg), "--experiment", "scaling", "--variant", "w2"],
        "trace.parquet": [
            "import-trace",
            "--from",
            "csv",
            str(log),
            "--columns",
            "time=timestamp,gpu=gpu,power_w=power_w",
        ],
    }
    for name, argv in runs.items():
        for _ in range(2):
            assert main([*argv, "--out", str(tmp_path / name)]) == 0, name
    assert json.loads((tmp_path / "demo.jsonl").read_text().splitlines()[0])["source"] == "wattgate demo-corpus"
    assert yaml.safe_load((tmp_path / "variant.yaml").read_text())["run_name"].endswith("-scaling-w2")


def test_a_published_folder_with_files_added_by_someone_else_is_not_replaced(work, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "pt"
    argv = ["pretokenize", "--config", str(work / "c.yaml"), "--tokenizer", str(tokenizer_dir), "--out", str(out)]
    assert main(argv) == 0
    assert main(argv) == 0  # its own output, as published: replaced
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out}: output exists and is wattgate pretokenize's output with notes.txt added by someone else" in err
    assert _tree(out) == before
    (out / "notes.txt").unlink()
    (out / ".snakemake_timestamp").write_text("")  # what Snakemake adds to a directory() output
    assert main(argv) == 0

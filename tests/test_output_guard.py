"""The output guard: an --out never replaces what wattgate did not write.

A folder --out (atomic_dir, and the stages that write into --out in place: pack, gate, train, launch, triage,
report, compare, load-check) refuses a folder it did not write and another stage's output, before any work and
without writing anything there; it reruns into its own output (the workflow keeps its logs and benchmarks under
logs/, never in a stage's folder), and adopts a folder of its own files from before the marker, which folder hashes
never see. A file --out never replaces a file the stage did not write; one at a folder, or of another format, is a
one-line answer. An export never touches a final.old/ it did not make, and a damaged heartbeat under
`triage --run-dir` is one line too."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from real_traces import H200_DATA

from conftest import REPO, TINY, TINY_MODEL, write_jsonl

from wattgate.artifacts import OUTPUT_MARKER, atomic_dir, check_stage_output, sha256_tree
from wattgate.cli import main
from wattgate.config import run_config
from wattgate.data.demo_corpus import write_demo_corpus
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
    config = run_config(config)
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
        "triage": ["triage", "--trace", str(TRAIN / "telemetry"), "--run-dir", str(TRAIN)],
        "report": ["report", "--run-dir", str(TRAIN)],
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
def test_the_stage_reruns_into_its_own_output(stage, work, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert main(_argv(stage, work, out)) == 0
    assert json.loads((out / OUTPUT_MARKER).read_text())["stage"] == stage
    first = _tree(out)
    assert main(_argv(stage, work, out)) == 0
    if stage == "pack":  # the others state how long they took or when they ran
        assert _tree(out) == first


def test_an_output_from_before_the_marker_is_adopted(work, tmp_path):
    out = tmp_path / "gate"
    assert main(_argv("gate", work, out)) == 0
    (out / OUTPUT_MARKER).unlink()  # what a wattgate from before the marker left
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
    config = run_config(yaml.safe_load((work / "c.yaml").read_text()))
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
    argv += ["--plan", str(work / "plan"), "--gate", str(gate), "--run-dir", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "a folder wattgate train did not write (it holds data.csv" in captured.err
    assert "choose another --run-dir" in captured.err  # the run folder's flag
    assert "launch: " not in captured.out  # the job's command line, printed as it starts
    assert sorted(p.name for p in out.iterdir()) == ["data.csv"]


def test_the_check_accepts_only_own_names_and_wattgate_temporaries(tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    for name in ("plan.json", "history", ".plan.json.123@node-1.abcd_123.tmp"):
        (out / name).write_text("")
    check_stage_output(out, "pack", ("plan.json", "history"))
    for name in ("plan.json.tmp", "pack.log"):  # not a name wattgate gives its temporaries; a log is not pack's
        (out / name).write_text("")
        with pytest.raises(InputError, match=rf"it holds {re.escape(name)}; no \.wattgate-output"):
            check_stage_output(out, "pack", ("plan.json", "history"))
        (out / name).unlink()


def test_a_marker_another_rank_publishes_during_the_check_is_read_not_refused(tmp_path, monkeypatch):
    """Ranks of one launch claim the run folder at once: rank 1 may read no marker, then list the folder after
    rank 0 renamed its marker in. The listing's marker is read again, not taken for a foreign file."""
    import wattgate.artifacts as artifacts

    out = tmp_path / "run"
    out.mkdir()
    (out / OUTPUT_MARKER).write_text(json.dumps({"stage": "train"}))
    reads = iter([None])
    real = artifacts.marker_stage
    monkeypatch.setattr(artifacts, "marker_stage", lambda dest: next(reads, real(dest)))
    check_stage_output(out, "train", ("heartbeat",))
    (out / OUTPUT_MARKER).write_text("not json")  # a damaged marker is still refused
    reads = iter([None])
    with pytest.raises(InputError, match=r"it holds \.wattgate-output"):
        check_stage_output(out, "train", ("heartbeat",))


def test_compare_accepts_the_variant_folders_it_reads(tmp_path):
    from wattgate.run_files import check_output

    out = tmp_path / "scaling"
    (out / "w2" / "train").mkdir(parents=True)
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
    assert main(["triage", "--trace", str(run / "telemetry"), "--run-dir", str(run), "--out", str(out)]) == 0
    reference = tmp_path / "reference"
    assert main(["triage", "--trace", str(TRAIN / "telemetry"), "--run-dir", str(TRAIN), "--out", str(reference)]) == 0
    err = capsys.readouterr().err
    assert f"triage: warning: {events}:{n + 1}: not a heartbeat event" in err
    result = json.loads((out / "triage.json").read_text())
    assert len(result["notes"]) == 1 and f"rank-0.events.jsonl:{n + 1}" in result["notes"][0]
    assert result["phases"] == json.loads((reference / "triage.json").read_text())["phases"]
    assert "## Notes" in (out / "triage.md").read_text()
    # a file with no heartbeat event in it is another file, not damage: still an error naming it
    events.write_text("[1]\n")
    assert main(["triage", "--trace", str(run / "telemetry"), "--run-dir", str(run), "--out", str(out)]) == 2
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
        "watch": (["watch", "--config", str(cfg), "--run-dir", str(tmp_path), "--pid", "1"], "mine.json"),
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
    assert main(argv) == 0


# ---------------------------------------------------------------- atomic_dir: what a folder --out may replace


def test_out_refuses_a_folder_wattgate_did_not_write(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.jsonl").write_text('{"text": "precious"}\n')
    with pytest.raises(InputError) as exc:
        with atomic_dir(data) as tmp:
            (tmp / "manifest.json").write_text("{}")
    message = str(exc.value)
    assert str(data) in message and "\n" not in message
    assert "empty or new folder" in message and "remove it yourself" in message
    assert (data / "corpus.jsonl").read_text() == '{"text": "precious"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no temp left behind


def test_out_refuses_a_file(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("x\n")
    with pytest.raises(InputError):
        with atomic_dir(corpus):
            pass
    assert corpus.read_text() == "x\n"


def test_pretokenize_out_at_the_corpus_folder_keeps_the_corpus(tmp_path, tokenizer_dir, demo_docs):
    (tmp_path / "corpus").mkdir()
    corpus = write_jsonl(tmp_path / "corpus" / "c.jsonl", demo_docs[:20])
    before = corpus.read_bytes()
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"data": {"inputs": [str(corpus)]}, "train": {"seq_len": 256}}))
    rc = main(["pretokenize", "--config", str(config), "--tokenizer", str(tokenizer_dir), "--out", str(corpus.parent)])
    assert rc == 2
    assert corpus.read_bytes() == before


def test_out_replaces_its_own_output_and_accepts_an_empty_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # empty: fine
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker["written_by"] == "wattgate" and marker["format_version"] == 1
    assert marker["stage"] == "test_output_guard"  # the calling module
    with atomic_dir(out) as tmp:  # its own previous output: replaced
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == sorted([OUTPUT_MARKER, "b.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # another stage's output (a run folder's checkpoints, a pretokenized corpus) is never replaced
    with pytest.raises(InputError, match="output exists and is the output of wattgate test_output_guard"):
        with atomic_dir(out, stage="pretokenize") as tmp:
            (tmp / "c.txt").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == sorted([OUTPUT_MARKER, "b.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_published_folder_whose_marker_lists_no_names_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out, stage="pretokenize") as tmp:
        (tmp / "a.txt").write_text("1")
    (out / OUTPUT_MARKER).write_text(json.dumps({"format_version": 1, "stage": "pretokenize"}))
    with pytest.raises(InputError, match=f"by a {re.escape(OUTPUT_MARKER)} without its 'names' list") as caught:
        with atomic_dir(out, stage="pretokenize") as tmp:
            (tmp / "b.txt").write_text("2")
    assert "\n" not in str(caught.value) and sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "a.txt"]


def test_marker_is_invisible_to_folder_hashes_and_reruns_are_byte_identical(tmp_path):
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    (by_hand / "shard.bin").write_bytes(b"abc")
    for name in ("one", "two"):
        with atomic_dir(tmp_path / name, stage="pretokenize") as tmp:
            (tmp / "shard.bin").write_bytes(b"abc")
    assert (tmp_path / "one" / OUTPUT_MARKER).read_bytes() == (tmp_path / "two" / OUTPUT_MARKER).read_bytes()
    assert sha256_tree([tmp_path / "one"]) == sha256_tree([tmp_path / "two"]) == sha256_tree([by_hand])


# ---------------------------------------------------------------- a file --out of the stage's format


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


# ---------------------------------------------------------------- load-check's --out and an export's final.old/


def _load_check(tmp_path, out) -> subprocess.CompletedProcess:
    cfg = tmp_path / "lc.yaml"
    cfg.write_text(yaml.safe_dump({"run_name": "t", "model": {"config": TINY}, "cluster": {"gpus_per_node": 1}}))
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "wattgate", "load-check", "--config", str(cfg), "--out", str(out), "--export"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def test_load_check_refuses_a_run_folder_and_leaves_final_and_final_old_as_they_were(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "model.safetensors").write_bytes(b"the trained model")
    (run / "final.old").mkdir()
    (run / "final.old" / "notes.txt").write_text("mine")
    (run / "TRAINED").write_text("{}")
    before = _tree(run)
    proc = _load_check(tmp_path, run)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert f"{run}: output exists and is a folder wattgate loadcheck did not write (it holds TRAINED, final" in lines[0]
    assert _tree(run) == before


def test_load_check_reruns_into_its_own_output_and_keeps_a_final_old_it_did_not_make(tmp_path):
    out = tmp_path / "lc"
    first = _load_check(tmp_path, out)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / ".wattgate-output").is_file() and (out / "final" / "model.safetensors").is_file()
    (out / "final.old").mkdir()
    (out / "final.old" / "notes.txt").write_text("mine")
    again = _load_check(tmp_path, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "final.old" / "notes.txt").read_text() == "mine"
    assert (out / "final" / "model.safetensors").is_file()
    assert not [p.name for p in out.iterdir() if p.name.endswith((".old", ".tmp")) and p.name != "final.old"]


def test_load_check_refuses_another_stages_output(tmp_path):
    other = tmp_path / "tok"
    other.mkdir()
    (other / ".wattgate-output").write_text('{"format_version":1,"stage":"tokenizer","written_by":"wattgate"}')
    (other / "tokenizer.json").write_text("{}")
    proc = _load_check(tmp_path, other)
    assert proc.returncode == 2 and "is the output of wattgate tokenizer" in proc.stderr
    assert sorted(p.name for p in other.iterdir()) == [".wattgate-output", "tokenizer.json"]

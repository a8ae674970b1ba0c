"""A gate rerun whose proof inputs did not change reuses the collective proof (issue 31, item 6): kept in the
gate's --out folder with the inputs it holds for (wattgate's version and source, torch, transformers, the model
config, the train settings, the GPU model, the world size, every rank's step classes); any change reruns it and
gate.md says which; a reuse imports no torch and takes well under a second."""

import json
import subprocess
import sys

import pytest
import yaml

from wattgate.config import run_config
from wattgate.gate import proof_reuse as R
from wattgate.gate.run import run_gate
from wattgate.records.gate import Collectives
from wattgate.run_files import PROOF_CACHE, STAGE_FILES


def proof_of(report: dict) -> dict:
    return report["collectives"]


@pytest.fixture(scope="module")
def first(proof_run, tmp_path_factory):
    pretokenized, plan, config = proof_run
    out = tmp_path_factory.mktemp("reuse") / "gate"
    return out, run_gate(config, pretokenized, plan, out).to_json()


def test_a_rerun_with_the_same_inputs_reuses_the_proof_and_says_so(proof_run, first):
    pretokenized, plan, config = proof_run
    out, report = first
    assert proof_of(report)["reused"] is None and proof_of(report)["changed_inputs"] is None  # nothing kept before
    assert PROOF_CACHE in STAGE_FILES["gate"] and (out / PROOF_CACHE).exists()
    again = run_gate(config, pretokenized, plan, out).to_json()
    proof = proof_of(again)
    assert again["passed"] and proof["reused"]["proved_s"] == proof_of(report)["elapsed_s"]
    assert proof["elapsed_s"] < 1.0 and proof["changed_inputs"] == []
    assert (
        proof["classes"] == proof_of(report)["classes"] and proof["inputs_sha256"] == proof_of(report)["inputs_sha256"]
    )
    check = next(c for c in again["checks"] if c["name"] == "collectives")
    assert check["passed"] and "(reused: the proof's inputs are unchanged since " in check["detail"]
    assert "The proof was reused: the proof of " in (out / "gate.md").read_text()
    assert json.loads((out / "gate.json").read_text())["collectives"]["reused"]["proved_at"]


@pytest.mark.parametrize(
    "change,changed",
    [
        (lambda c: c["train"].update(eval_every=7), ["classes_sha256", "steps", "train"]),
        (lambda c: c["model"]["config"].update(intermediate_size=96), ["model"]),
        (lambda c: c["train"].update(mixed_precision="none"), ["train"]),
    ],
    ids=["cadence", "model", "precision"],
)
def test_a_changed_input_reruns_the_proof_and_names_it(proof_run, first, tmp_path, change, changed):
    pretokenized, plan, config = proof_run
    out, _ = first
    changed_config = config.to_json()
    change(changed_config)
    changed_config = run_config(changed_config)
    copy = tmp_path / "gate"
    copy.mkdir()
    (copy / PROOF_CACHE).write_bytes((out / PROOF_CACHE).read_bytes())
    proof = proof_of(run_gate(changed_config, pretokenized, plan, copy).to_json())
    assert proof["reused"] is None and proof["changed_inputs"] == changed
    assert f"(rerun: {', '.join(changed)} changed since the kept proof)" in (copy / "gate.md").read_text()
    assert R.read_cache(copy).inputs == R.proof_inputs(changed_config, plan)


def test_an_edited_wattgate_or_another_torch_reruns_the_proof(proof_run, first, tmp_path, monkeypatch):
    pretokenized, plan, config = proof_run
    out, _ = first
    inputs = R.read_cache(out).inputs
    for key, value in (("wattgate_source_sha256", "0" * 64), ("torch", "0.0.1")):
        copy = tmp_path / key / "gate"
        copy.mkdir(parents=True)
        kept = json.loads((out / PROOF_CACHE).read_text())
        kept["inputs"] = dict(inputs, **{key: value})
        (copy / PROOF_CACHE).write_text(json.dumps(kept))
        monkeypatch.setattr(
            "wattgate.proof.prove.safe_prove", lambda *a: Collectives(passed=True, detail="ran", elapsed_s=1.0)
        )
        proof = proof_of(run_gate(config, pretokenized, plan, copy).to_json())
        assert proof["detail"] == "ran" and proof["changed_inputs"] == [key]


def test_a_damaged_kept_proof_is_proved_again_and_a_broken_dry_run_is_not_kept(proof_run, tmp_path, monkeypatch):
    pretokenized, plan, config = proof_run
    out = tmp_path / "gate"
    out.mkdir()
    (out / PROOF_CACHE).write_text("{not json")
    monkeypatch.setattr(
        "wattgate.proof.prove.safe_prove",
        lambda *a: Collectives(passed=False, detail="the dry run failed: OSError: disk", elapsed_s=None),
    )
    report = run_gate(config, pretokenized, plan, out).to_json()
    assert not report["passed"] and proof_of(report)["changed_inputs"] is None
    assert (out / PROOF_CACHE).read_text() == "{not json"  # the broken dry run was not kept over it


def test_a_reused_proof_imports_no_torch(proof_run, first):
    pretokenized, plan, config = proof_run
    out, _ = first
    cfg = out.parent / "config.yaml"
    cfg.write_text(yaml.safe_dump(config.to_json()))
    kept = json.loads((out / PROOF_CACHE).read_text())  # inputs as of now: a checkout edited meanwhile is another
    R.source_sha256.cache_clear()
    (out / PROOF_CACHE).write_text(json.dumps(dict(kept, inputs=R.proof_inputs(config, plan))))
    code = (
        "import sys, time; from pathlib import Path; from wattgate.config import load_run_config; "
        f"from wattgate.gate.run import run_gate; c = load_run_config({str(cfg)!r}); t = time.perf_counter(); "
        f"r = run_gate(c, Path({str(pretokenized)!r}), Path({str(plan)!r}), Path({str(out)!r})); "
        "print(r.collectives.reused is not None, 'torch' in sys.modules, round(time.perf_counter() - t, 2))"
    )
    reused, torch_loaded, seconds = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert (reused, torch_loaded) == ("True", "False"), seconds

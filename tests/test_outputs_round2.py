"""Never delete what the user made, round two (issue 25, section 4): `load-check --out` honours the
`.wattgate-output` guard, and an export never touches a `final.old/` it did not make."""

import os
import subprocess
import sys

import yaml

from conftest import REPO, TINY


def _load_check(tmp_path, out) -> subprocess.CompletedProcess:
    cfg = tmp_path / "lc.yaml"
    cfg.write_text(yaml.safe_dump({"run_name": "t", "model": {"config": TINY}, "cluster": {"gpus_per_node": 1}}))
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "wattgate", "load-check", "--config", str(cfg), "--out", str(out), "--export"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


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

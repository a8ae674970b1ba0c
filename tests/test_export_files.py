"""final/'s tokenizer: the manifest records where it is (relative to the pretokenized folder when both are in one
results/, so a moved results/ reads its own; else absolute), and the export verifies the tokenizer by the
manifest's hash and refuses a final/ without it."""

import json
import shutil

import pytest

from conftest import write_jsonl
from wattgate.data.pretokenize import pretokenize
from wattgate.data.tokenizer import TOKENIZER_FILES, tokenizer_sha256
from wattgate.errors import InputError
from wattgate.train.export_files import export_extra_files


@pytest.fixture
def made(tmp_path, make_config, tokenizer_dir, monkeypatch):
    """Pretokenized data made from `tmp_path/work` with a relative tokenizer path, as Snakemake runs it."""
    work = tmp_path / "work"
    shutil.copytree(tokenizer_dir, work / "results/tokenizer")
    corpus = write_jsonl(work / "c.jsonl", [{"text": f"The quick brown fox {i}."} for i in range(5)])
    monkeypatch.chdir(work)
    config = make_config(data={"inputs": [str(corpus)]})
    pretokenize(config, "results/tokenizer", work / "results/pretokenized", progress=False)
    monkeypatch.chdir(tmp_path)  # the export runs from elsewhere
    return work


def _manifest(work) -> dict:
    return json.loads((work / "results/pretokenized/manifest.json").read_text())


def test_a_tokenizer_in_the_same_results_is_recorded_relative_and_a_moved_results_reads_its_own(made, tmp_path):
    assert _manifest(made)["tokenizer_path"] == "../tokenizer"
    moved = shutil.copytree(made / "results", tmp_path / "elsewhere" / "results")
    shutil.rmtree(made / "results/tokenizer")  # the original is gone: the copy must not need it
    files = export_extra_files(moved / "pretokenized", {})
    assert files and all(p.parent == (moved / "tokenizer").resolve() for p in files)


def test_a_tokenizer_outside_results_is_recorded_absolute_and_resolved(tmp_path, make_config, tokenizer_dir):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": f"The quick brown fox {i}."} for i in range(5)])
    config = make_config(data={"inputs": [str(corpus)]})
    pretokenize(config, tokenizer_dir, tmp_path / "work" / "results" / "pretokenized", progress=False)
    manifest = json.loads((tmp_path / "work/results/pretokenized/manifest.json").read_text())
    assert manifest["tokenizer_path"] == str(tokenizer_dir.resolve())


def test_the_export_finds_the_tokenizer_from_another_directory_and_adds_generation_config(made, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text('{"eos_token_id": 2}')
    files = export_extra_files(made / "results/pretokenized", {"path": str(model)})
    names = [p.name for p in files]
    assert names[-1] == "generation_config.json" and set(names[:-1]) <= set(TOKENIZER_FILES)
    assert "tokenizer.json" in names
    assert tokenizer_sha256(files[0].parent) == _manifest(made)["tokenizer_sha256"]
    assert export_extra_files(made / "results/pretokenized", {"config": {}}) == files[:-1]


def test_a_moved_tokenizer_is_an_error_naming_the_folder(made):
    (made / "results/tokenizer").rename(made / "results/tokenizer.moved")
    with pytest.raises(InputError, match=r"results/tokenizer: the tokenizer pretokenize used .* is gone"):
        export_extra_files(made / "results/pretokenized", {})


def test_a_changed_tokenizer_is_an_error(made):
    config = made / "results/tokenizer/tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 7}', 1))
    with pytest.raises(InputError, match=r"results/tokenizer: the tokenizer files changed since pretokenize"):
        export_extra_files(made / "results/pretokenized", {})


def test_a_manifest_without_the_tokenizer_hash_is_an_error(made):
    path = made / "results/pretokenized/manifest.json"
    manifest = _manifest(made)
    del manifest["tokenizer_sha256"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"manifest\.json: no tokenizer_path and tokenizer_sha256; rerun pretokenize"):
        export_extra_files(made / "results/pretokenized", {})

"""Weighted data mixtures: exact per-source shares in plan.json, world-size invariance, the gate's per-source proof."""

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from wattgate.config import run_config
from wattgate.data.mixture import parse_sources, source_name
from wattgate.data.pretokenize import split_for
from wattgate.data.split import validation_split
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.gate.inputs import load_inputs
from wattgate.gate.memory import estimate_memory
from wattgate.gate.mixture_checks import MixtureInputs, cross_source_duplicates, mixture_markdown
from wattgate.gate.run import fit_settings, run_checks
from wattgate.model_spec import load_model_spec
from wattgate.pack.plan import build_plan

from conftest import TINY_MODEL

# 0.6 / 0.3 / 0.1 over the weighted sources, "rare" far smaller than its share (upsampled ~4.5x),
# "replay" seen 2.5 times per epoch
SOURCES = [("chat", 600), ("domain", 300), ("rare", 20), ("replay", 100)]
MIXTURE = [
    {"path": "chat.jsonl", "name": "chat", "weight": 0.6},
    {"path": "domain.jsonl", "name": "domain", "weight": 0.3},
    {"path": "rare.jsonl", "name": "rare", "weight": 0.1},
    {"path": "replay.jsonl", "name": "replay", "epochs": 2.5},
]


def mixture_config(world: int, inputs=MIXTURE, **data):
    return run_config(
        {
            "data": {"inputs": inputs, "max_repeats": 10, **data},
            "train": {"seq_len": 256, "micro_batch_size": 1, "grad_accum": 2, "epochs": 3, "warmup_steps": 1},
            "cluster": {"nodes": 1, "gpus_per_node": world},
            "model": {"config": TINY_MODEL},
        }
    )


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory):
    work = tmp_path_factory.mktemp("mixture")
    lengths = np.random.default_rng(3).integers(5, 120, sum(n for _, n in SOURCES))
    return write_random_pretokenized(work / "pre", lengths, 500, sources=SOURCES, validation_fraction=0.05)


@pytest.fixture(scope="module")
def plans(pretokenized, tmp_path_factory):
    work = tmp_path_factory.mktemp("plans")
    return {
        w: (mixture_config(w), build_plan(mixture_config(w), pretokenized, work / f"plan{w}"), work / f"plan{w}")
        for w in (2, 3)
    }


def chosen_per_epoch(plan_dir, manifest):
    """Per epoch and source, the sorted doc_ids packs.parquet holds (repeats included)."""
    t = pq.read_table(plan_dir / "packs.parquet", columns=["epoch", "doc_ids"]).to_pydict()
    out = {}
    ranges = manifest["source_docs"]
    for epoch, docs in zip(t["epoch"], t["doc_ids"]):
        for d in docs:
            name = next(r["name"] for r in ranges if r["first_doc"] <= d < r["end_doc"])
            out.setdefault((epoch, name), []).append(d)
    return {k: sorted(v) for k, v in out.items()}


def test_shares_match_the_weights_within_one_document_per_epoch(plans, pretokenized):
    _, plan, _ = plans[2]
    manifest = json.loads((pretokenized / "manifest.json").read_text())
    lengths = np.concatenate(
        [pq.read_table(pretokenized / s, columns=["num_tokens"]).column(0).to_numpy() for s in manifest["shards"]]
    )
    rows = {r["name"]: r for r in plan.mixture.to_json()["sources"]}
    weighted = sum(rows[n]["train_tokens"] for n in ("chat", "domain", "rare"))
    for name, share in (("chat", 0.6), ("domain", 0.3), ("rare", 0.1)):
        r = next(x for x in manifest["source_docs"] if x["name"] == name)
        longest = int(lengths[r["first_doc"] : r["end_doc"]].max())
        for e in rows[name]["per_epoch"]:
            assert abs(e["tokens"] - share * weighted) <= longest
    assert rows["rare"]["repeats"] > 4  # far smaller than its share: upsampled by whole documents
    replay = rows["replay"]
    assert all(abs(e["tokens"] - 2.5 * replay["train_tokens"]) <= 120 for e in replay["per_epoch"])
    # the downsampled source cycles through its documents before repeating any
    assert rows["chat"]["repeats"] < 1
    assert all(e["docs"] == e["distinct_docs"] for e in rows["chat"]["per_epoch"])


def test_the_same_mixture_on_2_and_3_ranks_selects_the_same_documents(plans, pretokenized):
    manifest = json.loads((pretokenized / "manifest.json").read_text())
    a, b = (chosen_per_epoch(plans[w][2], manifest) for w in (2, 3))
    assert a == b
    assert plans[2][1].mixture == plans[3][1].mixture
    # the shards alone count the shares: the source column names each document's source
    names = pq.read_table(pretokenized / manifest["shards"][0], columns=["source"]).column(0).to_pylist()
    assert names[0] == "chat"


def verdicts(inputs):
    spec = load_model_spec(inputs.config)
    return {c.name: c for c in run_checks(inputs, spec, estimate_memory(spec, fit_settings(inputs.config)))}


def test_gate_passes_and_a_dropped_document_fails_naming_its_source(plans, pretokenized, tmp_path):
    config, plan, plan_dir = plans[2]
    inputs = load_inputs(config, pretokenized, plan_dir, tmp_path / "ckpt")
    v = verdicts(inputs)
    assert v["conservation"].passed, v["conservation"].detail
    assert v["leakage"].passed, v["leakage"].detail
    # drop one document of "rare" from one pack row
    p = inputs.packs
    manifest = inputs.manifest
    rare = next(r for r in manifest.source_docs if r.name == "rare")
    entry = int(np.flatnonzero((p.doc_ids >= rare.first_doc) & (p.doc_ids < rare.end_doc))[0])
    row = int(np.searchsorted(p.offsets, entry, side="right") - 1)
    keep = np.ones(len(p.doc_ids), dtype=bool)
    keep[entry] = False
    offsets = p.offsets.copy()
    offsets[row + 1 :] -= 1
    packs = dataclasses.replace(
        p, doc_ids=p.doc_ids[keep], doc_lengths=p.doc_lengths[keep], offsets=offsets, length_offsets=offsets
    )
    broken = dataclasses.replace(inputs, packs=packs)
    check = verdicts(broken)["conservation"]
    assert not check.passed
    assert "source 'rare'" in check.detail


def test_gate_md_shows_the_mixture_table(plans):
    lines = mixture_markdown(plans[2][1].mixture)
    assert "| rare | weight 0.1 | 0.0" in "\n".join(lines)


@pytest.mark.parametrize(
    "inputs, message",
    [
        (
            [{"path": "a.jsonl", "name": "a", "weight": 1}, {"path": "./a.jsonl", "name": "b", "weight": 1}],
            r"sources 'a' and 'b' are the same file",
        ),
        (
            [{"path": "a.jsonl", "name": "a", "weight": 1}, {"path": "b.jsonl", "name": "a", "weight": 1}],
            r"two sources named 'a'",
        ),
        (
            [{"path": "a.jsonl", "name": "a", "weight": 1, "epochs": 2}],
            r"source 'a'\): weight and epochs given together",
        ),
    ],
)
def test_bad_mixtures_are_one_line_naming_the_source(inputs, message):
    with pytest.raises(InputError, match=message) as err:
        parse_sources(mixture_config(2, inputs))
    assert "\n" not in str(err.value)


def test_a_weight_past_max_repeats_is_refused_naming_the_source(pretokenized, tmp_path):
    config = mixture_config(2, max_repeats=2)
    with pytest.raises(InputError, match=r"source 'rare'.*more than data.max_repeats 2") as err:
        build_plan(config, pretokenized, tmp_path / "plan")
    assert "\n" not in str(err.value)


def test_plain_paths_are_sources_named_for_their_stem():
    assert source_name("data/chat.jsonl.gz") == "chat"
    assert source_name("data/corpus.parquet") == "corpus"
    assert [s.name for s in parse_sources(run_config({"data": {"inputs": ["x/a.jsonl", "b.json"]}}))] == ["a", "b"]


def test_a_document_in_two_sources_is_reported_once():
    mix = MixtureInputs(["a", "b"], np.array([0, 3]), np.array([3, 6]), np.zeros(2), np.zeros(2), {"sources": []}, ())
    hashes = np.array([11, 12, 13, 12, 14, 11], dtype=np.int64)  # 12 and 11 in both sources
    note = cross_source_duplicates(mix, hashes)
    assert note.startswith("2 document(s) appear in two sources (counted once)")
    assert "of 'a' = doc_id" in note and "of 'b'" in note
    assert cross_source_duplicates(mix, np.arange(6, dtype=np.int64)) == ""


def test_epochs_with_different_documents_get_the_same_steps(plans):
    for _, plan, _ in plans.values():
        steps = {s for rank in plan.stats.per_rank_steps_per_epoch for s in rank}
        assert steps == {plan.steps_per_epoch}
        chat = next(r for r in plan.mixture.sources if r.name == "chat")
        assert len({e.doc_ids_sha256 for e in chat.per_epoch}) == 3  # downsampled: other documents each epoch


@pytest.mark.parametrize("new_world", [2, 3])  # 2: each step keeps its packs; 3: the rest re-packed
def test_a_resized_mixture_keeps_every_source_count_exact(tmp_path, new_world):
    from support.runs import config_for

    from wattgate.gate.run import run_gate
    from wattgate.identity import run_identity

    lengths = np.random.default_rng(5).integers(8, 60, 160)
    pretok = write_random_pretokenized(tmp_path / "pretokenized", lengths, 96, 0, sources=[("a", 120), ("b", 40)])
    mixture = [{"path": "a.jsonl", "name": "a", "weight": 0.5}, {"path": "b.jsonl", "name": "b", "weight": 0.5}]

    def config(gpus):
        c = config_for(gpus, epochs=3).to_json()
        c["data"]["inputs"] = mixture
        return run_config(c)

    plan_dir = tmp_path / "plan"
    plan = build_plan(config(4), pretok, plan_dir)
    folder = tmp_path / "train" / "t" / "checkpoints" / "step-2"
    folder.mkdir(parents=True)
    position = {"epoch": 0, "step": 2, "plan": plan.packs_sha256}
    state = {
        "step": 2,
        "position": position,
        "files": {},
        "hash_algorithm": "xxh3_128",
        "identity": run_identity(config(4), plan_dir, pretok).to_json(),
    }
    (folder / "state.json").write_text(json.dumps(state))
    continued = build_plan(config(new_world), pretok, plan_dir)
    assert [s.world_size for s in continued.segments] == [4, new_world]
    assert continued.mixture == plan.mixture
    report = run_gate(config(new_world), pretok, plan_dir, tmp_path / "gate").to_json()
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("conservation", "equal_steps", "segments"):
        assert checks[name]["passed"], checks[name]["detail"]
    assert "2 sources" in checks["conservation"]["detail"]


def test_pretokenize_names_each_document_source_and_refuses_an_empty_source(tmp_path, tokenizer_dir, demo_docs):
    from conftest import write_jsonl

    from wattgate.data.pretokenize import pretokenize

    chat = write_jsonl(tmp_path / "chat.jsonl", demo_docs[:30])
    prose = write_jsonl(tmp_path / "prose.jsonl", [{"text": f"plain text number {i}"} for i in range(12)])
    mixture = [{"path": str(chat), "name": "chat", "weight": 0.7}, {"path": str(prose), "name": "prose", "weight": 0.3}]
    config = run_config({"data": {"inputs": mixture, "validation": {"fraction": 0.2}}, "train": {"seq_len": 512}})
    manifest = pretokenize(config, tokenizer_dir, tmp_path / "out", progress=False)
    names = pq.read_table(tmp_path / "out" / manifest.shards[0], columns=["source"]).column(0).to_pylist()
    ranges = {r.name: (r.first_doc, r.end_doc) for r in manifest.source_docs}
    assert ranges == {"chat": (0, 30), "prose": (30, 42)}
    assert names == ["chat"] * 30 + ["prose"] * 12
    assert manifest.source_docs[0].weight == 0.7
    per_source = {r.name: r for r in manifest.validation.per_source}
    assert sum(r.num_docs for r in per_source.values()) == manifest.validation.num_docs
    assert per_source["prose"].fraction == 0.2
    plan = build_plan(config, tmp_path / "out", tmp_path / "plan")  # and pack plans from it
    assert [r.name for r in plan.mixture.sources] == ["chat", "prose"]
    # a plain list names each source for its file stem
    plain = run_config({"data": {"inputs": [str(chat), str(prose)]}, "train": {"seq_len": 512}})
    again = pretokenize(plain, tokenizer_dir, tmp_path / "plain", progress=False)
    assert [r.name for r in again.source_docs] == ["chat", "prose"]

    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    bad = run_config(
        {
            "data": {"inputs": mixture + [{"path": str(empty), "name": "nothing", "weight": 0.1}]},
            "train": {"seq_len": 512},
        }
    )
    with pytest.raises(InputError, match=r"source 'nothing'.*no document survived") as err:
        pretokenize(bad, tokenizer_dir, tmp_path / "bad", progress=False)
    assert "\n" not in str(err.value)


def test_a_mixture_plan_is_byte_identical_on_rerun(plans, pretokenized, tmp_path):
    config, plan, plan_dir = plans[2]
    again = build_plan(config, pretokenized, tmp_path / "again")
    assert again.packs_sha256 == plan.packs_sha256
    assert (tmp_path / "again" / "plan.json").read_bytes() == (plan_dir / "plan.json").read_bytes()


def test_remainder_drop_is_refused_with_a_mixture(pretokenized, tmp_path):
    config = mixture_config(2)
    config = config.replace(pack=config.pack.replace(remainder="drop"))
    with pytest.raises(InputError, match=r"pack.remainder: drop .* use rebin with a mixture"):
        build_plan(config, pretokenized, tmp_path / "plan")


def test_a_manifest_without_a_source_range_fails_the_gate_not_with_a_traceback(plans, pretokenized, tmp_path):
    config, _, plan_dir = plans[2]
    inputs = load_inputs(config, pretokenized, plan_dir, tmp_path / "ckpt")
    manifest = inputs.manifest.replace(source_docs=tuple(r for r in inputs.manifest.source_docs if r.name == "chat"))
    check = verdicts(dataclasses.replace(inputs, manifest=manifest))["conservation"]
    assert not check.passed and "source 'domain' has no doc_id range" in check.detail


# ---------------------------------------------------------------- seen: a validation loss per source


def eval_rows(sources=("chat", "notes")):
    """Three validation passes as train writes them with two held-out sources: chat's best pass is the second,
    notes' the last."""
    per_source = {"chat": [3.0, 2.5, 2.6], "notes": [4.0, 3.0, 2.0]}
    rows = []
    for k, step in enumerate((10, 20, 30)):
        row = {"step": step, "epoch": 0, "loss": 3.0 - 0.2 * k, "perplexity": 1.0, "tokens": 300, "seconds": 0.1}
        for name in sources:
            row |= {f"loss/{name}": per_source[name][k], f"tokens/{name}": 200 if name == "chat" else 100}
        rows.append(row | {"time": 1.0 + k})
    return rows


def test_eval_parquet_holds_each_source_after_the_whole_and_resumes_with_it(tmp_path):
    from wattgate.run_tables import EVAL_SCHEMA, EvalTable, eval_sources_of, read_eval

    table = EvalTable(tmp_path / "eval.parquet", eval_rows(), ("chat", "notes"))
    table.flush()
    written = pq.read_schema(tmp_path / "eval.parquet")
    assert written.names == [*EVAL_SCHEMA.names, "loss/chat", "tokens/chat", "loss/notes", "tokens/notes"]
    assert eval_sources_of(read_eval(tmp_path).columns) == ["chat", "notes"]
    resumed = EvalTable.resume(tmp_path / "eval.parquet", 20, ("chat", "notes"))
    assert [r["step"] for r in resumed.rows] == [10, 20] and resumed.rows[1]["loss/chat"] == 2.5


def test_trained_gives_each_source_its_final_and_best_validation_loss():
    from wattgate.train.metrics import validation_summary

    v = validation_summary(eval_rows(), 30, "last")
    assert v.final_loss == pytest.approx(2.6) and v.best_step == 30
    assert v.to_json()["per_source"] == [
        {"name": "chat", "final_loss": 2.6, "tokens": 200, "best_loss": 2.5, "best_step": 20},
        {"name": "notes", "final_loss": 2.0, "tokens": 100, "best_loss": 2.0, "best_step": 30},
    ]
    assert "per_source" not in validation_summary(eval_rows(sources=()), 30, "last").to_json()  # one source: as before


def test_tensorboard_writes_eval_loss_per_source(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from wattgate.run_tables import MetricsTable
    from wattgate.train.metrics import StepLog

    log = StepLog(MetricsTable(tmp_path / "metrics.parquet"), 100, 1000, 2, "cpu", False)
    for row in eval_rows():
        log.record_eval(row)
    log.close()
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert {"eval/loss", "eval/loss/chat", "eval/loss/notes"} <= set(board.Tags()["scalars"])
    assert [(e.step, e.value) for e in board.Scalars("eval/loss/notes")] == [(10, 4.0), (20, 3.0), (30, 2.0)]


def test_the_report_draws_and_tabulates_a_validation_curve_per_source():
    import pandas as pd

    from wattgate.report.loss_figure import SOURCE_COLORS, loss_figure
    from wattgate.report.html import validation_section as validation_html
    from wattgate.report.steps import validation_section

    evals = pd.DataFrame(eval_rows())
    section = validation_section(evals)
    assert section.sources == ("chat", "notes")
    assert section.final.per_source == {"chat": 2.6, "notes": 2.0}
    curves = {t["name"]: t for t in loss_figure(None, evals)["data"]}
    assert list(curves) == ["validation", "validation: chat", "validation: notes"]
    for name, color in zip(("chat", "notes"), SOURCE_COLORS):
        line = curves[f"validation: {name}"]["line"]
        assert line == {"color": color, "dash": "dash", "width": 1.6}
    assert curves["validation: notes"]["x"] == [10.0, 20.0, 30.0] and curves["validation: notes"]["y"] == [4, 3, 2]
    page = validation_html(section)
    assert '<th class="n">loss: chat</th>' in page and '<th class="n">loss: notes</th>' in page
    # one source: the figure and the table as before, no per-source curve or column
    single = pd.DataFrame(eval_rows(sources=()))
    assert [t["name"] for t in loss_figure(None, single)["data"]] == ["validation"]
    plain = validation_section(single)
    written = plain.to_json()
    assert "sources" not in written and "per_source" not in written["final"]
    assert "loss: " not in validation_html(plain)


def test_a_sources_own_carve_overrides_only_what_it_gives_and_a_null_cap_is_no_cap():
    config = run_config(
        {
            "data": {
                "inputs": [
                    {"path": "a.jsonl", "name": "a", "weight": 1, "validation": {"max_docs": None, "seed": 3}},
                    {"path": "b.jsonl", "name": "b", "weight": 1, "validation": {"fraction": 0.2}},
                    {"path": "c.jsonl", "name": "c", "weight": 1},
                ],
                "validation": {"fraction": 0.1, "max_docs": 5, "seed": 1},
            }
        }
    )
    split = validation_split(config.data.validation)
    a, b, c = (split_for(split, s) for s in parse_sources(config))
    assert (a.fraction, a.max_docs, a.seed) == (0.1, None, 3)  # max_docs: null given: no cap for this source
    assert (b.fraction, b.max_docs, b.seed) == (0.2, 5, 1)
    assert (c.fraction, c.max_docs, c.seed) == (0.1, 5, 1)


@pytest.mark.parametrize("second", ["./a.jsonl", "link.jsonl", "copy.jsonl"])
def test_a_plain_list_naming_one_file_twice_is_refused_by_path_or_content(tmp_path, tokenizer_dir, capsys, second):
    """A file listed twice (by another spelling, through a link, or as a copy) would train each of its documents
    twice while the gate counts every document once."""
    import os
    import shutil

    import yaml

    from wattgate.cli import main
    from wattgate.data.demo_corpus import write_demo_corpus

    write_demo_corpus(tmp_path / "a.jsonl", num_docs=20, seed=1, max_turns=2)
    os.symlink(tmp_path / "a.jsonl", tmp_path / "link.jsonl")
    shutil.copy(tmp_path / "a.jsonl", tmp_path / "copy.jsonl")
    write_demo_corpus(tmp_path / "b.jsonl", num_docs=20, seed=2, max_turns=2)  # another file: kept
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), os.path.normpath(str(tmp_path / second))]
    if second == "./a.jsonl":
        inputs[2] = f"{tmp_path}/./a.jsonl"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"data": {"inputs": inputs}, "tokenizer": {"path": str(tokenizer_dir)}}))
    rc = main(["pretokenize", "--config", str(config), "--out", str(tmp_path / "pretokenized")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not (tmp_path / "pretokenized").exists()
    assert "data.inputs[2]" in err[-1] and "data.inputs[0]" in err[-1] and "list" in err[-1], err
    assert "Traceback" not in "\n".join(err)
    # two different files pretokenize as before
    config.write_text(yaml.safe_dump({"data": {"inputs": inputs[:2]}, "tokenizer": {"path": str(tokenizer_dir)}}))
    assert main(["pretokenize", "--config", str(config), "--out", str(tmp_path / "pretokenized")]) == 0

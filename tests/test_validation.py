"""The validation split, its planned pass and the gate's proof of it (data/split.py, pack/validation.py,
gate/validation_checks.py), on real pretokenized data and on hand-broken plans."""

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wattgate.cadence import Cadence, eval_steps, step_actions
from wattgate.config import run_config
from wattgate.data.pretokenize import pretokenize
from wattgate.data.split import carve, doc_ids_sha256, read_validation_ids
from wattgate.errors import InputError
from wattgate.gate import validation_checks as V
from wattgate.gate.inputs import load_inputs
from wattgate.gate.run import run_gate
from wattgate.pack.plan import build_plan
from wattgate.pack.validation import plan_validation
from wattgate.run_files import EVAL_PACKS, read_manifest

from conftest import write_jsonl
from conftest import TINY_MODEL  # the gate tests' tiny Qwen3


def config_for(inputs, validation, gpus=2, **train):
    return run_config(
        {
            "data": {"inputs": [str(p) for p in inputs], "validation": validation},
            "pretokenize": {"shard_docs": train.pop("shard_docs", 200000)},
            "train": {"seq_len": 256, "micro_batch_size": 2, "grad_accum": 1, "epochs": 1, "warmup_steps": 1} | train,
            "cluster": {"nodes": 1, "gpus_per_node": gpus},
            "model": {"config": TINY_MODEL},
        }
    )


def held_out_texts(pre) -> set[tuple[int, ...]]:
    """The token ids of every held-out document (what the split holds, whatever its doc_ids)."""
    manifest, _ = read_manifest(pre)
    held = set(read_validation_ids(pre, manifest).tolist())
    out = set()
    for name in manifest.shards:
        t = pq.read_table(pre / name, columns=["doc_id", "input_ids"]).to_pydict()
        out |= {tuple(ids) for d, ids in zip(t["doc_id"], t["input_ids"]) if d in held}
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_docs):
    work = tmp_path_factory.mktemp("validation")
    return work, write_jsonl(work / "c.jsonl", demo_docs)


def test_carve_depends_on_content_and_seed_only_and_keeps_duplicates_together(corpus, tokenizer_dir, demo_docs):
    work, path = corpus
    base = pretokenize(config_for([path], {"fraction": 0.2}), tokenizer_dir, work / "a", progress=False)
    # reversed order, tiny shards, and every document twice: the same contents are held out
    doubled = write_jsonl(work / "doubled.jsonl", list(reversed(demo_docs)) * 2)
    cfg = config_for([doubled], {"fraction": 0.2}, shard_docs=37)
    other = pretokenize(cfg, tokenizer_dir, work / "b", progress=False)
    assert held_out_texts(work / "a") == held_out_texts(work / "b")
    assert other.validation.copies_of_train == 0  # each copy is on its twin's side
    assert other.validation.num_docs == 2 * base.validation.num_docs
    assert 0.1 < base.validation.num_docs / base.num_docs < 0.3
    reseeded = pretokenize(config_for([path], {"fraction": 0.2, "seed": 7}), tokenizer_dir, work / "c", progress=False)
    assert held_out_texts(work / "c") != held_out_texts(work / "a")
    assert reseeded.validation.doc_ids_sha256 != base.validation.doc_ids_sha256


def test_max_docs_takes_whole_duplicate_groups_and_no_more():
    hashes = np.array([5, 5, 5, 9, 11, 13, 17, 19], dtype=np.int64)
    for cap in range(1, 9):
        chosen = carve(hashes, 0.0, cap, seed=3)
        assert chosen.sum() <= cap
        for h in np.unique(hashes):  # a content is held out whole or not at all
            assert len(set(chosen[hashes == h].tolist())) == 1
    assert carve(hashes, 0.0, 8, seed=3).all()


def test_manifest_records_the_split_and_its_hash(corpus, tokenizer_dir):
    work, path = corpus
    m = pretokenize(config_for([path], {"max_docs": 25}), tokenizer_dir, work / "m", progress=False)
    v = m.validation
    ids = read_validation_ids(work / "m", m)
    assert v.num_docs == len(ids) <= 25 and v.doc_ids_sha256 == doc_ids_sha256(ids)
    assert v.train_docs + v.num_docs == m.num_docs
    assert v.train_tokens + v.num_tokens == m.num_tokens


def test_bad_splits_are_one_line_errors(corpus, tokenizer_dir, demo_docs):
    work, path = corpus
    val = write_jsonl(work / "val.jsonl", demo_docs[:5])
    with pytest.raises(InputError, match="inputs .* and fraction 0.1 given together"):
        pretokenize(config_for([path], {"fraction": 0.1, "inputs": [str(val)]}), tokenizer_dir, work / "x")
    with pytest.raises(InputError, match="holds out none; raise data.validation.fraction"):
        pretokenize(config_for([path], {"fraction": 1e-9}), tokenizer_dir, work / "x", progress=False)
    with pytest.raises(InputError, match="leaves no training document"):
        pretokenize(config_for([path], {"fraction": 0.9999999}), tokenizer_dir, work / "x", progress=False)
    with pytest.raises(InputError, match="all 5 documents are exact copies of training documents"):
        pretokenize(config_for([path], {"inputs": [str(val)]}), tokenizer_dir, work / "x", progress=False)
    assert not (work / "x").exists()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 256), min_size=1, max_size=120),
    st.integers(1, 7),
    st.integers(1, 3),
)
def test_every_rank_gets_the_same_micro_batches_and_every_document_once(lengths, world, mbs):
    lengths = np.array(lengths, dtype=np.int64)
    held = np.arange(0, len(lengths), 2, dtype=np.int64)  # every other document is held out
    vplan = plan_validation(held, lengths, 256, world, mbs, seed=0, attn_weight=1e-5)
    p = vplan.placement
    counts = [len(np.unique(p.micro[p.rank == r])) for r in range(world)]
    assert len(set(counts)) == 1 and counts[0] == vplan.stats.micro_batches_per_rank
    per_micro = np.unique(p.rank * 10_000 + p.micro, return_counts=True)[1]
    assert (per_micro == mbs).all()
    assert sorted(vplan.packs.docs.tolist()) == held.tolist()
    assert (vplan.tokens <= 256).all()


def test_fewer_documents_than_ranks_get_empty_packs():
    vplan = plan_validation(
        np.array([0, 1]), np.array([10, 20]), 64, world_size=4, micro_batch_size=1, seed=0, attn_weight=0
    )
    assert vplan.stats.empty_packs == 2 and vplan.stats.strategy == "one document per pack+empty packs"
    assert sorted(vplan.packs.docs.tolist()) == [0, 1]


@pytest.fixture(scope="module")
def split_run(corpus, tokenizer_dir):
    work, path = corpus
    config = config_for([path], {"fraction": 0.15}, gpus=3, checkpoint_every=5, eval_micro_batch_size=1)
    pretokenize(config, tokenizer_dir, work / "pre", progress=False)
    build_plan(config, work / "pre", work / "plan")
    return config, work


def test_plan_reports_validation_beside_training_and_the_gate_passes(split_run, tmp_path):
    config, work = split_run
    plan = json.loads((work / "plan" / "plan.json").read_text())
    v, manifest = plan["validation"], json.loads((work / "pre" / "manifest.json").read_text())
    assert v["num_docs"] == manifest["validation"]["num_docs"] and v["micro_batch_size"] == 1
    assert plan["stats"]["num_docs"] == manifest["validation"]["train_docs"]
    report = run_gate(config, work / "pre", work / "plan", tmp_path / "gate").to_json()
    checks = {c["name"]: c for c in report["checks"]}
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert "held out for validation" in checks["conservation"]["detail"]
    assert checks["leakage"]["passed"] and checks["validation_steps"]["passed"]


def one_more_micro_batch(packs, rank):
    """The pass with a copy of `rank`'s first pack run as an extra micro-batch of its own on that rank."""
    row = int(np.flatnonzero(packs.rank == rank)[0])
    docs = packs.doc_ids[packs.offsets[row] : packs.offsets[row + 1]]
    lengths = packs.doc_lengths[packs.offsets[row] : packs.offsets[row + 1]]
    extra = {
        f: np.append(getattr(packs, f), getattr(packs, f)[row]) for f in ("epoch", "step", "rank", "slot", "num_tokens")
    }
    offsets = np.append(packs.offsets, packs.offsets[-1] + len(docs))
    return dataclasses.replace(
        packs,
        **extra,
        micro=np.append(packs.micro, packs.micro.max() + 1),
        doc_ids=np.concatenate([packs.doc_ids, docs]),
        doc_lengths=np.concatenate([packs.doc_lengths, lengths]),
        offsets=offsets,
        length_offsets=offsets,
    )


def test_gate_names_ranks_and_counts_when_a_rank_has_one_more_validation_micro_batch(split_run, tmp_path):
    config, work = split_run
    inputs = load_inputs(config, work / "pre", work / "plan", tmp_path / "ckpt")
    broken = dataclasses.replace(inputs.validation, packs=one_more_micro_batch(inputs.validation.packs, 1))
    check = V.check_validation_steps(broken, 3, 1, inputs.plan.validation.micro_batches_per_rank)
    n = inputs.plan.validation.micro_batches_per_rank
    assert not check.passed
    assert f"validation micro-batches per rank {{0: {n}, 1: {n + 1}, 2: {n}}}" in check.detail
    assert f"rank 1 would run micro-batch {n + 1} of every validation pass alone" in check.detail
    div = V.validation_divergence(broken.packs, 3)
    assert div == V.ValidationParting(micro=n, ranks_with=(1,), ranks_without=(0, 2), per_rank=(n, n + 1, n))


def test_validation_conservation_catches_a_document_twice_and_one_missing(split_run, tmp_path):
    config, work = split_run
    inputs = load_inputs(config, work / "pre", work / "plan", tmp_path / "ckpt")
    packs = inputs.validation.packs
    ids = packs.doc_ids.copy()
    ids[1] = ids[0]
    lengths = packs.doc_lengths.copy()
    lengths[1] = lengths[0]
    broken = dataclasses.replace(inputs.validation, packs=dataclasses.replace(packs, doc_ids=ids, doc_lengths=lengths))
    check = V.check_validation_conservation(broken, inputs.doc_tokens, inputs.manifest.validation, 256)
    assert not check.passed and "more than once" in check.detail and "not in the pass" in check.detail


def test_leakage_catches_a_training_document_copied_into_the_validation_files(
    corpus, tokenizer_dir, demo_docs, tmp_path
):
    work, path = corpus
    val = write_jsonl(tmp_path / "val.jsonl", demo_docs[:1] + [{"text": f"held out {i} " * 8} for i in range(12)])
    config = config_for([path], {"inputs": [str(val)]})
    pretokenize(config, tokenizer_dir, tmp_path / "pre", progress=False)
    build_plan(config, tmp_path / "pre", tmp_path / "plan")
    report = run_gate(config, tmp_path / "pre", tmp_path / "plan", tmp_path / "gate").to_json()
    leakage = next(c for c in report["checks"] if c["name"] == "leakage")
    assert not report["passed"] and not leakage["passed"]
    assert "1 held-out document(s) are exact copies of training documents, e.g. validation doc_id" in leakage["detail"]
    assert not (tmp_path / "gate" / "PASSED").exists()


def test_stale_eval_packs_never_sit_beside_a_plan_without_validation(split_run, tmp_path, corpus, tokenizer_dir):
    work, path = corpus
    config = config_for([path], {})
    pretokenize(config, tokenizer_dir, tmp_path / "pre", progress=False)
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / EVAL_PACKS).write_bytes((split_run[1] / "plan" / EVAL_PACKS).read_bytes())
    plan = build_plan(config, tmp_path / "pre", tmp_path / "plan")
    assert plan.validation is None and not (tmp_path / "plan" / EVAL_PACKS).exists()


def test_the_cadence_evaluates_every_n_steps_at_epoch_ends_and_after_the_last_step():
    c = Cadence(checkpoint_every=4, eval_every=3, validation=True)
    assert eval_steps(10, [5, 10], c) == [3, 5, 6, 9, 10]
    assert eval_steps(10, [5, 10], dataclasses.replace(c, eval_every=0)) == [5, 10]
    assert eval_steps(10, [5, 10], dataclasses.replace(c, validation=False)) == []
    act = step_actions(4, 10, frozenset({5, 10}), c)
    assert act.checkpoint and not act.evaluate and not act.epoch_end


def test_triage_reads_a_validation_pass_from_the_heartbeats_as_compute(tmp_path):
    """A pass of small forward-only micro-batches can sit low in power and between step stamps: the run's own
    heartbeats (phase eval) make it compute, neither data starvation nor a hang; a pass that never ends stays a hang."""
    from wattgate.testing.synthetic_trace import T0, build_trace, gpus_of, job
    from wattgate.triage_tables import shipped_table
    from wattgate.power.triage import load_run_info, triage

    table, gpus = shipped_table("h100"), gpus_of(1, 2)
    synth = build_trace(job(gpus, [("compute", 60), ("data_starvation", 80), ("compute", 60), ("idle", 20)]), table)
    run = tmp_path / "run"
    (run / "heartbeat").mkdir(parents=True)
    for rank, (host, gpu) in enumerate(gpus):
        events = [(T0, "init"), (T0, "train"), (T0 + 60, "eval"), (T0 + 140, "train"), (T0 + 200, "done")]
        lines = [json.dumps({"time": t, "rank": rank, "step": 5, "epoch": 0, "phase": ph}) for t, ph in events]
        (run / "heartbeat" / f"rank-{rank}.events.jsonl").write_text("\n".join(lines) + "\n")
        state = {"rank": rank, "local_rank": gpu, "gpu": None, "host": host, "step": 9, "phase": "done"}
        (run / "heartbeat" / f"rank-{rank}.json").write_text(json.dumps(state | {"time": T0 + 200}))
    plain = triage(synth.table, table, deadlock_after_s=30.0).column("phase").to_numpy(zero_copy_only=False)
    assert (plain[65:135] == "compute").mean() < 0.5  # power alone does not call it compute
    phases = triage(synth.table, table, deadlock_after_s=30.0, run_info=load_run_info(run))
    got = phases.column("phase").to_numpy(zero_copy_only=False)
    start = phases.column("start").to_numpy()
    in_pass = (start >= T0 + 61) & (start < T0 + 139)
    assert set(got[in_pass]) == {"compute"}


def test_pruning_keeps_the_best_validation_checkpoint(tmp_path):
    from wattgate.artifacts import write_json_atomic
    from wattgate.train.checkpoint import best_checkpoint, file_hash, prune

    root = tmp_path / "checkpoints"
    for step, loss in ((3, 2.5), (6, 1.9), (9, None), (12, 2.1)):
        d = root / f"step-{step}"
        d.mkdir(parents=True)
        (d / "x.distcp").write_bytes(b"x")
        position = {"step": step} | ({"eval_loss": loss} if loss is not None else {})
        files = {"x.distcp": {"bytes": 1, "hash": file_hash(d / "x.distcp")}}
        state = {"step": step, "position": position, "files": files, "hash_algorithm": "xxh3_128"}
        write_json_atomic(d / "state.json", state)
    (root / "step-15.tmp").mkdir()  # being written: never the best
    assert best_checkpoint(root).name == "step-6"
    prune(root, 2, best_checkpoint(root))
    assert sorted(p.name for p in root.iterdir()) == ["step-12", "step-15.tmp", "step-6", "step-9"]
    prune(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["step-12", "step-15.tmp", "step-9"]

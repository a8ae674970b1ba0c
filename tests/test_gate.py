"""Each gate check on a plan that breaks exactly its invariant; the memory estimate; the CLI."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from wattgate.cli import main
from wattgate.config import run_config
from wattgate.data.pretokenize import pretokenize
from wattgate.errors import InputError
from wattgate.gate import checks as C
from wattgate.gate import memory as M
from wattgate.gate.conservation_check import Corpus, check_conservation
from wattgate.gate.fit_checks import check_checkpoint_space, check_fit
from wattgate.model_spec import export_dtype_name, largest_local_slice, largest_param, load_model_spec
from wattgate.gate.inputs import load_inputs
from wattgate.gate.memory import GIB, Budget, FitSettings, estimate_memory
from wattgate.model_spec import ModelSpec
from wattgate.records.run_config import RunConfig
from wattgate.gate.run import config_fit_estimate, run_checks, run_gate
from wattgate.pack.plan import build_plan
from wattgate.records.plan import DroppedDocs, PlanStats

from conftest import QWEN3_32B, QWEN3_SETTINGS, TINY_MODEL, without_rows, write_jsonl


@pytest.fixture(scope="module")
def stage_dirs(tmp_path_factory, tokenizer_dir, demo_docs):
    work = tmp_path_factory.mktemp("gate")
    config = run_config(
        {
            "data": {"inputs": [str(write_jsonl(work / "c.jsonl", demo_docs))]},
            "train": {
                "seq_len": 256,
                "micro_batch_size": 2,
                "grad_accum": 2,
                "epochs": 2,
                "warmup_steps": 2,
                "checkpoint_every": 5,
            },
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "model": {"config": TINY_MODEL},
        }
    )
    pretokenize(config, tokenizer_dir, work / "pretokenized", progress=False)
    build_plan(config, work / "pretokenized", work / "plan")
    return config, work


@pytest.fixture
def inputs(stage_dirs, tmp_path):
    config, work = stage_dirs
    return load_inputs(config, work / "pretokenized", work / "plan", tmp_path / "ckpt")


def verdicts(inputs):
    from wattgate.model_spec import load_model_spec
    from wattgate.gate.run import fit_settings

    spec = load_model_spec(inputs.config)
    return {c.name: c for c in run_checks(inputs, spec, estimate_memory(spec, fit_settings(inputs.config)))}


def failed(inputs):
    return sorted(name for name, c in verdicts(inputs).items() if not c.passed)


def test_valid_plan_passes_every_check(inputs):
    assert failed(inputs) == []
    # the nine invariants, segments and the three validation checks (budget and collectives: run_gate adds them)
    assert sorted(verdicts(inputs)) == sorted(
        [
            "equal_steps",
            "pack_contents",
            "conservation",
            "launch",
            "provenance",
            "fit",
            "checkpoint_space",
            "balance",
            "schedule",
            "segments",
            "validation_steps",
            "validation_conservation",
            "leakage",
        ]
    )


def test_equal_steps_names_per_rank_counts_when_a_rank_is_short(inputs):
    p = inputs.packs
    last_of_rank1 = np.flatnonzero((p.epoch == 1) & (p.rank == 1))[-2:]  # its whole last micro-batch
    broken = dataclasses.replace(inputs, packs=without_rows(p, last_of_rank1))
    check = verdicts(broken)["equal_steps"]
    assert not check.passed
    n = int(((p.epoch == 1) & (p.rank == 0)).sum()) // 2
    assert f"epoch 1: ranks differ: micro-batches per rank {{0: {n}, 1: {n - 1}}}" in check.detail
    # its documents are now missing (conservation) and its last step idles (balance); nothing else
    assert failed(broken) == ["balance", "conservation", "equal_steps"]


def test_equal_steps_catches_partial_micro_batches_with_equal_counts(inputs):
    p = inputs.packs
    slot1 = np.flatnonzero((p.epoch == 0) & (p.slot == 1) & (p.step == 0) & (p.micro == 0))
    moved = p.micro.copy()
    moved[slot1] = 7  # same counts per rank, but micro-batch (0, 0) now holds one pack per rank
    check = C.check_equal_steps(dataclasses.replace(p, micro=moved), 2, 2, 2, 2, inputs.plan.steps_per_epoch)
    assert not check.passed and "pack count other than micro_batch_size" in check.detail


def test_equal_steps_catches_micro_batches_moved_between_steps(inputs):
    p = inputs.packs
    # every rank moves (step 1, micro 1) to (step 0, micro 2): equal totals, but 3 + 1 micro-batches per step
    sel = (p.step == 1) & (p.micro == 1)
    step, micro = p.step.copy(), p.micro.copy()
    step[sel], micro[sel] = 0, 2
    check = C.check_equal_steps(dataclasses.replace(p, step=step, micro=micro), 2, 2, 2, 2, inputs.plan.steps_per_epoch)
    assert not check.passed
    assert "outside 0..1 (grad_accum)" in check.detail and "micro-batch count other than grad_accum 2" in check.detail


def test_pack_contents_catches_misaligned_length_lists_without_crashing(inputs):
    p = inputs.packs
    shifted = p.length_offsets.copy()
    shifted[1] -= 1  # row 0 lost its last length to row 1
    check = C.check_pack_contents(
        dataclasses.replace(p, length_offsets=shifted), 256, inputs.doc_tokens, inputs.doc_loss_tokens
    )
    assert not check.passed and "doc_ids and doc_lengths lists differ in length" in check.detail
    short = dataclasses.replace(
        p, doc_lengths=p.doc_lengths[:-1], length_offsets=np.minimum(p.length_offsets, len(p.doc_lengths) - 1)
    )
    assert not C.check_pack_contents(short, 256, inputs.doc_tokens, inputs.doc_loss_tokens).passed


def test_pack_contents_overlong_and_lossless_packs(inputs):
    p = inputs.packs
    tokens = p.num_tokens.copy()
    lengths = p.doc_lengths.copy()
    tokens[0] += 300
    lengths[p.offsets[0]] += 300
    doc = p.doc_ids[p.offsets[0]]
    doc_tokens = inputs.doc_tokens.copy()
    doc_tokens[doc] += 300
    broken = dataclasses.replace(
        inputs, packs=dataclasses.replace(p, num_tokens=tokens, doc_lengths=lengths), doc_tokens=doc_tokens
    )
    check = C.check_pack_contents(broken.packs, 256, broken.doc_tokens, broken.doc_loss_tokens)
    assert not check.passed and "over seq_len 256" in check.detail

    loss = inputs.doc_loss_tokens.copy()
    loss[p.doc_ids[p.offsets[3] : p.offsets[4]]] = 0
    broken = dataclasses.replace(inputs, doc_loss_tokens=loss)
    assert failed(broken) == ["pack_contents"]
    assert "without a loss-bearing token" in verdicts(broken)["pack_contents"].detail


def test_pack_contents_catches_lengths_that_disagree_with_shards(inputs):
    doc_tokens = inputs.doc_tokens.copy()
    doc_tokens[inputs.packs.doc_ids[0]] += 1
    check = C.check_pack_contents(inputs.packs, 256, doc_tokens, inputs.doc_loss_tokens)
    assert not check.passed and "differ from the shards" in check.detail


def test_conservation_duplicate_and_missing_document(inputs):
    p = inputs.packs
    ids = p.doc_ids.copy()
    lengths = p.doc_lengths
    epoch0 = np.repeat(p.epoch, p.docs_per_row) == 0
    # two different documents of equal length: pack contents stay consistent, one doc now appears twice
    first = np.flatnonzero(epoch0)
    a, b = next((i, j) for i in first for j in first if i < j and lengths[i] == lengths[j] and ids[i] != ids[j])
    ids[b] = ids[a]
    broken = dataclasses.replace(inputs, packs=dataclasses.replace(p, doc_ids=ids))
    assert failed(broken) == ["conservation"]
    detail = verdicts(broken)["conservation"].detail
    assert "more than once" in detail and "neither packed nor dropped" in detail


def test_conservation_dropped_without_reason(inputs):
    corpus = Corpus(doc_tokens=inputs.doc_tokens, manifest_tokens=inputs.manifest.num_tokens)
    check = check_conservation(inputs.packs, 2, corpus, PlanStats(dropped={"x": DroppedDocs(docs=3)}))
    assert not check.passed and "reasons account for 3" in check.detail


def test_launch_mismatch(inputs):
    config = inputs.config.replace(cluster=inputs.config.cluster.replace(nodes=2))
    broken = dataclasses.replace(inputs, config=config)
    assert "launch" in failed(broken)
    assert "plan world_size 2 != cluster.nodes x cluster.gpus_per_node 4" in verdicts(broken)["launch"].detail


def test_provenance_edited_packs_stale_manifest_and_small_vocab(inputs):
    assert failed(dataclasses.replace(inputs, packs_sha256="0" * 64)) == ["provenance"]
    assert failed(dataclasses.replace(inputs, manifest_sha256="0" * 64)) == ["provenance"]
    check = C.check_provenance(inputs.plan, inputs.packs_sha256, inputs.manifest_sha256, inputs.manifest, 100)
    assert not check.passed and "does not fit the model's vocab_size 100" in check.detail


H100 = Budget(80 * GIB, "H100 table entry", "rank")


def test_fit_fails_when_estimate_exceeds_memory():
    check = check_fit({"steady": {"activations": 90 * GIB, "runtime_overhead": 3 * GIB}}, {"steady": H100}, 0.1)
    assert not check.passed and "largest term activations" in check.detail
    assert check_fit({"steady": {"activations": 60 * GIB}}, {"steady": H100}, 0.1).passed


def test_checkpoint_space():
    assert not check_checkpoint_space(100 * GIB, 2, 10 * GIB, 200 * GIB, "/scratch").passed
    assert check_checkpoint_space(10 * GIB, 2, 1 * GIB, 200 * GIB, "/scratch").passed


def test_balance_names_the_worst_step(inputs):
    p = inputs.packs
    check = C.check_balance(p, 2, 1e-5, 1.0)
    assert not check.passed and "worst" in check.detail
    # make one rank's packs heavier in one step: double its tokens there
    tokens = p.num_tokens.copy()
    sel = (p.epoch == 0) & (p.step == 3) & (p.rank == 0)
    tokens[sel] *= 3
    check = C.check_balance(dataclasses.replace(p, num_tokens=tokens), 2, 0.0, 1.1)
    assert not check.passed and "(epoch 0 step 3)" in check.detail


def test_schedule(inputs):
    config = inputs.config.replace(train=inputs.config.train.replace(warmup_steps=10_000))
    broken = dataclasses.replace(inputs, config=config)
    assert failed(broken) == ["schedule"]
    config = config.replace(train=config.train.replace(warmup_steps=0, checkpoint_every=10_000))
    broken = dataclasses.replace(inputs, config=config)
    check = verdicts(broken)["schedule"]  # the loop checkpoints at the last step anyway: a note, not a failure
    assert check.passed and "the only checkpoint is the one at the last step" in check.detail


def test_qwen3_32b_on_2x8_b300_estimate_is_plausible():
    spec = ModelSpec.from_hf_config(QWEN3_32B, "qwen3-32b")
    # per layer: q 5120x8192 + k,v 2x5120x1024 + o 8192x5120 + mlp 3x5120x25600 = 487.6M;
    # x 64 layers = 31.2B, + untied embedding and head 2 x 151936 x 5120 = 1.56B: 32.8B (the model card's 32.8B)
    assert 32.5e9 < spec.num_params < 33.0e9
    with_ac = estimate_memory(spec, FitSettings(16, 8192, activation_checkpointing=True, mixed_precision=True))
    # fp32 params + grads + Adam = 16 B/param / 16 ranks = 32.8 GB; bf16 layer inputs 8192 x 64 x 5120 x 2 = 5.4 GB
    # + one recomputed layer 2.8 GB; logits 8192 x 151936 x 10 B = 12.4 GB; gathered params ~5 GB; ~70 GB total
    sharded = with_ac["sharded_params_fp32"] + with_ac["sharded_grads_fp32"] + with_ac["sharded_adam_state_fp32"]
    assert sharded == pytest.approx(32.8e9, rel=0.01)
    assert 55 * GIB < sum(with_ac.values()) < 85 * GIB
    without = estimate_memory(spec, FitSettings(16, 8192, activation_checkpointing=False, mixed_precision=True))
    # all 64 layers keep ~340 KB per token: 8192 x 64 x 340 KB = 178 GB of activations
    assert 160e9 < without["activations"] < 190e9
    assert sum(without.values()) < 288 * GIB  # fits a B300, but not an H100 or H200
    assert sum(without.values()) > 141 * GIB


def test_gate_cli_fails_with_exit_1_and_names_check(stage_dirs, tmp_path, capsys):
    config, work = stage_dirs
    import pyarrow.parquet as pq

    plan = tmp_path / "plan"
    shutil.copytree(work / "plan", plan)
    # a hand edit after packing: the same rows, rewritten in another order
    table = pq.read_table(plan / "packs.parquet")
    pq.write_table(table.take(list(range(1, table.num_rows)) + [0]), plan / "packs.parquet")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config.to_json()))
    out = tmp_path / "gate"
    rc = main(
        [
            "gate",
            "--config",
            str(cfg),
            "--pretokenized",
            str(work / "pretokenized"),
            "--plan",
            str(plan),
            "--out",
            str(out),
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAIL provenance: packs.parquet changed since it was planned" in err
    assert "1 check(s) failed: provenance" in err
    assert not (out / "PASSED").exists() and json.loads((out / "gate.json").read_text())["passed"] is False


def test_gate_writes_passed_and_report(stage_dirs, tmp_path):
    config, work = stage_dirs
    report = run_gate(config, work / "pretokenized", work / "plan", tmp_path / "gate").to_json()
    assert report["passed"] and (tmp_path / "gate/PASSED").exists()
    md = (tmp_path / "gate/gate.md").read_text()
    assert "# Invariant gate: PASSED" in md and "| sharded_params_fp32 |" in md
    assert report["elapsed_s"] - report["collectives"]["elapsed_s"] < 5  # the collective proof states its own time


def test_stale_pass_is_removed_when_the_gate_fails(stage_dirs, tmp_path):
    config, work = stage_dirs
    out = tmp_path / "gate"
    run_gate(config, work / "pretokenized", work / "plan", out)
    bad = config.to_json()
    bad["train"]["warmup_steps"] = 10_000
    assert not run_gate(run_config(bad), work / "pretokenized", work / "plan", out).to_json()["passed"]
    assert not (out / "PASSED").exists() and not (out / "UNENFORCED").exists()
    bad["gate"]["enforce"] = False  # the explicit override: a marker downstream rules can wait on
    assert not run_gate(run_config(bad), work / "pretokenized", work / "plan", out).to_json()["passed"]
    assert "FAILED, not enforced" in (out / "UNENFORCED").read_text() and not (out / "PASSED").exists()


def test_missing_plan_is_exit_2(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    rc = main(
        [
            "gate",
            "--config",
            str(cfg),
            "--pretokenized",
            str(tmp_path),
            "--plan",
            str(tmp_path / "none"),
            "--out",
            str(tmp_path / "g"),
        ]
    )
    assert rc == 2
    assert "plan.json: cannot read plan" in capsys.readouterr().err


# ---------------------------------------------------------------- fit by phase: load, steady, export, host

EXAMPLES = Path(__file__).resolve().parents[1] / "config" / "examples"
# Qwen3-32B's config.json (the fields the estimate and the loader read)
QWEN3_32B_CONFIG_JSON = {
    **QWEN3_32B,
    "architectures": ["Qwen3ForCausalLM"],
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
}
DEVICE_PHASES = ("load", "steady", "export")


def model_folder(path: Path, cfg: dict, safetensors: dict[str, int] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    for name, size in (safetensors or {}).items():
        with open(path / name, "wb") as f:
            f.truncate(size)  # sparse: only the size matters
    return path


def example_config(name: str, model_path: Path, **train) -> RunConfig:
    config = yaml.safe_load((EXAMPLES / name).read_text())
    config["model"]["path"] = str(model_folder(model_path, QWEN3_32B_CONFIG_JSON))
    config["train"].update(train)
    return run_config(config, source=name)


def fit_of(config: RunConfig):
    fit = config_fit_estimate(config, load_model_spec(config))
    return fit, check_fit(fit.phases, fit.budgets, config.gate.memory_headroom)


def fit_block(fit, headroom: float) -> list[str]:
    """The estimate as the examples' header comments print it: a line per phase, then its terms."""
    lines = []
    for phase, terms in fit.phases.items():
        budget = fit.budgets[phase]
        lines.append(
            f"{phase} {sum(terms.values()) / GIB:.1f} GiB per {budget.per} of "
            f"{budget.bytes * (1 - headroom) / GIB:.1f} usable"
        )
        lines += [f"{name} {value / GIB:.2f}" for name, value in terms.items()]
    return lines


def header_lines(name: str) -> list[str]:
    """The example's leading comment block, one whitespace-normalized line per comment line."""
    lines = []
    for line in (EXAMPLES / name).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(" ".join(line.lstrip("#").split()))
    return lines


def in_order(expected: list[str], header: list[str]) -> list[str]:
    """Expected lines not found, in order, as header lines (each may go on with a comment)."""
    rest = iter(header)
    return [line for line in expected if not any(h == line or h.startswith(line + " ") for h in rest)]


@pytest.mark.parametrize("name,verdict", [("qwen3-32b-2x8-b300.yaml", "PASS"), ("qwen3-32b-2x8-h100.yaml", "PASS")])
def test_example_fit_terms_and_verdict_match_its_header(name, verdict, tmp_path):
    config = example_config(name, tmp_path / "Qwen3-32B")
    fit, check = fit_of(config)
    assert list(fit.phases) == [*DEVICE_PHASES, "host_per_node"]
    for phase in DEVICE_PHASES:
        assert fit.budgets[phase].per == "rank" and fit.phases[phase]["sharded_params_fp32"] > 0
    assert {"largest_param_slice_file_dtype", "largest_param_slice_fp32"} <= set(fit.phases["load"])
    assert {"sharded_adam_state_fp32", "gathered_param_export_dtype"} <= set(fit.phases["export"])
    host = fit.phases["host_per_node"]
    assert {"process_runtime", "param_staging", "loader_page_cache"} <= set(host)
    assert fit.budgets["host_per_node"].source == "cluster.host_mem_gib"
    # no safetensors in the folder: num_params x 2 bytes (bf16), half of it per node
    assert host["loader_page_cache"] == pytest.approx(load_model_spec(config).num_params * 2 / 2, abs=1)
    assert check.passed is (verdict == "PASS")
    header = header_lines(name)
    assert f"Gate fit verdict: {verdict}" in header
    missing = in_order(fit_block(fit, config.gate.memory_headroom), header)
    assert not missing, f"{name}'s header comment is stale; expected lines: {missing}"


# What the examples' headers say about other settings: (example, train overrides, fits, largest term when not)
HEADER_CLAIMS = [
    ("qwen3-32b-2x8-h100.yaml", {"micro_batch_size": 2}, True, None),  # chunked loss (issue 23)
    ("qwen3-32b-2x8-h100.yaml", {"micro_batch_size": 3}, True, None),
    ("qwen3-32b-2x8-h100.yaml", {"micro_batch_size": 4}, False, "activations"),
    ("qwen3-32b-2x8-h100.yaml", {"micro_batch_size": 2, "loss": "full"}, False, "logits"),
    ("qwen3-32b-2x8-h100.yaml", {"activation_checkpointing": False}, False, "activations"),
    ("qwen3-32b-2x8-b300.yaml", {"activation_checkpointing": False}, True, None),
]


@pytest.mark.parametrize("name,train,fits,largest", HEADER_CLAIMS)
def test_example_header_claims_about_other_settings(name, train, fits, largest, tmp_path):
    fit, check = fit_of(example_config(name, tmp_path / "m", **train))
    assert check.passed is fits
    if not fits:  # the steady state is what fails, named with its largest term
        assert check.detail.startswith("steady: estimated peak") and f"largest term {largest}" in check.detail
    steady = sum(fit.phases["steady"].values()) / GIB
    assert f"{steady:.1f} GiB" in " ".join(header_lines(name)), (train, steady)


def test_h100_example_reason(tmp_path):
    """The H100 header's reason: steady state is the tightest phase, and loading the whole fp32 model
    on every rank (the old loader) would not fit an H100."""
    name = "qwen3-32b-2x8-h100.yaml"
    config = example_config(name, tmp_path / "m")
    fit, _ = fit_of(config)
    totals = {p: sum(t.values()) for p, t in fit.phases.items() if p in DEVICE_PHASES}
    assert max(totals, key=totals.get) == "steady"
    whole_model = load_model_spec(config).num_params * 4
    assert whole_model > 80 * GIB and f"{whole_model / GIB:.0f} GiB" in " ".join(header_lines(name))
    steady = fit.phases["steady"]
    assert max(steady, key=steady.get) == "sharded_adam_state_fp32"
    for term in ("sharded_adam_state_fp32", "logits"):
        assert f"{term} {steady[term] / GIB:.1f} GiB" in " ".join(header_lines(name))


def test_load_peak_is_far_below_the_whole_model_per_rank():
    spec = ModelSpec.from_hf_config(QWEN3_32B, "qwen3-32b")
    s = FitSettings(**QWEN3_SETTINGS, nodes=2, source=M.CheckpointSource("bfloat16", None))
    load = M.estimate_load_memory(spec, s)
    # from_pretrained on every rank: the whole fp32 model, 122 GiB, per rank; sharded: 1/16 of it + one slice
    assert sum(load.values()) < 0.1 * spec.num_params * 4
    assert load["sharded_params_fp32"] == spec.num_params * 4 // 16
    # the largest slice is 1/16 of the embedding (151936 / 16 = 9496 rows x 5120), in bf16 and fp32
    assert load["largest_param_slice_file_dtype"] == 9496 * 5120 * 2
    assert load["largest_param_slice_fp32"] == 9496 * 5120 * 4
    export = M.estimate_export_memory(spec, s)
    assert export["gathered_param_export_dtype"] == 151936 * 5120 * 2  # the whole embedding, bf16
    assert "sharded_grads_fp32" not in export  # freed before export
    random_init = M.estimate_load_memory(spec, FitSettings(**QWEN3_SETTINGS))
    assert random_init["init_block_fp32"] == M.INIT_BLOCK_ELEMENTS * 4


def test_largest_parameter_is_the_embedding_for_dense_and_the_fused_experts_for_moe():
    assert largest_param(ModelSpec.from_hf_config(QWEN3_32B, "x")) == ("embed_tokens", (151936, 5120))
    tiny = ModelSpec.from_hf_config({**QWEN3_32B, "vocab_size": 1000}, "x")
    assert largest_param(tiny)[0] == "mlp.gate_proj"  # 25600 x 5120 beats 1000 x 5120
    # Qwen3-30B-A3B: transformers 5 stores each layer's 128 experts as one 3-D parameter
    moe = ModelSpec.from_hf_config(
        {
            **QWEN3_32B,
            "hidden_size": 2048,
            "num_experts": 128,
            "moe_intermediate_size": 768,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
        },
        "x",
    )
    assert largest_param(moe) == ("experts.gate_up_proj", (128, 1536, 2048))
    # 16 ranks shard the expert dimension: 8 experts each
    assert largest_local_slice(moe, 16) == ("experts.gate_up_proj", 8 * 1536 * 2048)


def test_host_term_scales_with_ranks_per_node():
    spec = ModelSpec.from_hf_config(QWEN3_32B, "qwen3-32b")
    source = M.CheckpointSource("bfloat16", 65_500_000_000)
    eight = M.estimate_host_memory_per_node(spec, FitSettings(**QWEN3_SETTINGS, nodes=2, source=source))
    four = M.estimate_host_memory_per_node(spec, FitSettings(**QWEN3_SETTINGS, nodes=4, source=source))
    assert eight["process_runtime"] == 8 * M.HOST_RUNTIME_BYTES["gpu"] == 2 * four["process_runtime"]
    assert eight["param_staging"] == 2 * four["param_staging"]
    # while exporting, each rank may hold the whole embedding in bf16 on the host
    assert eight["param_staging"] == 8 * 151936 * 5120 * 2
    assert eight["loader_page_cache"] == 65_500_000_000 // 2 == 2 * four["loader_page_cache"]
    assert "device_tensors_on_host" not in eight


def test_cpu_ranks_count_their_device_tensors_on_the_host():
    spec = ModelSpec.from_hf_config(TINY_MODEL, "tiny")
    s = FitSettings(
        world_size=2, tokens_per_micro_batch=512, activation_checkpointing=False, mixed_precision=False, on_gpu=False
    )
    host = M.estimate_host_memory_per_node(spec, s)
    steady = sum(estimate_memory(spec, s).values())
    assert host["device_tensors_on_host"] == 2 * (steady - M.RUNTIME_OVERHEAD_BYTES["cpu"])
    assert host["process_runtime"] == 2 * M.RUNTIME_OVERHEAD_BYTES["cpu"] and host["loader_page_cache"] == 0


def test_a_budget_too_small_fails_and_names_the_phase():
    phases = {
        "load": {"sharded_params_fp32": 10 * GIB},
        "steady": {"activations": 60 * GIB},
        "export": {"sharded_adam_state_fp32": 50 * GIB, "gathered_param_export_dtype": 30 * GIB},
        "host_per_node": {"process_runtime": 32 * GIB, "loader_page_cache": 40 * GIB},
    }
    budgets = {
        "load": H100,
        "steady": H100,
        "export": H100,
        "host_per_node": Budget(64 * GIB, "cluster.host_mem_gib", "node"),
    }
    check = check_fit(phases, budgets, 0.1)
    assert not check.passed
    assert check.detail.startswith("export: estimated peak 80.0 GiB per rank > 72.0 GiB usable")
    assert "largest term sharded_adam_state_fp32 50.0 GiB" in check.detail
    assert "host_per_node: estimated peak 72.0 GiB per node > 57.6 GiB usable" in check.detail
    assert "largest term loader_page_cache 40.0 GiB" in check.detail
    assert "fits: load 10.0, steady 60.0 GiB per rank" in check.detail
    # an unknown host budget is shown, not checked, and does not fail the gate
    budgets["host_per_node"] = Budget(None, M.NOT_CHECKED, "node")
    phases["export"] = {"sharded_adam_state_fp32": 50 * GIB}
    check = check_fit(phases, budgets, 0.1)
    assert check.passed and "host_per_node 72.0 GiB per node not checked: set cluster.host_mem_gib" in check.detail


def test_example_with_a_small_host_fails_on_the_host_term(tmp_path):
    config = example_config("qwen3-32b-2x8-h100.yaml", tmp_path / "m")
    config = config.replace(cluster=config.cluster.replace(host_mem_gib=64))
    _, check = fit_of(config)
    assert not check.passed and check.detail.startswith("host_per_node: estimated peak 74.4 GiB per node")
    assert "largest term process_runtime 32.0 GiB" in check.detail


def test_host_budget_sources(make_config, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24590288 kB\nMemFree:         1000 kB\n")
    cpu = make_config(cluster={"gpu_model": "cpu"})
    assert M.host_memory_budget(cpu, meminfo) == Budget(24590288 * 1024, f"{meminfo} MemTotal", "node")
    gpu = make_config(cluster={"gpu_model": "H100"})
    assert M.host_memory_budget(gpu, meminfo) == Budget(None, "not checked: set cluster.host_mem_gib", "node")
    slurm = make_config(cluster={"gpu_model": "H100", "slurm": {"train": {"mem_mb": 512000}}})
    assert M.host_memory_budget(slurm, meminfo) == Budget(512000 << 20, "cluster.slurm.train.mem_mb", "node")
    both = make_config(cluster={"gpu_model": "cpu", "host_mem_gib": 1.5, "slurm": {"train": {"mem_mb": 1}}})
    assert M.host_memory_budget(both, meminfo) == Budget(int(1.5 * GIB), "cluster.host_mem_gib", "node")
    meminfo.write_text("garbage\n")
    with pytest.raises(InputError, match="meminfo: no MemTotal line; set cluster.host_mem_gib"):
        M.host_memory_budget(cpu, meminfo)
    assert M.host_memory_budget(cpu).bytes > 0  # this machine's /proc/meminfo


def test_export_dtype_name(make_config, tmp_path):
    assert export_dtype_name(make_config(model={"config": TINY_MODEL})) == "bfloat16"  # nothing named: bf16
    assert export_dtype_name(make_config(model={"config": {**TINY_MODEL, "torch_dtype": "float32"}})) == "float32"
    explicit = make_config(
        model={"config": {**TINY_MODEL, "torch_dtype": "float32"}}, train={"export_dtype": "float16"}
    )
    assert export_dtype_name(explicit) == "float16"
    folder = model_folder(tmp_path / "m", {**TINY_MODEL, "dtype": "torch.float16"})  # transformers 5 writes `dtype`
    assert export_dtype_name(make_config(model={"path": str(folder)})) == "float16"
    model_folder(folder, TINY_MODEL)  # the checkpoint names none: model.config's, then bf16
    both = make_config(model={"path": str(folder), "config": {**TINY_MODEL, "torch_dtype": "float32"}})
    assert export_dtype_name(both) == "float32"
    assert export_dtype_name(make_config(model={"path": str(folder)})) == "bfloat16"
    model_folder(folder, {**TINY_MODEL, "torch_dtype": "float8_e4m3fn"})
    with pytest.raises(
        InputError, match=r"m/config.json: dtype float8_e4m3fn is not an export dtype .*set train.export_dtype"
    ):
        export_dtype_name(make_config(model={"path": str(folder)}))
    model_folder(folder, {**TINY_MODEL, "torch_dtype": "int3"})
    with pytest.raises(InputError, match="m/config.json: unknown dtype 'int3'"):
        export_dtype_name(make_config(model={"path": str(folder)}))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(InputError, match=r"m/config.json:1: invalid JSON in model config"):
        export_dtype_name(make_config(model={"path": str(folder)}))
    with pytest.raises(InputError, match=r"none/config.json: cannot read model config"):
        M.checkpoint_source(make_config(model={"path": str(tmp_path / "none")}))


def test_checkpoint_source_reads_file_dtype_and_safetensors_sizes(make_config, tmp_path):
    folder = model_folder(
        tmp_path / "m",
        {**TINY_MODEL, "torch_dtype": "bfloat16"},
        {"model-00001-of-00002.safetensors": 3000, "model-00002-of-00002.safetensors": 1001},
    )
    (folder / "notes.txt").write_text("not a weight file")
    config = make_config(model={"path": str(folder)}, cluster={"nodes": 2, "gpus_per_node": 1})
    assert M.checkpoint_source(config) == M.CheckpointSource("bfloat16", 4001)
    fit, _ = fit_of(config)
    assert fit.phases["host_per_node"]["loader_page_cache"] == 2001  # ceil(4001 / 2 nodes)
    model_folder(folder, TINY_MODEL)  # no dtype named: transformers' default, fp32
    assert M.checkpoint_source(config).dtype == "float32"
    assert M.checkpoint_source(make_config(model={"config": TINY_MODEL})) is None


def test_gate_json_and_md_carry_every_phase(stage_dirs, tmp_path):
    config, work = stage_dirs
    report = run_gate(config, work / "pretokenized", work / "plan", tmp_path / "gate").to_json()
    phases = report["memory_estimate_phases"]
    assert list(phases) == ["load", "steady", "export", "host_per_node"]
    assert phases["steady"]["terms_bytes"] == report["memory_estimate_bytes"]
    for phase, p in phases.items():
        assert set(p) == {
            "per",
            "terms_bytes",
            "total_bytes",
            "budget_bytes",
            "usable_bytes",
            "budget_source",
            "headroom",
            "fits",
            "note",
        }
        assert p["total_bytes"] == sum(p["terms_bytes"].values()) and p["fits"] is True
        assert p["per"] == ("node" if phase == "host_per_node" else "rank")
    assert phases["host_per_node"]["budget_source"] == "/proc/meminfo MemTotal"  # a cpu run
    md = (tmp_path / "gate/gate.md").read_text()
    for title in (
        "### Load (device, per rank)",
        "### Steady state (device, per rank)",
        "### Export of final/ (device, per rank)",
        "### Host RAM (per node)",
        "| loader_page_cache |",
        "| gathered_param_export_dtype |",
    ):
        assert title in md
    assert md.count("headroom): fits.") == 4


# ---------------------------------------------------------------- issue 13: remainder policy, max_steps, corrupt inputs


def without_doc(packs, doc_id):
    """The plan's rows with one document's entries removed (every epoch)."""
    keep = packs.doc_ids != doc_id
    per_row = np.add.reduceat(keep.astype(np.int64), packs.offsets[:-1]) if len(keep) else keep
    offsets = np.concatenate(([0], np.cumsum(per_row)))
    return dataclasses.replace(
        packs, doc_ids=packs.doc_ids[keep], doc_lengths=packs.doc_lengths[keep], offsets=offsets, length_offsets=offsets
    )


def declared_drop(inputs, policy, reason="remainder", tokens=None):
    d = int(inputs.packs.doc_ids[0])
    n = int(inputs.doc_tokens[d])
    dropped = {reason: DroppedDocs(docs=1, tokens=n if tokens is None else tokens)}
    stats = inputs.plan.stats.replace(dropped_doc_ids=(d,), dropped=dropped)
    plan = inputs.plan.replace(remainder=policy, stats=stats)
    config = inputs.config.replace(pack=inputs.config.pack.replace(remainder=policy))
    return dataclasses.replace(inputs, plan=plan, config=config, packs=without_doc(inputs.packs, d))


def test_conservation_rebin_and_none_drop_nothing(inputs):
    for policy in ("rebin", "none"):
        broken = declared_drop(inputs, policy)
        assert "conservation" in failed(broken)
        assert f"pack.remainder: {policy} drops no document, plan drops 1" in verdicts(broken)["conservation"].detail


def test_conservation_drop_accepts_less_than_a_global_batch_with_a_known_reason(inputs):
    assert verdicts(declared_drop(inputs, "drop"))["conservation"].passed
    detail = verdicts(declared_drop(inputs, "drop", reason="whim"))["conservation"].detail
    assert "unknown drop reason 'whim'" in detail


def test_conservation_drop_rejects_a_global_batch_or_more(inputs):
    # world 2 x micro 2 x accum 2 = 8 packs per global batch; the dropped packs are the lightest, so their
    # tokens cannot exceed 7 x the lightest kept pack
    broken = declared_drop(inputs, "drop")
    lots = int(broken.packs.num_tokens.min()) * 8
    stats = broken.plan.stats
    dropped = {"remainder": stats.dropped["remainder"].replace(tokens=lots)}
    plan = broken.plan.replace(stats=stats.replace(dropped=dropped))
    d = plan.stats.dropped_doc_ids[0]
    doc_tokens = broken.doc_tokens.copy()
    doc_tokens[d] = lots
    manifest = broken.manifest.replace(num_tokens=int(doc_tokens.sum()))
    broken = dataclasses.replace(broken, plan=plan, doc_tokens=doc_tokens, manifest=manifest)
    detail = verdicts(broken)["conservation"].detail
    assert "a global batch" in detail and "pack.remainder: drop" in detail


def test_conservation_plan_and_config_disagree_on_the_policy(inputs):
    broken = declared_drop(inputs, "drop")
    config = broken.config.replace(pack=broken.config.pack.replace(remainder="rebin"))
    detail = verdicts(dataclasses.replace(broken, config=config))["conservation"].detail
    assert "plan was made with pack.remainder drop, config says rebin; rerun pack" in detail


def test_schedule_uses_max_steps(inputs):
    total = inputs.plan.epochs * inputs.plan.steps_per_epoch
    config = inputs.config.replace(train=inputs.config.train.replace(max_steps=2, warmup_steps=2, checkpoint_every=1))
    assert total > 2
    check = verdicts(dataclasses.replace(inputs, config=config))["schedule"]
    assert not check.passed and "train.warmup_steps 2 >= total steps 2 (train.max_steps 2)" in check.detail
    config = config.replace(train=config.train.replace(warmup_steps=1, checkpoint_every=3))
    check = verdicts(dataclasses.replace(inputs, config=config))["schedule"]
    assert check.passed and "note: train.checkpoint_every 3 > total steps 2 (train.max_steps 2)" in check.detail


def gate_cli(stage_dirs, tmp_path, capsys, pretokenized=None, plan=None):
    config, work = stage_dirs
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config.to_json()))
    rc = main(
        [
            "gate",
            "--config",
            str(cfg),
            "--pretokenized",
            str(pretokenized or work / "pretokenized"),
            "--plan",
            str(plan or work / "plan"),
            "--out",
            str(tmp_path / "gate"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def test_truncated_shard_is_exit_2_with_one_line(stage_dirs, tmp_path, capsys):
    _, work = stage_dirs
    pretok = tmp_path / "pretokenized"
    shutil.copytree(work / "pretokenized", pretok)
    shard = pretok / "shard-00000.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    rc, err = gate_cli(stage_dirs, tmp_path, capsys, pretokenized=pretok)
    assert rc == 2 and len(err) == 1, err
    assert "shard-00000.parquet" in err[0] and "rerun pretokenize" in err[0]


def test_packs_missing_a_column_is_exit_2_with_one_line(stage_dirs, tmp_path, capsys):
    import pyarrow.parquet as pq

    _, work = stage_dirs
    plan = tmp_path / "plan"
    shutil.copytree(work / "plan", plan)
    pq.write_table(pq.read_table(plan / "packs.parquet").drop_columns(["doc_lengths"]), plan / "packs.parquet")
    rc, err = gate_cli(stage_dirs, tmp_path, capsys, plan=plan)
    assert rc == 2 and len(err) == 1, err
    assert "packs.parquet" in err[0] and "doc_lengths" in err[0] and "rerun pack" in err[0]


def test_plan_json_not_an_object_is_exit_2_with_one_line(stage_dirs, tmp_path, capsys):
    _, work = stage_dirs
    plan = tmp_path / "plan"
    shutil.copytree(work / "plan", plan)
    (plan / "plan.json").write_text("[1, 2, 3]\n")
    rc, err = gate_cli(stage_dirs, tmp_path, capsys, plan=plan)
    assert rc == 2 and len(err) == 1, err
    assert "plan.json" in err[0] and "not a JSON object" in err[0] and "rerun pack" in err[0]

"""Mixture-of-Experts models train and export (issue 31, item 3), and the collective proof covers them (item 4).

For Qwen3-MoE, Mixtral and GPT-OSS, tiny random-init bf16 folders saved by transformers itself (Qwen3-MoE and
Mixtral then hold one tensor per expert on disk, while transformers 5 holds each projection's experts stacked in
one 3-D parameter): the folder loads as from_pretrained loads it, the gate (proof on) passes, two gloo ranks train
it, the reported validation loss is the exported model's own transformers forward, and final/ has the input's
names, shapes and dtypes.

The negative controls: a routing skewed so that rank 1 sends no token to an expert while rank 0 does. With experts
as separate parameters (transformers 4's layout) and train/moe.py's construction disabled, FSDP2's reduce-scatters
differ between the ranks and gloo aborts the step (NCCL would hang); with it the step's gradients equal a
single-process reference. transformers 5's stacked experts get zero rows in a defined gradient and are fine either
way. The proof, with the construction disabled in the test, fails naming the reduce-scatter that differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.scoring import scored_by_transformers
import torch
import yaml

from support.models import (
    MOE_ARCHS,
    folder_headers,
    moe_config,
    save_moe_folder,
)
from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.pack.plan import build_plan
from wattgate.train.data import IGNORE

REPO = Path(__file__).resolve().parents[1]
ARCHS = list(MOE_ARCHS)
RTOL = 1e-5


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def packed_batch() -> dict[str, torch.Tensor]:
    """Two packed rows of two documents each, labels IGNORE at each document's first token."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (2, 40), generator=g)
    position_ids = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
    labels = ids.clone()
    labels[:, 0] = labels[:, 15] = IGNORE
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-folders")
    return {mt: save_moe_folder(root / mt, mt, seed=1) for mt in ARCHS}


# ---------------------------------------------------------------- load, weights check, estimate, objective


@pytest.mark.parametrize("model_type", ARCHS)
def test_a_folder_transformers_saved_loads_as_its_own_from_pretrained_loads_it(folders, model_type):
    from transformers import AutoModelForCausalLM

    from wattgate.gate.weights_check import check_weights
    from wattgate.train.model import build_unsharded_model

    folder = folders[model_type]
    on_disk = folder_headers(folder)
    model = build_unsharded_model({"path": str(folder)}, "eager", seed=0)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
    state = model.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    check = check_weights(run_config({"model": {"path": str(folder)}}))
    assert check.passed, check.detail
    assert check.detail.startswith(f"{len(on_disk)} tensors in 1 safetensors file(s)")
    per_expert = [k for k in on_disk if ".experts.0." in k]
    if model_type == "gpt_oss":  # saved stacked, as it is held
        assert not per_expert and "expert stacks" not in check.detail
    else:  # gate and up of each expert concatenated, the experts stacked: 4 stacks (2 layers x gate_up, down)
        assert per_expert and "4 expert stacks from 24 per-expert tensors" in check.detail


def test_a_checkpoint_missing_one_expert_fails_the_weights_check_in_one_line(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    from wattgate.gate.weights_check import check_weights

    mine = tmp_path / "qwen3_moe"
    mine.mkdir()
    for f in folders["qwen3_moe"].iterdir():
        (mine / f.name).write_bytes(f.read_bytes())
    tensors = load_file(mine / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, mine / "model.safetensors", metadata={"format": "pt"})
    check = check_weights(run_config({"model": {"path": str(mine)}}))
    assert not check.passed and "\n" not in check.detail
    assert "no checkpoint tensor 'mlp.experts.3.up_proj.weight' for expert 3 of " in check.detail
    assert "'model.layers.1.mlp.experts.gate_up_proj' (4 experts)" in check.detail


def test_a_conversion_wattgate_does_not_apply_is_one_line_naming_the_model(folders, monkeypatch):
    """A converter with another operation than stacking and concatenating (a transpose, say) is refused."""
    from transformers.core_model_loading import Transpose

    from wattgate.train import checkpoint_layout
    from wattgate.train.model import build_meta_model

    real = checkpoint_layout._transforms

    def with_a_transpose(model):
        renamings, converters = real(model)
        converters[0].operations = [*converters[0].operations, Transpose(1, 2)]
        return renamings, converters

    monkeypatch.setattr(checkpoint_layout, "_transforms", with_a_transpose)
    folder = folders["qwen3_moe"]
    with pytest.raises(InputError) as err:
        from wattgate.train.weights import checkpoint_sources

        checkpoint_sources(build_meta_model({"path": str(folder)}, "sdpa"), folder)
    line = str(err.value)
    assert line.startswith(f"{folder} (qwen3_moe): checkpoint tensor 'model.layers.")
    assert "MergeModulelist(dim=0), Concatenate(dim=1), Transpose(dim0=1, dim1=2)" in line and "\n" not in line


REAL_SHAPES = {  # the published configs' shapes (Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b)
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    ),
    "mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    ),
    "gpt_oss": dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", ARCHS)
def test_the_memory_estimate_counts_every_expert(model_type):
    """The gate's parameter count (every expert of every layer: FSDP2 shards and gathers them all) equals the
    meta-built model's at the published shapes, within the attention sinks GPT-OSS adds; activations grow with
    the router's top k."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from wattgate.model_spec import ModelSpec

    cfg = dict(REAL_SHAPES[model_type], tie_word_embeddings=False)
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    exact = sum(p.numel() for p in model.parameters())
    spec = ModelSpec.from_hf_config(config.to_dict(), model_type)
    assert abs(spec.num_params - exact) <= 1e-6 * exact, (spec.num_params, exact)
    one_expert = ModelSpec.from_hf_config(dict(config.to_dict(), num_experts_per_tok=1), model_type)
    assert spec.activation_elements_per_token_layer() > one_expert.activation_elements_per_token_layer()
    dense_layers = ModelSpec.from_hf_config(dict(config.to_dict(), mlp_only_layers=[0, 1]), model_type)
    if model_type == "qwen3_moe":  # two layers with a dense MLP instead of 128 experts
        assert dense_layers.num_params == spec.num_params - 2 * (spec.layer_params - spec.dense_layer_params)


# published shapes a formula over config keys counts only in part (shared experts, latent attention, dense MLPs
# between MoE layers); before the gate counted the model itself it sized DeepSeek-V3 at 6% of its parameters
COUNTED_SHAPES = {
    "DeepSeek-V3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
        n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_experts_per_tok=8, n_group=8, topk_group=4,
    ),
    "GLM-4.5-Air": dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=46, first_k_dense_replace=1, n_routed_experts=128, n_shared_experts=1,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, num_experts_per_tok=8, attention_bias=True,
    ),
    "Qwen2-57B-A14B": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=3584, intermediate_size=18944,
        moe_intermediate_size=2560, shared_expert_intermediate_size=20480, num_hidden_layers=28, num_experts=64,
        num_experts_per_tok=8, num_attention_heads=28, num_key_value_heads=4,
    ),
    "Llama-4-Scout": dict(
        model_type="llama4_text", vocab_size=202048, hidden_size=5120, intermediate_size=8192,
        intermediate_size_mlp=16384, num_hidden_layers=48, num_local_experts=16, num_experts_per_tok=1,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, interleave_moe_layer_step=1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(COUNTED_SHAPES))
def test_the_gate_sizes_memory_from_the_model_counted_whatever_its_config_keys(name):
    """The gate's spec counts the model transformers builds (on the meta device): every routed and shared expert,
    the dense layers, latent attention. Its memory terms follow: FSDP2 shards all of them and gathers a whole
    layer at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from wattgate.config import run_config
    from wattgate.gate.memory import estimate_memory
    from wattgate.gate.run import counted_spec, fit_settings
    from wattgate.model_spec import load_model_spec
    from wattgate.train.model import layer_container

    cfg = dict(COUNTED_SHAPES[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    exact = sum(p.numel() for p in model.parameters())
    largest_layer = max(sum(p.numel() for p in layer.parameters()) for layer in layer_container(model))
    config = run_config({"model": {"config": COUNTED_SHAPES[name]}, "cluster": {"nodes": 2, "gpus_per_node": 8}})
    spec = counted_spec(config, None)
    assert spec.num_params == exact and spec.layer_params == largest_layer
    memory = estimate_memory(spec, fit_settings(config))
    assert memory["sharded_params_fp32"] == exact * 4 // 16
    print(f"{name}: counted {exact / 1e9:.2f}B, formula {load_model_spec(config).num_params / 1e9:.2f}B")


@pytest.mark.parametrize("model_type", ARCHS)
@pytest.mark.parametrize("kind", ["chunked", "full"])
def test_the_router_load_balancing_term_trains_as_the_models_own_loss_defines_it(model_type, kind):
    """output_router_logits on: the gradients are those of transformers' own loss (token mean + coef x aux, here
    x the loss tokens); the value is the token loss alone (what validation and the metrics report)."""
    import torch.nn.functional as F

    from wattgate.train.loss import summed_token_loss
    from wattgate.train.model import build_unsharded_model

    cfg = {"config": moe_config(model_type, output_router_logits=True, router_aux_loss_coef=0.5)}
    model = build_unsharded_model(cfg, "eager", seed=0).train()
    tensors = packed_batch()
    count = int((tensors["labels"][:, 1:] != IGNORE).sum())
    out = model(input_ids=tensors["input_ids"], position_ids=tensors["position_ids"], labels=tensors["labels"])
    (out.loss * count).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    token_loss = F.cross_entropy(
        out.logits[:, :-1].flatten(0, 1).float(),
        tensors["labels"][:, 1:].flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    ).item()
    assert out.aux_loss.item() > 0 and out.loss.item() * count > token_loss * (1 + 1e-3)  # the term is there
    model.zero_grad(set_to_none=True)
    loss = summed_token_loss(model, tensors, kind, 7)
    loss.backward()
    assert abs(loss.item() - token_loss) <= RTOL * token_loss
    scale = max(1.0, max(g.abs().max().item() for g in reference.values()))
    worst = max((p.grad - reference[n]).abs().max().item() for n, p in model.named_parameters())
    assert worst <= RTOL * scale, worst
    router = [n for n in reference if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    model.config.output_router_logits = False  # the negative control: without the term the router's gradient differs
    model.zero_grad(set_to_none=True)
    summed_token_loss(model, tensors, kind, 7).backward()
    assert max((dict(model.named_parameters())[n].grad - reference[n]).abs().max().item() for n in router) > 1e-3


def test_packed_gpt_oss_documents_do_not_see_each_other():
    """transformers 5.24's GptOssModel builds its masks without position_ids: wattgate hands it the masks
    (train/packed_masks.py), so three packed documents score as each does alone."""
    import torch.nn.functional as F

    from wattgate.train.loss import summed_token_loss
    from wattgate.train.model import build_unsharded_model

    model = build_unsharded_model({"config": moe_config("gpt_oss")}, "eager", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 96, (n,), generator=g) for n in (20, 30, 14)]
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = ids.clone()
    labels[0, [0, 20, 50]] = IGNORE
    with torch.no_grad():
        alone = sum(
            F.cross_entropy(model(d[None], use_cache=False).logits[0, :-1].double(), d[1:], reduction="sum").item()
            for d in docs
        )
        packed = summed_token_loss(
            model, {"input_ids": ids, "position_ids": position_ids, "labels": labels}, "chunked", 7
        ).item()
        hook = model.get_decoder()._forward_pre_hooks.popitem()  # the negative control: the model's own masks
        leaky = summed_token_loss(
            model, {"input_ids": ids, "position_ids": position_ids, "labels": labels}, "chunked", 7
        ).item()
    assert hook is not None
    assert abs(packed - alone) <= RTOL * alone
    assert abs(leaky - alone) > 1e-4 * alone  # the second and third documents attended to the ones before


# ---------------------------------------------------------------- gate, two ranks, export


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory) -> Path:
    lengths = np.random.default_rng(3).integers(5, 60, 40).tolist()
    root = tmp_path_factory.mktemp("moe-data")
    return write_random_pretokenized(root / "pretokenized", lengths, 96, 0, shard_docs=7, validation_fraction=0.25)


@pytest.fixture(scope="module", params=ARCHS)
def pipeline(request, tmp_path_factory, folders, pretokenized) -> dict:
    """For one architecture: plan, gate (proof on), `wattgate train` on 2 gloo ranks (2 AdamW steps, validation
    after each, float32 export for the loss comparison) and `wattgate load-check --export` (the input's dtype)."""
    from wattgate.gate.run import run_gate

    model_type = request.param
    tmp = tmp_path_factory.mktemp(model_type)
    train = dict(seq_len=64, micro_batch_size=2, grad_accum=1, max_steps=2, checkpoint_every=2, eval_every=1)
    train.update(lr=1e-2, warmup_steps=0, log_every=1, export_dtype="float32")
    config = run_config(
        {
            "run_name": "t",
            "train": train,
            "model": {"path": str(folders[model_type])},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
        }
    )
    build_plan(config, pretokenized, tmp / "plan")
    t0 = time.perf_counter()
    gate = run_gate(config, pretokenized, tmp / "plan", tmp / "gate").to_json()
    gate_s = time.perf_counter() - t0
    (tmp / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    train_cmd = ["-m", "wattgate", "train", "--config", str(tmp / "config.yaml"), "--pretokenized", str(pretokenized)]
    trained = torchrun(*train_cmd, "--plan", str(tmp / "plan"), "--run-dir", str(tmp / "out"))
    # the input's dtype, and files of at most ~5 KB: an expert stack's tensors spread over several files
    roundtrip_train = dict(config.train.to_json(), export_dtype="auto", export_max_shard_gib=5e-6)
    (tmp / "roundtrip.yaml").write_text(yaml.safe_dump(dict(config.to_json(), train=roundtrip_train)))
    roundtrip = torchrun(
        "-m", "wattgate", "load-check", "--config", str(tmp / "roundtrip.yaml"), "--out", str(tmp / "lc"), "--export"
    )
    return {
        "model_type": model_type,
        "folder": folders[model_type],
        "pretokenized": pretokenized,
        "gate": gate,
        "gate_s": gate_s,
        "train": trained,
        "out": tmp / "out",
        "roundtrip": roundtrip,
        "roundtrip_final": tmp / "lc" / "final",
    }


@pytest.mark.slow
def test_the_gate_proves_the_moe_model_and_passes(pipeline):
    gate = pipeline["gate"]
    failed = [(c["name"], c["detail"]) for c in gate["checks"] if not c["passed"]]
    assert gate["passed"], failed
    proof = gate["collectives"]
    assert proof["passed"] and proof["ranks_run"] == 2
    assert proof["moe"]["divergence"] is None and proof["moe"]["experts_kernel"]["training"] == "grouped_mm"
    assert "with no token reaching any expert issues the same collectives as with its tokens routed" in proof["detail"]
    print(f"{pipeline['model_type']}: gate {pipeline['gate_s']:.1f} s (proof {proof['elapsed_s']} s)")


@pytest.mark.slow
def test_two_ranks_train_it_and_report_the_validation_loss_of_its_own_forward(pipeline):
    proc = pipeline["train"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = pq.read_table(pipeline["out"] / "metrics.parquet").to_pylist()
    assert sorted({r["step"] for r in steps}) == [1, 2] and {r["rank"] for r in steps} == {0, 1}
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in steps)
    rows = pq.read_table(pipeline["out"] / "eval.parquet").to_pylist()
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] != rows[0]["loss"]  # the weights moved
    reference = scored_by_transformers(pipeline["out"] / "final", pipeline["pretokenized"])
    difference = abs(rows[-1]["loss"] - reference) / reference
    print(f"{pipeline['model_type']}: reported {rows[-1]['loss']:.9f}, final/ by transformers {reference:.9f}")
    print(f"{pipeline['model_type']}: relative difference {difference:.1e}")
    assert difference <= RTOL


@pytest.mark.slow
def test_final_has_the_inputs_names_shapes_and_dtypes(pipeline):
    """The trained export (float32, as asked) has the input's names and shapes; the load-check export in the input's
    dtype, in small files, has its names, shapes and dtypes, every tensor bit for bit the input's."""
    from safetensors.torch import load_file

    on_disk = folder_headers(pipeline["folder"])
    trained = folder_headers(pipeline["out"] / "final")
    assert trained.keys() == on_disk.keys()
    assert all(trained[k][0] == on_disk[k][0] and trained[k][1] == "F32" for k in on_disk)
    proc = pipeline["roundtrip"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert folder_headers(pipeline["roundtrip_final"]) == on_disk  # names, shapes, dtypes (bf16)
    files = sorted(pipeline["roundtrip_final"].glob("*.safetensors"))
    index = json.loads((pipeline["roundtrip_final"] / "model.safetensors.index.json").read_text())["weight_map"]
    per_expert = {f for k, f in index.items() if "layers.0." in k and ".experts.0." not in k and ".experts." in k}
    assert len(files) > 3 and (len(per_expert) > 1 or pipeline["model_type"] == "gpt_oss")  # a stack over files
    exported = {k: v for f in files for k, v in load_file(f).items()}
    source = load_file(pipeline["folder"] / "model.safetensors")
    assert all(torch.equal(exported[k], source[k]) for k in source)


# ---------------------------------------------------------------- negative controls


def disabled(model) -> bool:
    return False


@pytest.mark.slow
def test_with_the_construction_disabled_the_proof_names_the_reduce_scatter_a_skewed_routing_changes(
    tmp_path, pretokenized, monkeypatch
):
    from wattgate.proof.prove import prove_collectives

    train = dict(seq_len=64, micro_batch_size=2, grad_accum=1, max_steps=2, checkpoint_every=2, warmup_steps=0)
    config = run_config(
        {
            "run_name": "t",
            "train": train,
            "model": {"config": moe_config("qwen3_moe")},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
        }
    )
    build_plan(config, pretokenized, tmp_path / "plan")
    monkeypatch.setattr("wattgate.train.moe.reduce_every_parameter", disabled)  # forked workers inherit it
    report = prove_collectives(config, pretokenized, tmp_path / "plan").to_json()
    assert not report["passed"] and "\n" not in report["detail"]
    assert report["detail"].startswith(
        "model.config (qwen3_moe) is a Mixture-of-Experts model (num_experts 4) whose collectives follow its "
        "routing: with no token reaching any expert, rank 0 issues c10d._reduce_scatter_base_("
    )
    d = report["moe"]["divergence"]
    assert d["step"] == 1 and "reduce_scatter" in d["routed"] and d["routed"] != d["starved"]
    assert report["divergence"] is None  # the ranks' routed runs agree: only the skew shows it


def test_an_moe_model_without_an_experts_module_is_refused_in_one_line_before_any_dry_run(
    tmp_path, pretokenized, monkeypatch
):
    """Custom expert code the dry run cannot starve (no transformers *Experts module): the proof names the limit."""
    from wattgate.proof.prove import prove_collectives

    def no_dry_run(*args, **kwargs):
        raise AssertionError("a dry run started")

    config = run_config(
        {
            "run_name": "t",
            "train": dict(seq_len=64, micro_batch_size=2, grad_accum=1, max_steps=2, warmup_steps=0),
            "model": {"config": moe_config("mixtral")},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
        }
    )
    build_plan(config, pretokenized, tmp_path / "plan")
    monkeypatch.setattr("wattgate.proof.prove.experts_modules", lambda model: [])
    monkeypatch.setattr("wattgate.proof.prove.dry_run_rank", no_dry_run)
    report = prove_collectives(config, pretokenized, tmp_path / "plan").to_json()
    assert not report["passed"] and report["ranks_run"] == 0 and "\n" not in report["detail"]
    assert report["detail"].startswith(
        "model.config (mixtral) is a Mixture-of-Experts model (num_experts 4) without a transformers experts module"
    )
    assert report["detail"].endswith("set gate.collectives: false to run it unproven")


@pytest.fixture(scope="module")
def skew_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("skew") / "config.yaml"
    cfg = {"run_name": "t", "model": {"config": moe_config("qwen3_moe", initializer_range=0.02)}, "train": {}}
    path.write_text(yaml.safe_dump(dict(cfg, cluster={"nodes": 1, "gpus_per_node": 2})))
    return path


@pytest.mark.slow
def test_a_rank_that_sends_no_token_to_an_expert_breaks_fsdp2_unless_every_unit_reduces_every_parameter(
    skew_config, tmp_path
):
    """tests/dist/moe_skewed_routing.py: rank 1's router never picks expert 3, rank 0's does. Experts as separate
    parameters without the construction: the ranks' reduce-scatters differ and gloo aborts."""
    proc = torchrun(str(REPO / "tests/dist/moe_skewed_routing.py"), str(skew_config), str(tmp_path), "per_expert:off")
    assert proc.returncode != 0 and not (tmp_path / "per_expert-off.json").exists()
    assert "Received data size doesn't match expected size" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_with_the_construction_a_skewed_routing_trains_with_the_gradients_of_one_process(skew_config, tmp_path):
    """The same skew: with the construction, experts as separate parameters reduce to the single-process gradients;
    transformers 5's stacked experts do so with or without it (an unreached expert gets zero rows, not no grad)."""
    cases = ["per_expert:on", "fused:on", "fused:off"]
    proc = torchrun(str(REPO / "tests/dist/moe_skewed_routing.py"), str(skew_config), str(tmp_path), *cases)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for case in cases:
        r = json.loads((tmp_path / f"{case.replace(':', '-')}.json").read_text())
        (rank0, rank1) = r["routed"]
        assert rank1[-1] == 0 and rank0[-1] > 0, r["routed"]  # the skew: only rank 0 reaches the last expert
        assert r["reduces_every_parameter"] == case.endswith(":on")
        assert abs(r["loss"] - r["reference_loss"]) <= RTOL * r["reference_loss"]
        assert r["max_grad_delta"] <= RTOL * max(1.0, r["max_grad"]), (case, r)

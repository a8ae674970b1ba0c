"""Every model trains on its own objective (issue 31, items 1 and 2).

The chunked loss (train.loss: chunked, the default) must give the value and the gradients of the loss the
model's own forward computes, including what the forward does to its logits after the head: Granite's
logits_scaling, Cohere's logit_scale, Gemma 2/3's final_logit_softcapping. A forward wattgate does not
recognize trains with train.loss full (the model's own logits) and says so in one line. Gemma 2 and 3 build
on the meta device and get their buffers (rotary inv_freq, embed_scale) from the model's own init.

Logits are made large (initializer_range 0.5; softcap 2) so a skipped scale or softcap would move the loss by
tens of percent; equality is checked within 1e-5 relative (fp32, a different summation order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.architectures import SMALL_VOCAB_IDS, TINY_SHAPE
from support.scoring import scored_by_transformers
import torch
import yaml

from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.pack.plan import build_plan
from wattgate.train.attention import resolve_attn_implementation
from wattgate.train.data import IGNORE
from wattgate.train.loss import (
    chunked_cross_entropy_sum,
    effective_loss_kind,
    final_hidden,
    shifted_targets,
    summed_token_loss,
)
from wattgate.train.logit_transform import logit_transform
from wattgate.train.model import build_meta_model, build_unsharded_model, causal_lm_class, model_hf_config
from wattgate.train.weights import materialize

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
CHUNK = 7  # does not divide the rows: the last chunk is partial
TINY = dict(  # large logits (initializer_range 0.5): a skipped transform shows
    vocab_size=96, **TINY_SHAPE, max_position_embeddings=128, **SMALL_VOCAB_IDS, initializer_range=0.5
)
# model_type -> (config keys, the transform logit_transform must read from the forward; binary fractions: exact)
ARCHS = {
    "granite": ({"logits_scaling": 8.0}, (("scale", 0.125),)),
    "cohere": ({"logit_scale": 0.25}, (("scale", 0.25),)),
    "gemma2": ({"final_logit_softcapping": 2.0}, (("scale", 0.5), ("tanh", None), ("scale", 2.0))),
    "gemma3_text": (
        {
            "final_logit_softcapping": 2.0,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
        },
        (("scale", 0.5), ("tanh", None), ("scale", 2.0)),
    ),
    "llama": ({}, ()),
    "qwen3": ({}, ()),
}


def model_cfg(model_type: str) -> dict:
    return {"config": dict(TINY, model_type=model_type, **ARCHS[model_type][0])}


def attn_for(cfg: dict) -> str:
    """What training builds on this machine (auto: a kernel the model runs; Gemma 2 has no sdpa)."""
    return resolve_attn_implementation("auto", "cpu", False, causal_lm_class(model_hf_config(cfg)))


def packed_batch() -> dict[str, torch.Tensor]:
    """Two packed rows of two documents each; the labels IGNORE at each document's first token (as
    train/data.py makes them) and over part of row 1 (an assistant-only mask)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, TINY["vocab_size"], (2, 40), generator=g)
    position_ids = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
    labels = ids.clone()
    labels[:, 0] = labels[:, 15] = IGNORE
    labels[1, 20:25] = IGNORE
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def own_loss_and_grads(model, tensors) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss transformers' own forward computes from `labels` (its mean, x the loss tokens: a sum)."""
    model.zero_grad(set_to_none=True)
    count = int((tensors["labels"][:, 1:] != IGNORE).sum())
    out = model(input_ids=tensors["input_ids"], position_ids=tensors["position_ids"], labels=tensors["labels"])
    loss = out.loss * count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def chunked_loss_and_grads(model, tensors) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = summed_token_loss(model, tensors, "chunked", CHUNK)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> None:
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (loss, ref_loss)
    scale = max(1.0, max(g.abs().max().item() for g in ref_grads.values()))
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    assert worst <= RTOL * scale, f"max |dgrad| {worst:.2e} (max |grad| {scale:.2e})"


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_the_chunked_loss_and_gradients_are_the_models_own(model_type):
    """Built as training builds it (meta, then wattgate's init), scored against transformers' own forward+loss."""
    cfg = model_cfg(model_type)
    model = build_unsharded_model(cfg, attn_for(cfg), seed=0).train()
    transform, why = logit_transform(model)
    assert transform is not None and transform.ops == ARCHS[model_type][1], why
    tensors = packed_batch()
    ref_loss, ref_grads = own_loss_and_grads(model, tensors)
    loss, grads = chunked_loss_and_grads(model, tensors)
    assert_same(loss, grads, ref_loss, ref_grads)
    with torch.no_grad():  # the validation forward: the same figure without a graph
        no_grad = summed_token_loss(model, tensors, "chunked", CHUNK).item()
        head = model.get_output_embeddings().weight
        skipped = chunked_cross_entropy_sum(final_hidden(model, tensors), head, shifted_targets(tensors["labels"]), 7)
    assert abs(no_grad - ref_loss) <= RTOL * abs(ref_loss)
    if transform.ops:  # the negative control: the head alone (the old chunked loss) is another objective
        assert abs(skipped.item() - ref_loss) > 0.2 * ref_loss
    else:
        assert abs(skipped.item() - ref_loss) <= RTOL * ref_loss


def test_the_softcapped_chunks_never_allocate_the_micro_batch_logits():
    """The softcap path makes each chunk's logits itself, under checkpoint: the largest allocation of a step
    stays below the [B, S, V] logits (which the full path does allocate)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = 4096  # the logits then dominate every other tensor of the tiny model
    cfg = {"config": dict(model_cfg("gemma3_text")["config"], vocab_size=vocab, initializer_range=0.02)}
    model = build_unsharded_model(cfg, attn_for(cfg), seed=0).train()
    tensors = packed_batch()
    logits_bytes = tensors["input_ids"].numel() * vocab * 4
    for kind in ("chunked", "full"):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            summed_token_loss(model, tensors, kind, 8).backward()
        largest = max(e.cpu_memory_usage for e in prof.events())
        if kind == "chunked":  # the [V, H] head gradient (0.5 MB) is the largest, never the 1.3 MB logits
            assert largest < logits_bytes / 2
        else:
            assert largest >= logits_bytes


# ---------------------------------------------------------------- forwards wattgate does not recognize


def _llama_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY)
    cfg.use_cache = False
    return cfg


def _own_forward_model(transform_name: str):
    """A Llama whose forward does something else to its logits after the head (a learned temperature, a
    transform decided by an argument): not a known transform, so the chunked loss must not be used."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class LearnedTemperature(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.temperature = torch.nn.Parameter(torch.tensor(0.3))

        def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
            outputs = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits * self.temperature
            loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    class ArgumentSoftcap(LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, labels=None, cap=2.0, **kwargs):
            outputs = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(hidden_states)
            if cap:
                logits = torch.tanh(logits / cap) * cap
            loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    torch.manual_seed(0)
    cls = {"temperature": LearnedTemperature, "argument": ArgumentSoftcap}[transform_name]
    return cls(_llama_config()).train()


@pytest.mark.parametrize(
    "transform_name, why",
    [
        ("temperature", "scales its logits by `self.temperature`, a Parameter"),
        ("argument", "decides its logits by `cap`"),
    ],
)
def test_a_forward_with_an_unknown_logit_transform_trains_on_its_own_logits_with_one_notice(
    transform_name, why, capsys
):
    model = _own_forward_model(transform_name)
    tensors = packed_batch()
    transform, reason = logit_transform(model)
    assert transform is None and why in reason
    assert effective_loss_kind(model, "chunked") == "full"
    ref_loss, ref_grads = own_loss_and_grads(model, tensors)
    loss, grads = chunked_loss_and_grads(model, tensors)  # asked for chunked: runs the model's own forward
    assert_same(loss, grads, ref_loss, ref_grads)
    summed_token_loss(model, tensors, "chunked", CHUNK)
    notices = [line for line in capsys.readouterr().err.splitlines() if "train.loss" in line]
    assert len(notices) == 1, notices  # once per model, one line
    assert "training with train.loss full instead" in notices[0] and why in notices[0]


@pytest.mark.parametrize(
    "model_type, extra, ops",
    [
        ("falcon_h1", {"lm_head_multiplier": 0.5}, (("scale", 0.5),)),  # logits = lm_head(h) * multiplier
        ("granite", {"logits_scaling": 1.0}, ()),  # a scale of 1 is no transform
        ("gemma2", {"final_logit_softcapping": None}, ()),  # the `if` is decided by the config
        ("opt", {}, ()),  # self.model.decoder(...), lm_head(h).contiguous()
        ("mamba", {}, None),  # lm_head(hidden_states.to(dtype)): not a form it knows, so full
    ],
)
def test_the_transform_is_read_from_the_forward_and_its_config(model_type, extra, ops):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **dict(TINY, **extra))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    transform, why = logit_transform(model)
    if ops is None:
        assert transform is None and why.startswith("MambaForCausalLM.forward")
    else:
        assert transform is not None and transform.ops == ops, why


# ---------------------------------------------------------------- Gemma 2 and 3 build, load and train


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_builds_on_meta_with_the_models_own_buffers_and_init(model_type):
    """Random init (model.config): buffers as transformers computes them, norms at Gemma's zeros (1 + w)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model_cfg(model_type)
    model = build_unsharded_model(cfg, attn_for(cfg), seed=0)
    plain = dict(cfg["config"])
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(plain.pop("model_type"), **plain))
    ref_buffers, buffers = dict(ref.named_buffers()), dict(model.named_buffers())
    assert "model.embed_tokens.embed_scale" in buffers and ref_buffers.keys() == buffers.keys()
    for name, value in ref_buffers.items():
        assert torch.equal(buffers[name], value), name
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert norms and all(torch.equal(p, torch.zeros_like(p)) for p in norms.values())


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_loads_a_transformers_folder_and_takes_a_training_step(tmp_path, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = dict(model_cfg(model_type)["config"])
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(plain.pop("model_type"), **plain))
    ref.save_pretrained(tmp_path, safe_serialization=True)
    cfg = {"path": str(tmp_path)}
    model = build_meta_model(cfg, attn_for(cfg))
    assert materialize(model, torch.device("cpu"), cfg, seed=0).startswith(str(tmp_path))
    model.config.use_cache = False
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    model.train()
    tensors = packed_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = summed_token_loss(model, tensors, "chunked", CHUNK)
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = summed_token_loss(model, tensors, "chunked", CHUNK)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert after.item() < before.item()


def test_auto_attention_is_a_kernel_the_model_runs_and_an_explicit_one_it_does_not_is_one_line():
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM

    assert resolve_attn_implementation("auto", "cpu", False, Gemma2ForCausalLM) == "eager"  # no sdpa softcap
    assert resolve_attn_implementation("auto", "cpu", False, Gemma3ForCausalLM) == "sdpa"
    with pytest.raises(InputError, match="Gemma2ForCausalLM does not support sdpa.*set it to auto or eager"):
        resolve_attn_implementation("sdpa", "cpu", False, Gemma2ForCausalLM)
    with pytest.raises(InputError, match="transformers cannot build gemma2 with sdpa"):
        build_meta_model(model_cfg("gemma2"), "sdpa")


# ---------------------------------------------------------------- FSDP2 on 2 gloo ranks


def test_under_fsdp2_the_softcapped_chunked_loss_equals_the_models_own_logits(tmp_path):
    """tests/dist/sharded_loss_step.py (a torchrun script): one step's gradients with each loss kind, sharded."""
    train = {"seq_len": 48, "micro_batch_size": 2, "attn_implementation": "auto", "activation_checkpointing": True}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run_name": "t", "model": model_cfg("gemma2"), "train": train}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(REPO / "tests/dist/sharded_loss_step.py"), str(cfg), str(tmp_path / "probe")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    p = json.loads((tmp_path / "probe/loss-probe.json").read_text())
    assert abs(p["chunked_loss"] - p["full_loss"]) <= RTOL * abs(p["full_loss"])
    assert p["max_grad_delta"] <= RTOL * max(1.0, p["max_grad"])
    assert abs(p["no_grad_chunked"] - p["no_grad_full"]) <= RTOL * abs(p["no_grad_full"])
    assert p["resharded_after_backward"]
    assert proc.stdout.count("logit transform (x 0.5 then tanh then x 2)") == 1  # rank 0 says it, once


def test_under_bf16_mixed_precision_a_router_transformers_keeps_in_float32_routes_in_float32(tmp_path):
    """tests/dist/router_precision.py: DeepSeek-V3 sharded with the GPU's bf16 policy (on the CPU here). Its router
    all-gathers in float32, so its logits are those of the float32 master weight (a bf16 copy moves them by
    ~1e-3 and sends some tokens elsewhere); the rest of the layer computes in bf16 as before."""
    from support.architectures import tiny_config

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(REPO / "tests/dist/router_precision.py"), json.dumps(tiny_config("deepseek_v3"))]
    cmd += [str(tmp_path / "router.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads((tmp_path / "router.json").read_text())
    assert seen["router"]["dtype"] == "float32" and seen["master_dtype"] == "float32"
    assert seen["o_proj"]["dtype"] == "bfloat16"  # the policy is on: the layer's other weights are gathered in bf16
    assert seen["logits_max_difference"] <= 1e-6, seen


# ---------------------------------------------------------------- wattgate train end to end


@pytest.mark.parametrize("model_type", ["granite", "gemma3_text"])
def test_wattgate_train_reports_the_validation_loss_of_the_models_own_forward(tmp_path, model_type):
    """torchrun, 2 gloo ranks, one AdamW step, then validation and a float32 export: the reported validation
    loss is what transformers' own forward of final/ gives on the held-out documents."""
    lengths = np.random.default_rng(3).integers(5, 60, 40).tolist()
    pretokenized = write_random_pretokenized(
        tmp_path / "pretokenized", lengths, TINY["vocab_size"], 0, shard_docs=7, validation_fraction=0.25
    )
    train = dict(seq_len=64, micro_batch_size=2, grad_accum=1, max_steps=1, checkpoint_every=1, lr=1e-2)
    train.update(warmup_steps=0, log_every=1, export_dtype="float32")
    config = run_config(
        {
            "run_name": "t",
            "train": train,
            "model": model_cfg(model_type),
            "cluster": {"nodes": 1, "gpus_per_node": 2},
        }
    )
    build_plan(config, pretokenized, tmp_path / "plan")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_json()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "wattgate"]
    cmd += ["train", "--config", str(tmp_path / "config.yaml"), "--pretokenized", str(pretokenized)]
    cmd += ["--plan", str(tmp_path / "plan"), "--run-dir", str(tmp_path / "out")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"logit transform ({'x 0.125' if model_type == 'granite' else 'x 0.5 then tanh then x 2'})" in proc.stdout
    rows = pq.read_table(tmp_path / "out" / "eval.parquet").to_pylist()
    assert [r["step"] for r in rows] == [1]
    reference = scored_by_transformers(tmp_path / "out" / "final", pretokenized)
    print(f"{model_type}: reported {rows[0]['loss']:.9f}, transformers' forward of final/ {reference:.9f}")
    assert abs(rows[0]["loss"] - reference) <= RTOL * reference


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "granite"])
def test_the_collective_proof_builds_the_model_with_a_kernel_it_runs(tmp_path, model_type):
    """The gate's dry run builds with the attention kernel training would pick on CPU (Gemma 2 has no sdpa). One
    decoder layer: mixed layer types (Gemma's sliding/full pattern) are a limit of the proof's depth scaling."""
    from wattgate.proof.prove import prove_collectives

    lengths = np.random.default_rng(3).integers(5, 60, 40).tolist()
    pretokenized = write_random_pretokenized(
        tmp_path / "pretokenized", lengths, TINY["vocab_size"], 0, shard_docs=7, validation_fraction=0.25
    )
    train = dict(seq_len=64, micro_batch_size=2, grad_accum=1, max_steps=2, checkpoint_every=1, warmup_steps=0)
    model = model_cfg(model_type)
    model["config"].update(num_hidden_layers=1)
    model["config"].pop("layer_types", None)
    config = run_config({"run_name": "t", "train": train, "model": model, "cluster": {"nodes": 1, "gpus_per_node": 2}})
    build_plan(config, pretokenized, tmp_path / "plan")
    report = prove_collectives(config, pretokenized, tmp_path / "plan").to_json()
    assert report["passed"], report["detail"]

"""The chunked loss (train.loss: chunked, the default) equals the full-logits loss and gives the same gradient
for every parameter, and never builds the [micro_batch, seq_len, vocab] logits.

Equality is checked in fp32 on this machine for tied and untied embeddings, micro_batch_size 1 and 2,
every train.attn_implementation the schema allows that trains on CPU (flash_attention_2 through
transformers' real dispatch with sdpa standing in for flash_attn's kernels; flex_attention has no
backward on CPU and is skipped by name), activation checkpointing on and off, and per-token and
assistant-only loss masks; single-process here and FSDP2 on 2 gloo ranks (tests/dist/sharded_loss_step.py).
Tolerance: the summed loss within 1e-5 relative, every gradient element within 1e-5 x max(1, max |grad|):
fp32 round-off of a different summation order (measured deltas are ~1e-6 of the largest gradient).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.train.data import IGNORE, DocStore, build_batch
from wattgate.train.loss import DEFAULT_CHUNK_TOKENS, check_loss_keys, shifted_targets, summed_token_loss, to_tensors
from wattgate.train.model import apply_activation_checkpointing

from conftest import DOC_LENGTHS, PACKS, SCHEMA_CHOICES, SEQ_LEN, TINY

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
CHUNK = 13  # does not divide the rows: the last chunk is partial
FLEX_SKIP = "flex_attention has no backward on CPU (torch raises NotImplementedError); its logits: test_attention.py"


def tiny_model(impl: str, tied: bool, activation_checkpointing: bool, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY, tie_word_embeddings=tied, **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(3)
    # transformers refuses to build flash_attention_2 without flash_attn: build sdpa, then switch dispatch
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config._attn_implementation = impl
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    return model.train()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> DocStore:
    path = write_random_pretokenized(tmp_path_factory.mktemp("p") / "pretokenized", DOC_LENGTHS, 96, 0, shard_docs=2)
    return DocStore(path)


def assistant_only(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Labels as chat masking makes them: each document's first 40% (the prompt) carries no loss."""
    pos = tensors["position_ids"]
    starts = (pos == 0).long().cumsum(1)  # document number within the row
    length = torch.zeros_like(pos)
    for b in range(pos.shape[0]):
        for d in starts[b].unique():
            where = starts[b] == d
            length[b, where] = int(where.sum())
    labels = torch.where(pos >= (0.4 * length).ceil().long(), tensors["input_ids"], IGNORE)
    return dict(tensors, labels=labels)


def batch(store: DocStore, micro_batch_size: int, masks: str) -> dict[str, torch.Tensor]:
    b = build_batch(store, [np.array(p) for p in PACKS[micro_batch_size]], seq_len=SEQ_LEN)
    tensors = to_tensors(b, torch.device("cpu"))
    return assistant_only(tensors) if masks == "assistant" else tensors


def loss_and_grads(model, tensors, kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = summed_token_loss(model, tensors, kind, CHUNK)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.ndim == 0
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("masks", ["per_token", "assistant"])
@pytest.mark.parametrize("activation_checkpointing", [False, True], ids=["no_ac", "ac"])
@pytest.mark.parametrize("choice", SCHEMA_CHOICES)
@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_chunked_loss_and_gradients_equal_the_full_logits_path(
    store,
    reference_flash_kernel,  # noqa: F811 (the fixture imported above)
    tied,
    micro_batch_size,
    choice,
    activation_checkpointing,
    masks,
):
    impl = "sdpa" if choice == "auto" else choice  # auto is sdpa on CPU (test_attention.py)
    if impl == "flex_attention":
        pytest.skip(FLEX_SKIP)
    model = tiny_model(impl, tied, activation_checkpointing)
    tensors = batch(store, micro_batch_size, masks)
    full_loss, full = loss_and_grads(model, tensors, "full")
    chunked_loss, chunked = loss_and_grads(model, tensors, "chunked")
    if impl == "flash_attention_2":
        assert reference_flash_kernel, "the flash dispatch did not run"
    assert abs(chunked_loss - full_loss) <= RTOL * abs(full_loss)
    scale = max(1.0, max(g.abs().max().item() for g in full.values()))
    worst = max((chunked[n] - full[n]).abs().max().item() for n in full)
    assert worst <= RTOL * scale, f"max |dgrad| {worst:.2e} (max |grad| {scale:.2e})"
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():  # the validation forward: same figure without a graph
        no_grad = summed_token_loss(model, tensors, "chunked", CHUNK).item()
    assert abs(no_grad - full_loss) <= RTOL * abs(full_loss)


def largest_allocation(step) -> int:
    """Bytes of the largest CPU allocation any op (torch's chunked loss op included) makes in step()."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("kind", ["chunked", "full"])
def test_the_chunked_step_never_allocates_the_micro_batch_logits(store, kind):
    vocab = 4096  # logits then dominate every other tensor of the tiny model
    model = tiny_model("sdpa", tied=True, activation_checkpointing=False, vocab_size=vocab)
    tensors = batch(store, 2, "per_token")
    logits_bytes = 2 * SEQ_LEN * vocab * 4
    largest = largest_allocation(lambda: summed_token_loss(model, tensors, kind, CHUNK).backward())
    if kind == "chunked":  # the [V, H] head gradient (0.5 MB) is the largest, no [B, S, V] tensor (2 MB)
        assert largest < logits_bytes / 2
    else:  # the reference does build them: the measurement can see logits
        assert largest >= logits_bytes


def test_targets_shift_within_each_row():
    labels = torch.tensor([[IGNORE, 5, 6, IGNORE], [IGNORE, 7, IGNORE, 8]])
    assert shifted_targets(labels).tolist() == [[5, 6, IGNORE, IGNORE], [7, IGNORE, 8, IGNORE]]


def test_loss_keys_come_from_the_schema_defaults_and_bad_values_are_refused():
    train = run_config({"run_name": "t", "model": {"config": {"model_type": "qwen3"}}}).train
    assert (train.loss, train.loss_chunk_tokens) == ("chunked", DEFAULT_CHUNK_TOKENS)
    check_loss_keys("full", 64)
    # a TrainConfig.replace skips the schema's checks: the loss refuses what it cannot run, whatever built it
    with pytest.raises(InputError, match="train.loss: 'logits'"):
        check_loss_keys(train.replace(loss="logits").loss, DEFAULT_CHUNK_TOKENS)
    for bad in (0, True, 1.5):
        with pytest.raises(InputError, match="train.loss_chunk_tokens"):
            check_loss_keys("chunked", bad)
    with pytest.raises(InputError, match="train.loss: 'logits'"):
        summed_token_loss(None, {}, "logits", DEFAULT_CHUNK_TOKENS)


# ---------------------------------------------------------------- FSDP2 on 2 gloo ranks


def probe(tmp_path: Path, tied: bool, micro_batch_size: int, activation_checkpointing: bool) -> dict:
    model = dict(TINY, tie_word_embeddings=tied)
    train = {
        "seq_len": 48,
        "micro_batch_size": micro_batch_size,
        "attn_implementation": "sdpa",
        "activation_checkpointing": activation_checkpointing,
    }
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run_name": "t", "model": {"config": model}, "train": train}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(REPO / "tests/dist/sharded_loss_step.py"), str(cfg), str(tmp_path / "probe")]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "probe/loss-probe.json").read_text())


@pytest.mark.parametrize(
    "tied, micro_batch_size, activation_checkpointing", [(True, 2, False), (False, 1, True)], ids=["tied", "untied"]
)
def test_under_fsdp2_the_chunked_loss_gathers_the_head_and_equals_the_full_path(
    tmp_path, tied, micro_batch_size, activation_checkpointing
):
    p = probe(tmp_path, tied, micro_batch_size, activation_checkpointing)
    assert p["world"] == 2 and p["tied"] == tied
    assert abs(p["chunked_loss"] - p["full_loss"]) <= RTOL * abs(p["full_loss"])
    assert p["max_grad_delta"] <= RTOL * max(1.0, p["max_grad"])
    assert abs(p["no_grad_chunked"] - p["no_grad_full"]) <= RTOL * abs(p["no_grad_full"])
    assert p["resharded_after_backward"]  # the gathered head is freed again


# ---------------------------------------------------------------- train.compile


@pytest.mark.slow  # inductor compiles the layer on first use: ~50-80 s on this 2-core machine
def test_compiled_layers_keep_their_names_and_give_the_eager_loss_and_gradients(store):
    from wattgate.train.model import compile_layers

    eager = tiny_model("sdpa", tied=True, activation_checkpointing=False)
    compiled = tiny_model("sdpa", tied=True, activation_checkpointing=False)
    compile_layers(compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    tensors = batch(store, 2, "assistant")
    eager_loss, eager_grads = loss_and_grads(eager, tensors, "chunked")
    compiled_loss, compiled_grads = loss_and_grads(compiled, tensors, "chunked")
    assert abs(compiled_loss - eager_loss) <= RTOL * abs(eager_loss)
    scale = max(1.0, max(g.abs().max().item() for g in eager_grads.values()))
    assert max((compiled_grads[n] - eager_grads[n]).abs().max().item() for n in eager_grads) <= RTOL * scale

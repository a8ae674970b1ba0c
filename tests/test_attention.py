"""Packed attention: a packed micro-batch gives the same logits and gradients as its documents run one
by one, for every train.attn_implementation the schema allows and micro_batch_size 1 and 2; the
flash_attention_2 cross-document defect (batch dim > 1) is reproduced and guarded on CPU with a
reference kernel; and which kernel `auto` picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wattgate.config import validate_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.errors import InputError
from wattgate.train import attention
from wattgate.train.attention import FLASH_VARLEN, cu_seq_lens, packed_model_inputs, resolve_attn_implementation
from wattgate.train.data import IGNORE, DocStore, build_batch
from wattgate.train.loss import forward_logits, loss_sum, to_tensors

from conftest import DOC_LENGTHS, PACKS, SCHEMA_CHOICES, SEQ_LEN, TINY

# flex_attention compiles with inductor on first use: 25 s (warm cache) to 55 s on 2 CPU cores
CHOICES = [pytest.param(c, marks=pytest.mark.slow) if c == "flex_attention" else c for c in SCHEMA_CHOICES]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLEX_NO_CPU_BACKWARD = "FlexAttention has no backward on CPU (torch raises NotImplementedError)"


def tiny_model(attn_implementation: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.to(DEVICE)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> DocStore:
    path = write_random_pretokenized(tmp_path_factory.mktemp("p") / "pretokenized", DOC_LENGTHS, 96, 0, shard_docs=2)
    return DocStore(path)


def packed_tensors(store: DocStore, micro_batch_size: int) -> dict[str, torch.Tensor]:
    batch = build_batch(store, [np.array(p) for p in PACKS[micro_batch_size]], seq_len=SEQ_LEN)
    return to_tensors(batch, DEVICE)


def documents(store: DocStore, micro_batch_size: int):
    """(row, start, input_ids [1, n], labels [1, n]) of each document, in pack order."""
    for row, docs in enumerate(PACKS[micro_batch_size]):
        pos = 0
        for d in docs:
            ids, mask = store.get(d)
            ids_t = torch.from_numpy(ids.astype(np.int64)).to(DEVICE)
            labels = torch.where(torch.from_numpy(mask.astype(bool)).to(DEVICE), ids_t, IGNORE)
            yield row, pos, ids_t[None], labels[None]
            pos += len(ids)


def concrete(choice: str) -> str:
    """The implementation a schema choice trains with on this machine (skips what cannot run here)."""
    if choice == "auto":
        return resolve_attn_implementation("auto", DEVICE.type)
    if choice in FLASH_VARLEN and not (DEVICE.type == "cuda" and attention.flash_attn_importable()):
        pytest.skip(f"{choice}: flash_attn kernel not importable here (needs the flash-attn package and CUDA)")
    return choice


def autocast_for(impl: str):
    # flash_attn has no fp32 kernel: run it (and its reference) the way training does, bf16 compute
    enabled = impl in FLASH_VARLEN and DEVICE.type == "cuda"
    return torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=enabled)


def tolerance(impl: str, fp32: float) -> float:
    return 3e-2 if impl in FLASH_VARLEN and DEVICE.type == "cuda" else fp32


def pair(impl: str):
    """The model under test and an eager twin with the same weights (the per-document reference)."""
    model = tiny_model(impl)
    reference = tiny_model("eager")
    reference.load_state_dict(model.state_dict())
    return model, reference


def max_logit_delta(model, reference, store, micro_batch_size: int) -> float:
    tensors = packed_tensors(store, micro_batch_size)
    with torch.no_grad():
        packed = forward_logits(model, tensors)
        assert packed.shape == (micro_batch_size, SEQ_LEN, TINY["vocab_size"])
        delta = 0.0
        for row, start, ids, _ in documents(store, micro_batch_size):
            alone = reference(input_ids=ids, use_cache=False).logits[0]
            delta = max(delta, (packed[row, start : start + ids.shape[1]].float() - alone.float()).abs().max().item())
    return delta


def max_grad_delta(model, reference, store, micro_batch_size: int) -> tuple[float, float, float]:
    """loss_sum on the packed micro-batch vs the sum of per-document losses, backward through both:
    (relative loss delta, max |delta grad| over parameters, max |grad|)."""
    model.train()
    reference.train()
    tensors = packed_tensors(store, micro_batch_size)
    packed_loss = loss_sum(forward_logits(model, tensors), tensors["labels"])
    packed_loss.backward()
    separate_loss = sum(
        loss_sum(reference(input_ids=ids, use_cache=False).logits, labels)
        for _, _, ids, labels in documents(store, micro_batch_size)
    )
    separate_loss.backward()
    loss_delta = ((packed_loss - separate_loss).abs() / separate_loss.abs()).item()
    grads = dict(reference.named_parameters())
    deltas, scale = [], []
    for name, p in model.named_parameters():
        deltas.append((p.grad - grads[name].grad).abs().max().item())
        scale.append(grads[name].grad.abs().max().item())
    return loss_delta, max(deltas), max(scale)


# ---------------------------------------------------------------- every schema choice, logits and gradients


@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("choice", CHOICES)
def test_packed_logits_equal_documents_run_one_by_one(store, choice, micro_batch_size):
    impl = concrete(choice)
    model, reference = pair(impl)
    model.eval()
    reference.eval()
    with autocast_for(impl):
        delta = max_logit_delta(model, reference, store, micro_batch_size)
    assert delta < tolerance(impl, 1e-5), f"{impl}: packed documents attend to each other (max |dlogit| {delta})"


@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("choice", SCHEMA_CHOICES)
def test_packed_gradients_equal_documents_run_one_by_one(store, choice, micro_batch_size):
    impl = concrete(choice)
    if impl == "flex_attention" and DEVICE.type == "cpu":
        pytest.skip(f"gradients of flex_attention: {FLEX_NO_CPU_BACKWARD}; its logits are tested")
    model, reference = pair(impl)
    with autocast_for(impl):
        loss_delta, delta, scale = max_grad_delta(model, reference, store, micro_batch_size)
    assert loss_delta < tolerance(impl, 1e-5), f"{impl}: packed loss differs by {loss_delta:.1e} (relative)"
    assert delta < tolerance(impl, 1e-5) * max(scale, 1.0), f"{impl}: max |dgrad| {delta} (max |grad| {scale})"


def test_a_cache_makes_packed_documents_attend_to_each_other(store):
    """The measured pitfall (PITFALLS.md): use_cache=True (transformers' default) leaks across documents."""
    model = tiny_model("sdpa").eval()
    tensors = packed_tensors(store, 2)
    with torch.no_grad():
        packed = forward_logits(model, tensors)
        leaky = model(input_ids=tensors["input_ids"], position_ids=tensors["position_ids"], use_cache=True).logits
    assert (leaky - packed).abs().max() > 1e-3


# ---------------------------------------------------------------- flash_attention_2 without its kernel


def flash_pair():
    """Model (flash_attention_2 dispatch) and eager reference with the same weights. transformers
    refuses to build flash_attention_2 without flash_attn, so the model is switched after building."""
    model, reference = pair("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    return model, reference


def document_bounds(micro_batch_size: int) -> list[int]:
    """Cumulative lengths of the documents and padding blocks of PACKS, rows back to back."""
    bounds, offset = [0], 0
    for docs in PACKS[micro_batch_size]:
        for d in docs:
            bounds.append(bounds[-1] + DOC_LENGTHS[d])
        offset += SEQ_LEN
        if bounds[-1] < offset:  # the padding block is a document of its own
            bounds.append(offset)
    return bounds


def test_cu_seq_lens_are_the_document_boundaries_of_the_flattened_micro_batch(store):
    tensors = packed_tensors(store, 2)
    inputs = packed_model_inputs(tensors["input_ids"], tensors["position_ids"], "flash_attention_2")
    assert inputs["input_ids"].shape == inputs["position_ids"].shape == (1, 2 * SEQ_LEN)
    assert cu_seq_lens(tensors["position_ids"]).tolist() == document_bounds(2) == [0, 17, 26, 56, 64, 69, 91, 128]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32 and inputs["max_length_q"] == 37
    # a full row of one document still starts a document of its own after the row before it
    assert cu_seq_lens(torch.arange(4).repeat(2, 1)).tolist() == [0, 4, 8]


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
def test_mask_based_kernels_keep_rows_so_no_micro_batch_squared_mask(store, impl):
    # flattened, sdpa/eager would build one [1, 1, B*S, B*S] mask: B times the memory of [B, 1, S, S]
    tensors = packed_tensors(store, 2)
    inputs = packed_model_inputs(tensors["input_ids"], tensors["position_ids"], impl)
    assert set(inputs) == {"input_ids", "position_ids"} and inputs["input_ids"].shape == (2, SEQ_LEN)


def test_flash_attention_2_on_unflattened_rows_leaks_across_documents(store, reference_flash_kernel):
    """The measured defect: with batch dim 2, transformers does not detect packing for flash attention
    and runs causal attention over each whole row."""
    model, reference = flash_pair()
    model.eval()
    tensors = packed_tensors(store, 2)
    with torch.no_grad():
        naive = model(input_ids=tensors["input_ids"], position_ids=tensors["position_ids"], use_cache=False).logits
        fixed = forward_logits(model, tensors)
    assert reference_flash_kernel[-1] == document_bounds(2)  # forward_logits went through varlen
    assert (naive - fixed).abs().max() > 1e-2


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_flash_attention_2_dispatch_keeps_documents_apart(store, reference_flash_kernel, micro_batch_size):
    model, reference = flash_pair()
    model.eval()
    reference.eval()
    assert max_logit_delta(model, reference, store, micro_batch_size) < 1e-5
    loss_delta, delta, scale = max_grad_delta(model, reference, store, micro_batch_size)
    assert loss_delta < 1e-5 and delta < 1e-5 * max(scale, 1.0)
    # each layer of both packed forwards (logits, then gradients) got the document boundaries
    assert reference_flash_kernel == [document_bounds(micro_batch_size)] * (2 * TINY["num_hidden_layers"])


# ---------------------------------------------------------------- which kernel auto picks


def test_every_schema_choice_validates():
    base = {"run_name": "t", "model": {"config": TINY}, "cluster": {"nodes": 1, "gpus_per_node": 1}}
    assert validate_config(base)["train"]["attn_implementation"] == "auto"
    for choice in SCHEMA_CHOICES:
        checked = validate_config(dict(base, train={"attn_implementation": choice}))
        assert checked["train"]["attn_implementation"] == choice


def test_auto_resolves_to_sdpa_on_cpu():
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("sdpa", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"


@pytest.mark.parametrize(
    "flash, flex, bf16, expect",
    [
        (True, True, True, "flash_attention_2"),
        (True, True, False, "flex_attention"),  # flash_attn has no fp32 kernel
        (False, True, True, "flex_attention"),
        (False, False, True, "sdpa"),
    ],
)
def test_auto_on_cuda_prefers_kernels_without_a_seq_len_squared_mask(monkeypatch, flash, flex, bf16, expect):
    monkeypatch.setattr(attention, "flash_attn_importable", lambda: flash)
    monkeypatch.setattr(attention, "flex_attention_trainable", lambda device_type: flex and device_type == "cuda")
    assert resolve_attn_implementation("auto", "cuda", bf16=bf16) == expect
    assert resolve_attn_implementation("auto", "cpu", bf16=bf16) == "sdpa"


def test_kernels_that_cannot_train_here_are_one_line_input_errors(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_importable", lambda: False)
    with pytest.raises(InputError, match=r"^train\.attn_implementation: flash_attention_2 needs the flash_attn"):
        resolve_attn_implementation("flash_attention_2", "cuda")
    with pytest.raises(InputError, match="flash_attention_2 needs CUDA"):
        resolve_attn_implementation("flash_attention_2", "cpu")
    monkeypatch.setattr(attention, "flash_attn_importable", lambda: True)
    with pytest.raises(InputError, match="no fp32 kernel"):
        resolve_attn_implementation("flash_attention_2", "cuda", bf16=False)
    with pytest.raises(InputError, match="flex_attention has no backward on CPU"):
        resolve_attn_implementation("flex_attention", "cpu")
    with pytest.raises(InputError, match="not one of"):
        resolve_attn_implementation("flash", "cuda")
    for err in ("flash_attention_2", "flex_attention"):
        with pytest.raises(InputError) as info:
            resolve_attn_implementation(err, "cpu")
        assert "\n" not in str(info.value)

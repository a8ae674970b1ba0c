"""Which attention kernel trains packed rows, and the model inputs that keep it inside each document.

A packed row holds several documents; position_ids restart at 0 at each one. transformers 5.24
turns that into per-document attention differently per implementation (read from its source):

- sdpa, eager: masking_utils derives document ids from position_ids (no attention_mask, no cache)
  and builds a [B, 1, S, S] mask; correct for any batch size. Flattening the micro-batch would
  make that mask [1, 1, B*S, B*S]: B times the memory and the compute, so rows stay as they are.
- flex_attention: the same document ids become a block mask (per row, via the batch index), so no
  S x S tensor exists and cross-document blocks are skipped; correct for any batch size.
- flash_attention_2: no mask at all. Packing is detected from position_ids only when the batch
  dimension is 1 (`_is_packed_sequence`); with B > 1 plain causal attention runs over the whole
  row and documents see each other. So the micro-batch becomes one row [1, B*S] and the document
  boundaries (cu_seq_lens) are passed in, which also spares HF re-deriving them in every layer
  (a device sync per layer).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from wattgate.errors import InputError

# Implementations that go through transformers' _flash_attention_forward (varlen by cu_seq_lens).
FLASH_VARLEN = frozenset({"flash_attention_2", "flash_attention_3", "flash_attention_4"})
EXPLICIT = ("sdpa", "eager", "flash_attention_2", "flex_attention")


def flash_attn_importable() -> bool:
    """The flash_attn package imports (a real import: a wheel built for another torch fails here)."""
    try:
        importlib.import_module("flash_attn")
    except Exception:  # ImportError, or OSError/undefined symbol from a mismatched build
        return False
    return True


def flex_attention_trainable(device_type: str) -> bool:
    """FlexAttention can run forward and backward here: CUDA with triton (no backward on CPU)."""
    if device_type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return False
    return True


# the transformers PreTrainedModel flag that says a model class runs each kernel
SUPPORT_FLAGS = {
    "flash_attention_2": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
    "sdpa": "_supports_sdpa",
}


def model_supports(model_class, implementation: str) -> bool:
    """Whether `model_class` (a transformers model class; None: any) declares it runs `implementation`
    (Gemma 2 does not run sdpa: it has no attention softcapping). eager always runs."""
    flag = SUPPORT_FLAGS.get(implementation)
    return model_class is None or flag is None or bool(getattr(model_class, flag, False))


def resolve_attn_implementation(requested: str, device_type: str, bf16: bool = True, model_class=None) -> str:
    """The transformers attn_implementation to build the model with, for train.attn_implementation.

    `bf16`: the forward runs in bf16 (train.mixed_precision bf16 on GPUs); flash_attn has no fp32
    kernel. auto: flash_attention_2 on CUDA in bf16 when flash_attn imports, else flex_attention on
    CUDA when it can train, else sdpa (always on CPU), else eager, each only when `model_class` (the
    transformers class that will be built) supports it. An explicit choice that cannot train here is
    an InputError, not a silent switch: the user asked for that kernel and its speed.
    """
    if requested not in ("auto", *EXPLICIT):
        raise InputError(f"train.attn_implementation: {requested!r} is not one of auto, {', '.join(EXPLICIT)}")
    flash_ok = device_type == "cuda" and bf16 and flash_attn_importable()
    if requested == "auto":
        candidates = [
            ("flash_attention_2", flash_ok),
            ("flex_attention", flex_attention_trainable(device_type)),
            ("sdpa", True),
        ]
        return next((k for k, ok in candidates if ok and model_supports(model_class, k)), "eager")
    if model_class is not None and not model_supports(model_class, requested):  # None: any class supports it
        raise InputError(
            f"train.attn_implementation: {model_class.__name__} does not support {requested} "
            "(transformers says so); set it to auto or eager"
        )
    if requested == "flash_attention_2" and not flash_ok:
        if device_type != "cuda":
            why = "needs CUDA"
        elif not bf16:
            why = "has no fp32 kernel (set train.mixed_precision: bf16)"
        else:
            why = "needs the flash_attn package, which does not import (pip install flash-attn for this torch)"
        raise InputError(f"train.attn_implementation: flash_attention_2 {why}; or set it to auto or sdpa")
    if requested == "flex_attention" and not flex_attention_trainable(device_type):
        why = "has no backward on CPU" if device_type != "cuda" else "needs triton (torch.compile)"
        raise InputError(f"train.attn_implementation: flex_attention {why}; set it to auto or sdpa")
    return requested


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, S]: True where a document (or the padding block) begins.

    position_ids restart at 0 at each document (train/data.py); a row always starts a document,
    so no document can run on from the end of one row into the next once rows are flattened.
    """
    starts = position_ids == 0
    starts[:, 0] = True
    return starts


def cu_seq_lens(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative document lengths over the flattened micro-batch (int32, flash_attn's varlen format)."""
    starts = document_starts(position_ids).flatten().nonzero().flatten()
    total = torch.tensor([position_ids.numel()], device=position_ids.device)
    return torch.cat([starts, total]).to(torch.int32)


def packed_model_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, attn_implementation: str) -> dict:
    """Keyword arguments for model(...) that keep attention inside each document of [B, S] packed rows.

    Flash kernels get one row [1, B*S] plus explicit boundaries (see the module docstring);
    the others get the rows as they are. Logits come back as [1, B*S, V] or [B, S, V].
    """
    if attn_implementation not in FLASH_VARLEN:
        return {"input_ids": input_ids, "position_ids": position_ids}
    cu = cu_seq_lens(position_ids)
    longest = int(cu.diff().max())  # flash_attn wants a Python int: one sync per micro-batch
    return {
        "input_ids": input_ids.reshape(1, -1),
        "position_ids": position_ids.reshape(1, -1),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }

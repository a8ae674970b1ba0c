"""The packed-attention tests' documents and layouts, and flash_attention_2's dispatch run on CPU (the attention
and loss tests share them)."""

import pytest

SEQ_LEN = 64
DOC_LENGTHS = [17, 9, 30, 5, 22]
# row 0: three documents + 8 padding; row 1: two documents + 37 padding
PACKS = {1: [[0, 1, 2]], 2: [[0, 1, 2], [3, 4]]}


def schema_attn_choices() -> list[str]:
    """Every train.attn_implementation the config schema allows."""
    from wattgate.config import load_schema

    return load_schema()["properties"]["train"]["properties"]["attn_implementation"]["enum"]


SCHEMA_CHOICES = schema_attn_choices()


def reference_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_func's contract on CPU: q [B, S, H, D], k/v [B, S, H_kv, D], attention over each whole row."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.fixture
def reference_flash_kernel(monkeypatch):
    """transformers' real flash_attention_2 dispatch (_flash_attention_forward) on CPU, with flash_attn's
    two entry points replaced by sdpa references. Returns the cu_seqlens each varlen call received."""
    import numpy as np
    import torch
    import transformers.modeling_flash_attention_utils as fa

    varlen_calls: list[list[int]] = []

    def reference_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False
    ):
        # flash_attn_varlen_func: q/k/v [total, H, D]; each [cu[i], cu[i+1]) segment attends only to itself
        bounds = cu_seqlens_q.tolist()
        varlen_calls.append(bounds)
        assert cu_seqlens_k.tolist() == bounds and max_seqlen_q == max(np.diff(bounds))
        return torch.cat(
            [
                reference_flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], dropout_p, softmax_scale, causal)[0]
                for a, b in zip(bounds, bounds[1:])
            ]
        )

    kernels = (reference_flash_attn_func, reference_varlen, None, fa._pad_input, fa._unpad_input)
    monkeypatch.setattr(fa, "_lazy_imports", lambda *args, **kwargs: kernels)
    for name in (
        "_loaded_implementation",
        "_flash_fn",
        "_flash_varlen_fn",
        "_flash_with_kvcache_fn",
        "_pad_fn",
        "_unpad_fn",
        "_process_flash_kwargs_fn",
        "_process_with_kvcache_kwargs_fn",
    ):
        monkeypatch.setattr(fa, name, None)
    return varlen_calls

"""Packed-sequence loss: summed next-token losses over loss-bearing positions (the caller normalizes
by the global batch's loss-token count).

Two kinds (train.loss):
- chunked (default): the decoder runs through its final norm and torch's F.linear_cross_entropy
  takes the last hidden state against lm_head's weight `loss_chunk_tokens` rows at a time, so at
  most chunk x vocab logits exist at once, never [micro_batch, seq_len, vocab]. With a graph it
  uses reduction "sum", which computes the hidden state's and the head's gradients in the forward
  (one pass over the chunks, no recompute in backward); torch accumulates that sum in the input
  dtype, so under bf16 the reported training loss is within ~1e-3 relative of the fp32 sum (7e-4
  measured on 8192 tokens; the gradients do not depend on it). Without a graph (validation) the
  per-token losses are summed in fp32 instead (1e-5). Under FSDP2 it runs as a forward method of
  the root (register_fsdp_forward_method): the head weight (embed_tokens' when tied) is
  all-gathered exactly there, as for the root's own forward, and reduce-scattered after backward.
- full: the [B, S, V] logits of the model's own forward (forward_logits) and their fp32 cross-entropy
  (loss_sum): the reference the chunked kind is tested against, and the baseline of bench/loss.py.

The loss is the model's own: some models change the head's output before their loss (Granite divides by
logits_scaling, Cohere multiplies by logit_scale, Gemma 2/3 softcap with tanh(x / c) * c). The chunked kind
reads what the model's forward does after its head from that forward's source (logit_transform): a scale is
folded into the hidden state (the same F.linear_cross_entropy); a tanh softcap makes each chunk's logits
here, one chunk at a time under torch.utils.checkpoint: one more head matmul per chunk in backward, and at
the peak of a chunk's backward about 4.5 chunk-sized fp32 tensors (the logits, tanh, log-softmax and their
gradients; 1.3 for the plain kernel, measured on CPU), never the micro-batch's. A forward it does not
recognize trains with the full kind instead, with a one-line notice: never on another objective than the
model's.

Both shift within each packed row: position t predicts label t+1 of the same row, and the
labels (train/data.py) are IGNORE at each document's first token, so no document predicts the next.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from wattgate.errors import InputError
from wattgate.train.attention import packed_model_inputs
from wattgate.train.data import IGNORE, Batch, host_tensors
from wattgate.train.logit_transform import PLAIN, LogitTransform, logit_transform
from wattgate.train.moe import aux_notice, gradient_only, router_aux, router_aux_term

LOSS_KINDS = ("chunked", "full")
# 1024 rows x 151,936 vocab is 0.62 GB of fp32 logits per chunk: small next to a step's activations,
# and large enough that each chunk's matmuls keep a GPU busy (see the schema's description)
DEFAULT_CHUNK_TOKENS = 1024
ROOT_LOSS_METHOD = "wattgate_chunked_loss"
ROOT_TOKEN_LOSSES_METHOD = "wattgate_chunked_token_losses"  # the validation pass's per-position losses
LOSS_NOTICE = "wattgate_loss_notice"  # set once effective_loss_kind has said which loss the model trains on


def check_loss_keys(kind: str, chunk_tokens: int) -> None:
    """train.loss and train.loss_chunk_tokens as the loss reads them (checked on every call: a config built in
    code, or a TrainConfig.replace, skips the schema's checks)."""
    if kind not in LOSS_KINDS:
        raise InputError(f"train.loss: {kind!r} is not one of {', '.join(LOSS_KINDS)}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InputError(f"train.loss_chunk_tokens: {chunk_tokens!r} must be a positive integer (tokens per chunk)")


def to_tensors(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (train/data.py host_tensors, then a copy)."""
    return {k: v.to(device, non_blocking=True) for k, v in host_tensors(batch, pin=False).items()}


def forward_logits(model, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [micro_batch_size, seq_len, vocab] with attention kept inside each packed document.

    No attention_mask and no cache: that is how transformers recognizes packed rows from
    position_ids. With a cache (use_cache defaults to True) documents silently attend to each
    other. Flash kernels need the micro-batch as one row (train/attention.py); logits are
    reshaped back so loss_sum still shifts within each row.
    """
    inputs = packed_model_inputs(tensors["input_ids"], tensors["position_ids"], model.config._attn_implementation)
    logits = model(**inputs, use_cache=False).logits
    return logits.view(*tensors["input_ids"].shape, logits.shape[-1])


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over loss-bearing positions (fp32)."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
    )


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: the label each position predicts (the next one in its row), IGNORE at each row's end.

    Shifting the targets rather than slicing the hidden state keeps hidden [B*S, H] a view (no copy).
    """
    out = torch.full_like(labels, IGNORE, dtype=torch.int64)
    out[:, :-1] = labels[:, 1:]
    return out


def final_hidden(model, tensors: dict[str, torch.Tensor], router_logits: list | None = None) -> torch.Tensor:
    """The decoder's output after its final norm, [B, S, H], with the same packed inputs as forward_logits;
    `router_logits` (a list) gets an MoE decoder's router logits of every layer appended."""
    inputs = packed_model_inputs(tensors["input_ids"], tensors["position_ids"], model.config._attn_implementation)
    if router_logits is not None:
        inputs["output_router_logits"] = True
    out = model.get_decoder()(**inputs, use_cache=False)
    if router_logits is not None:
        router_logits.extend(out.router_logits)
    hidden = out.last_hidden_state
    return hidden.view(*tensors["input_ids"].shape, hidden.shape[-1])


def with_router_term(model, loss: torch.Tensor, router_logits, labels: torch.Tensor) -> torch.Tensor:
    """`loss` carrying the gradient of an MoE model's router load-balancing term (train/moe.py router_aux_term,
    weighted by this micro-batch's loss tokens) and not its value: the reported losses stay the token loss."""
    if not router_logits:
        return loss
    tokens = (labels[:, 1:] != IGNORE).sum()
    return gradient_only(loss, router_aux_term(model, router_logits, tokens))


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = PLAIN,
) -> torch.Tensor:
    """fp32 sum over targets != IGNORE of cross_entropy(transform(hidden @ weight.T + bias)), chunk_tokens
    rows at a time."""
    flat, target = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    wants_grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
    scale = transform.scale
    if scale is None:
        return _checkpointed_chunks_sum(flat, weight, bias, target, chunk_tokens, transform, wants_grad)
    if scale != 1.0:  # s (h W^T + b) = (s h) W^T + s b: the hidden state [tokens, H] is far smaller than W
        flat = flat * scale
        bias = None if bias is None else bias * scale
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None)
    kwargs = dict(linear_bias=bias, ignore_index=IGNORE, options=options)
    if wants_grad:
        return F.linear_cross_entropy(flat, weight, target, reduction="sum", **kwargs).float()
    # no graph (validation): torch accumulates a "sum" in the input dtype (bf16 under mixed precision);
    # per-token losses summed here in fp32 keep the figure exact to fp32 at no extra matmul
    return F.linear_cross_entropy(flat, weight, target, reduction="none", **kwargs).float().sum()


def chunked_cross_entropy_tokens(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = PLAIN,
) -> torch.Tensor:
    """fp32 [tokens]: each row's cross_entropy(transform(hidden @ weight.T + bias)) against its target (0 where
    the target is IGNORE), chunk_tokens rows at a time, without a graph: the validation pass's per-source sums.
    For a plain or scaled head its sum is chunked_cross_entropy_sum's no-graph value, bit for bit."""
    flat, target = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    scale = transform.scale
    if scale is None:
        return torch.cat(
            [
                F.cross_entropy(
                    transform.apply(F.linear(flat[a : a + chunk_tokens], weight, bias).float()),
                    target[a : a + chunk_tokens],
                    ignore_index=IGNORE,
                    reduction="none",
                )
                for a in range(0, flat.shape[0], chunk_tokens)
            ]
        )
    if scale != 1.0:
        flat = flat * scale
        bias = None if bias is None else bias * scale
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None)
    return F.linear_cross_entropy(
        flat, weight, target, reduction="none", linear_bias=bias, ignore_index=IGNORE, options=options
    ).float()


def _chunk_loss(hidden, weight, bias, target, transform: LogitTransform) -> torch.Tensor:
    # the transform runs in fp32 (the model's forward runs it in the compute dtype): the same function, rounded less
    logits = transform.apply(F.linear(hidden, weight, bias).float())
    return F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")


def _checkpointed_chunks_sum(flat, weight, bias, target, chunk_tokens: int, transform, wants_grad: bool):
    """A transform F.linear_cross_entropy has no option for (a tanh softcap), one chunk at a time here. Under a
    graph each chunk is checkpointed: backward recomputes its logits instead of keeping every chunk's."""
    from torch.utils.checkpoint import checkpoint

    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        rows, t = flat[start : start + chunk_tokens], target[start : start + chunk_tokens]
        if wants_grad:
            total = total + checkpoint(_chunk_loss, rows, weight, bias, t, transform, use_reentrant=False)
        else:
            total = total + _chunk_loss(rows, weight, bias, t, transform)
    return total


# ---------------------------------------------------------------- what the model does after its head


def effective_loss_kind(model, requested: str) -> str:
    """train.loss as it runs for this model: chunked only when logit_transform knows what the model does after
    its head; otherwise full (the model's own logits), with a one-line notice from rank 0 the first time."""
    if requested != "chunked":
        return requested
    transform, why = logit_transform(model)
    first = not model.__dict__.get(LOSS_NOTICE, False)
    object.__setattr__(model, LOSS_NOTICE, True)
    if first and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        if transform is None:
            print(
                f"train: train.loss chunked cannot follow this model's logits ({why}); training with "
                "train.loss full instead (the model's own logits: [micro-batch tokens x vocab] in memory)",
                file=sys.stderr,
                flush=True,
            )
        elif transform.ops:
            name = type(model).__name__.removeprefix("FSDP")  # fully_shard's subclass of the model's class
            print(f"train: the chunked loss applies {name}'s logit transform ({transform.describe()})", flush=True)
    return "full" if transform is None else "chunked"


def _root_chunked_loss(model, tensors: dict[str, torch.Tensor], chunk_tokens: int) -> torch.Tensor:
    """The chunked loss from the model's own modules; under FSDP2 the body of the root's forward method."""
    head = model.get_output_embeddings()
    router_logits = [] if torch.is_grad_enabled() and router_aux(model) is not None else None
    hidden = final_hidden(model, tensors, router_logits)
    transform = logit_transform(model)[0] or PLAIN  # (None: summed_token_loss took the full kind)
    loss = chunked_cross_entropy_sum(
        hidden, head.weight, shifted_targets(tensors["labels"]), chunk_tokens, getattr(head, "bias", None), transform
    )
    return with_router_term(model, loss, router_logits, tensors["labels"])


def _root_token_losses(model, tensors: dict[str, torch.Tensor], chunk_tokens: int) -> torch.Tensor:
    """Per-position chunked losses from the model's own modules; under FSDP2 a forward method of the root."""
    head = model.get_output_embeddings()
    hidden = final_hidden(model, tensors)
    transform = logit_transform(model)[0] or PLAIN
    return chunked_cross_entropy_tokens(
        hidden, head.weight, shifted_targets(tensors["labels"]), chunk_tokens, getattr(head, "bias", None), transform
    )


def root_loss_method(model, name: str = ROOT_LOSS_METHOD, body=_root_chunked_loss):
    """model's bound chunked-loss method `name` (running `body`), made once; on an FSDP2 root it is registered as
    a forward method (all-gather before, the root's resharding and backward hooks after), elsewhere it is a plain
    call."""
    method = model.__dict__.get(name)
    if method is None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        object.__setattr__(model, name, types.MethodType(body, model))
        register_fsdp_forward_method(model, name)  # a no-op when model is not an FSDPModule
        method = model.__dict__[name]
    return method


def summed_token_loss(model, tensors: dict[str, torch.Tensor], kind: str, chunk_tokens: int) -> torch.Tensor:
    """fp32 scalar: the sum of next-token cross-entropy over loss-bearing positions (labels != IGNORE), with
    loss `kind` (train.loss) and `chunk_tokens` (train.loss_chunk_tokens).

    Works with a plain model and an FSDP2-sharded one, with and without a graph (the training step
    and the validation forward under torch.no_grad()).
    """
    check_loss_keys(kind, chunk_tokens)
    aux_notice(model)  # an MoE model with output_router_logits: its router term is trained too (train/moe.py)
    if effective_loss_kind(model, kind) == "full":
        if torch.is_grad_enabled() and router_aux(model) is not None:
            kernel = model.config._attn_implementation
            inputs = packed_model_inputs(tensors["input_ids"], tensors["position_ids"], kernel)
            out = model(**inputs, use_cache=False, output_router_logits=True)
            logits = out.logits.view(*tensors["input_ids"].shape, out.logits.shape[-1])
            return with_router_term(model, loss_sum(logits, tensors["labels"]), out.router_logits, tensors["labels"])
        return loss_sum(forward_logits(model, tensors), tensors["labels"])
    return root_loss_method(model)(tensors, chunk_tokens)


def token_losses(model, tensors: dict[str, torch.Tensor], kind: str, chunk_tokens: int) -> torch.Tensor:
    """fp32 [micro_batch_size x seq_len], no graph: position t's next-token cross-entropy (the loss of predicting
    labels[t + 1] in its row; 0 where that label is IGNORE and at each row's end). The validation pass sums it per
    source (train/eval_sources.py); for the chunked kind its sum is summed_token_loss's no-graph value."""
    check_loss_keys(kind, chunk_tokens)
    if effective_loss_kind(model, kind) == "full":
        logits = forward_logits(model, tensors)
        targets = shifted_targets(tensors["labels"])
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return root_loss_method(model, ROOT_TOKEN_LOSSES_METHOD, _root_token_losses)(tensors, chunk_tokens)

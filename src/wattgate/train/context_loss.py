"""The loss of a context rank's shard (parallel.context > 1), as train/loss.py computes a whole row's: the kinds of
train.loss over the shard's pre-shifted targets (train/context_parallel.py shard_rows), the model's own logit
transform included.

The shard's positions are not contiguous in the row, so nothing here shifts: each local position's target was
taken from the whole row before the split. The chunked kind runs the decoder with the context attention's keyword
and F.linear_cross_entropy over the shard's final hidden state, as a forward method of the FSDP2 root (train/loss.py
root_loss_method), so the head weight is all-gathered there. The C shards' sums add up to the rows' sum: the
trainer normalises them by the step's loss tokens, each counted once, on the rank that holds its position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from wattgate.errors import InputError
from wattgate.train.context_parallel import (
    CONTEXT_KWARG,
    ContextAttention,
    context_loss_sum,
    shard_rows,
)
from wattgate.context_layout import split_rows
from wattgate.train.data import IGNORE, Batch, host_tensors
from wattgate.train.logit_transform import PLAIN, logit_transform
from wattgate.train.loss import (
    check_loss_keys,
    chunked_cross_entropy_sum,
    chunked_cross_entropy_tokens,
    effective_loss_kind,
    root_loss_method,
)
from wattgate.train.moe import router_aux

CONTEXT_LOSS_METHOD = "wattgate_context_chunked_loss"
CONTEXT_TOKEN_LOSSES_METHOD = "wattgate_context_chunked_token_losses"


@dataclass(frozen=True)
class ContextPlace:
    """This rank's place in its context group: the group (the mesh's cp dimension), its size C, the rank's index in
    it (which chunks of each row it holds) and the attention kernel (context_parallel.context_kernel)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    kernel: str = "sdpa"

    def split(self, packs: list, seq_len: int) -> np.ndarray:
        """int64 [B, C, S/C]: the row positions each rank of the group holds of a micro-batch's packs (their planned
        document lengths; context_layout.split_rows), worked out on the host as the gate works it out."""
        return split_rows([np.asarray(p.lengths) for p in packs], seq_len, self.size)

    def host_tensors(self, batch: Batch, split: np.ndarray, pin: bool) -> dict[str, torch.Tensor]:
        """data.host_tensors of the whole rows, with their split (shard_rows reads it on the device)."""
        tensors = host_tensors(batch, pin) | {"context_positions": torch.from_numpy(split)}
        return {k: v.pin_memory() for k, v in tensors.items()} if pin else tensors

    def prepared(
        self, batch: Batch, packs: list, seq_len: int, pin: bool
    ) -> tuple[Batch, dict[str, torch.Tensor], np.ndarray]:
        """A micro-batch of whole rows as this rank trains it: counted (its shard's tokens), its host tensors with
        the rows' split, and the split."""
        split = self.split(packs, seq_len)
        return self.counted(batch, packs, split), self.host_tensors(batch, split, pin), split

    def shard(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_rows(tensors, self.size, self.rank)

    def local(self, split: np.ndarray) -> np.ndarray:
        """int64 [B, S/C]: the row positions this rank holds, on the host: the counts are host figures, and the
        collective proof's dry run makes every torch tensor fake."""
        return split[:, self.rank]

    def has_target(self, labels: np.ndarray, split: np.ndarray) -> np.ndarray:
        """bool [B, S/C]: which of this rank's positions have a target (label t + 1 of the row is t's)."""
        has_target = np.zeros(labels.shape, dtype=bool)
        has_target[:, :-1] = labels[:, 1:] != IGNORE
        return np.take_along_axis(has_target, self.local(split), axis=1)

    def counted(self, batch: Batch, packs: list, split: np.ndarray) -> Batch:
        """`batch` (whole rows) with this shard's loss tokens and tokens: summed over the group they are the rows'
        (each position counted on the one rank that holds it), so the step's totals count every row once."""
        used = np.array([int(np.sum(np.asarray(p.lengths))) for p in packs], dtype=np.int64)
        return replace(
            batch,
            num_loss_tokens=int(self.has_target(batch.labels, split).sum()),
            num_tokens=int((self.local(split) < used[:, None]).sum()),
        )


def check_no_router_term(model) -> None:
    """A router load-balancing term is a statistic of each whole micro-batch's routing: its shards' terms would not
    add up to it. Refused in one line rather than trained on another objective."""
    if router_aux(model) is not None:
        raise InputError(
            "parallel.context: this model trains a router load-balancing term, which is not split across context "
            "ranks yet; give parallel.context 1 (or turn the model's output_router_logits off)"
        )


def _context(shard: dict[str, torch.Tensor], group, kernel: str) -> ContextAttention:
    return ContextAttention(group, shard["query_index"], shard["key_index"], shard["doc_ids"], kernel)


def _shard_hidden(model, shard: dict[str, torch.Tensor], group, kernel: str) -> torch.Tensor:
    """The decoder's final hidden state [B, S/C, H] of the shard's tokens, attention over the group's rows."""
    out = model.get_decoder()(
        input_ids=shard["input_ids"],
        position_ids=shard["position_ids"],
        use_cache=False,
        **{CONTEXT_KWARG: _context(shard, group, kernel)},
    )
    return out.last_hidden_state


def _head_inputs(model, shard: dict[str, torch.Tensor], group, kernel: str) -> tuple:
    """What a chunked loss of the shard reads: its final hidden state, the head's weight, its bias, the logit
    transform."""
    head = model.get_output_embeddings()
    transform = logit_transform(model)[0] or PLAIN
    return _shard_hidden(model, shard, group, kernel), head.weight, getattr(head, "bias", None), transform


def _root_context_loss(model, shard: dict[str, torch.Tensor], group, kernel: str, chunk_tokens: int) -> torch.Tensor:
    """The chunked loss of a shard from the model's own modules; under FSDP2 a forward method of the root."""
    hidden, weight, bias, transform = _head_inputs(model, shard, group, kernel)
    return chunked_cross_entropy_sum(hidden, weight, shard["targets"], chunk_tokens, bias, transform)


def _root_context_token_losses(
    model, shard: dict[str, torch.Tensor], group, kernel: str, chunk_tokens: int
) -> torch.Tensor:
    """Per-position chunked losses of a shard; under FSDP2 a forward method of the root."""
    hidden, weight, bias, transform = _head_inputs(model, shard, group, kernel)
    return chunked_cross_entropy_tokens(hidden, weight, shard["targets"], chunk_tokens, bias, transform)


def context_summed_loss(
    model, shard: dict[str, torch.Tensor], place: ContextPlace, kind: str, chunk_tokens: int
) -> torch.Tensor:
    """fp32 scalar: the summed next-token loss of one context shard with loss `kind` (train.loss); summed over the
    group it is summed_token_loss of the whole rows."""
    check_loss_keys(kind, chunk_tokens)
    if torch.is_grad_enabled():  # the router term trains with a graph only (train/loss.py)
        check_no_router_term(model)
    if effective_loss_kind(model, kind) == "full":
        return context_loss_sum(model, shard, place.group, place.kernel)
    method = root_loss_method(model, CONTEXT_LOSS_METHOD, _root_context_loss)
    return method(shard, place.group, place.kernel, chunk_tokens)


def context_token_losses(
    model, shard: dict[str, torch.Tensor], place: ContextPlace, kind: str, chunk_tokens: int
) -> torch.Tensor:
    """fp32 [B x S/C], no graph: each shard position's next-token loss (0 where its target is IGNORE), the
    validation pass's per-source sums."""
    check_loss_keys(kind, chunk_tokens)
    if effective_loss_kind(model, kind) == "full":
        from wattgate.train.context_parallel import CONTEXT_ATTENTION

        assert model.config._attn_implementation == CONTEXT_ATTENTION  # train/model.py switched it
        logits = model(
            input_ids=shard["input_ids"],
            position_ids=shard["position_ids"],
            use_cache=False,
            **{CONTEXT_KWARG: _context(shard, place.group, place.kernel)},
        ).logits
        targets = shard["targets"].flatten()
        return F.cross_entropy(logits.flatten(0, 1).float(), targets, ignore_index=IGNORE, reduction="none")
    method = root_loss_method(model, CONTEXT_TOKEN_LOSSES_METHOD, _root_context_token_losses)
    return method(shard, place.group, place.kernel, chunk_tokens)

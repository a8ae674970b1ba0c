"""The run-time guard behind the gate: before step 1 every rank proves it planned the same micro-batch sequence.

The validation pass's micro-batches are part of the sequence: a rank with one more of them would hang in
the pass exactly as one with one more training micro-batch hangs in a step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from wattgate.errors import StageFailed
from wattgate.train.data import MicroBatchPlan
from wattgate.train.distributed import equal_across_ranks

EVAL_EPOCH = -1  # marks the validation pass's micro-batches in a planned sequence


def planned_sequence(
    micro_batches: Sequence[MicroBatchPlan], eval_batches: Sequence[MicroBatchPlan] = ()
) -> list[tuple]:
    """(epoch, step, micro, packs) of every micro-batch in order, then the validation pass's (epoch -1): the
    collectives this rank will issue."""
    return [(m.epoch, m.step, m.micro, len(m.packs)) for m in micro_batches] + [
        (EVAL_EPOCH, 0, m.micro, len(m.packs)) for m in eval_batches
    ]


def _said(x: tuple | None) -> str:
    if x is None:
        return "no more micro-batches"
    if x[0] == EVAL_EPOCH:
        return f"validation micro-batch {x[2] + 1} ({x[3]} packs)"
    return f"epoch {x[0]} step {x[1] + 1} micro-batch {x[2] + 1} ({x[3]} packs)"


def first_divergence(sequences: list[list[tuple]]) -> str:
    """Where the ranks' planned sequences first differ, in words."""
    for i in range(max(len(seq) for seq in sequences)):
        items = [seq[i] if i < len(seq) else None for seq in sequences]
        if len(set(items)) > 1:
            said = "; ".join(f"rank {r}: {_said(x)}" for r, x in enumerate(items))
            return f"micro-batch #{i + 1} of the run: {said}"
    return "nowhere"


def check_planned_sequences(sequence: list[tuple], device: torch.device) -> None:
    """Defense in depth behind the gate: every rank must plan the same sequence of micro-batches.

    Equal totals are not enough (a micro-batch moved from one step to the next keeps them and
    still hangs), so each rank all-reduces a hash of its (epoch, step, micro, packs) sequence, the
    validation pass's included; on a mismatch the sequences are gathered to name the first divergence.
    """
    digest = hashlib.sha256(json.dumps(sequence).encode()).digest()
    if equal_across_ranks([int.from_bytes(digest[:7], "little")], device):
        return
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sequence)
    raise StageFailed(
        "planned counts differ across ranks (this would deadlock where they diverge): first at "
        f"{first_divergence(every)}; rerun pack and gate"
    )

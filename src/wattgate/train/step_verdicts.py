"""What every rank decides alike from a step's gathered figures: whether the run stops there (a stop request) and,
for a non-finite step, the one line that names it. Pure functions over what `Trainer.run_step` gathered."""

from __future__ import annotations

import math

from wattgate.errors import StageFailed
from wattgate.train.data import MicroBatchPlan


class NonFiniteState(StageFailed):
    """A non-finite loss, gradient norm, validation loss or weight, agreed by every rank: the run stops before
    the optimizer step (or the checkpoint, or the export) that would make it permanent."""


def agreed_stop(gathered: list, asked: str | None) -> str | None:
    """The stop every rank agreed on at this step (None: no rank was asked): this rank's own reason, or which
    ranks were asked. Column 5 of each rank's step figures is 0 where that rank was asked to stop."""
    if asked is not None:  # this rank's own request is in `gathered` too: every rank sees it
        return asked
    asking = [r for r, t in enumerate(gathered) if float(t[5]) < 0.5]
    return f"a stop requested on rank {', '.join(map(str, asking))}" if asking else None


def doc_ids(micro: MicroBatchPlan, most: int = 8) -> list[int | str]:
    """A micro-batch's first `most` document ids (the plan's doc_id: pretokenized row order), then "..." when it
    holds more."""
    ids: list[int | str] = [int(d) for pack in micro.packs for d in pack]
    return ids[:most] + (["..."] if len(ids) > most else [])


def nonfinite_line(step: int, bad_ranks: list[int], grad_norm: float, everyone: list) -> str:
    """One line naming a non-finite step: the ranks whose loss was non-finite with their micro-batches'
    documents, or (a finite loss everywhere) the gradient norm and every rank's documents."""
    parts = []
    for r, micros in enumerate(everyone):
        named = [(k, x, ids) for k, x, ids in micros if not math.isfinite(x)] if bad_ranks else micros
        if r in bad_ranks or not bad_ranks:
            parts += [f"rank {r} micro-batch {k} (loss {x:.4g}, documents {ids})" for k, x, ids in named]
    head = f"step {step}: non-finite " + (
        f"loss on rank {', '.join(map(str, bad_ranks))}" if bad_ranks else f"gradient norm {grad_norm}"
    )
    return f"{head}: {'; '.join(parts)}"

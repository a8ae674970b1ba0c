"""Place packs at (epoch, step, micro, rank, slot) so every rank runs the same schedule.

With P packs per epoch and P a multiple of world_size * micro_batch_size *
grad_accum, every rank gets exactly P / world_size packs, i.e. the same number
of micro-batches and optimizer steps — the deadlock invariant holds by
construction. Balance: FSDP synchronizes at every micro-batch (all-gathers in
forward, reduce-scatters in backward), so the packs of one micro-batch are
chosen to have similar cost (sorted by cost, ties shuffled per epoch) and dealt
to ranks in snake order, the heaviest to a rank chosen at random per
micro-batch, so no rank is a permanent straggler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Packs whose cost differs by less than this relative step count as equal and
# are shuffled among themselves, so epochs differ without hurting balance.
COST_TIE_TOLERANCE = 0.02


@dataclass(frozen=True)
class Layout:
    world_size: int
    micro_batch_size: int
    grad_accum: int
    # each row one document and padding (pack.documents_per_row one): a model with a recurrent state
    one_document_rows: bool = False

    @property
    def packs_per_micro(self) -> int:
        return self.world_size * self.micro_batch_size

    @property
    def packs_per_step(self) -> int:
        return self.packs_per_micro * self.grad_accum


@dataclass
class Placement:
    """One row per pack per epoch (all int arrays of equal length)."""

    pack: np.ndarray
    epoch: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    rank: np.ndarray
    slot: np.ndarray


def pack_costs(tokens: np.ndarray, sum_sq: np.ndarray, attn_weight: float) -> np.ndarray:
    """Relative compute cost: linear in tokens plus attention, quadratic in each document's length."""
    return tokens.astype(np.float64) + attn_weight * sum_sq.astype(np.float64)


def _epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def assign_ranks(costs: np.ndarray, layout: Layout, epochs: int, seed: int) -> Placement:
    """Balanced placement of equal counts; requires len(costs) % layout.packs_per_step == 0."""
    n = len(costs)
    if n == 0 or n % layout.packs_per_step:
        raise ValueError(f"{n} packs is not a positive multiple of {layout.packs_per_step}")
    W, ga = layout.world_size, layout.grad_accum
    per_micro = layout.packs_per_micro
    n_micro = n // per_micro
    bucket = np.floor(np.log(np.maximum(costs, 1.0)) / np.log1p(COST_TIE_TOLERANCE))
    j = np.arange(per_micro)
    round_, within = j // W, j % W
    snake = np.where(round_ % 2 == 0, within, W - 1 - within)  # rank position in the group
    cols = []
    for epoch in range(epochs):
        rng = _epoch_rng(seed, epoch)
        by_cost = np.lexsort((rng.random(n), -bucket))  # heaviest first, equal costs shuffled
        groups = by_cost.reshape(n_micro, per_micro)  # one micro-batch per row, heaviest first
        order = rng.permutation(n_micro)  # which micro-batch runs when
        rank_perm = np.argsort(rng.random((n_micro, W)), axis=1)  # per-group rank relabelling
        micro_index = np.empty(n_micro, dtype=np.int64)
        micro_index[order] = np.arange(n_micro)
        pack = groups.ravel()
        g = np.repeat(np.arange(n_micro), per_micro)
        m = np.repeat(micro_index, per_micro)
        cols.append(
            (
                pack,
                np.full(n, epoch),
                m // ga,
                m % ga,
                rank_perm[g, np.tile(snake, n_micro)],
                np.tile(round_, n_micro),
            )
        )
    stacked = [np.concatenate(c) for c in zip(*cols)]
    placement = Placement(*stacked)
    return sort_placement(placement)


def assign_uneven(rank_of_pack: np.ndarray, layout: Layout, epochs: int, seed: int) -> Placement:
    """The `none` control: each rank runs its own packs in order; counts differ between ranks."""
    cols = []
    for epoch in range(epochs):
        rng = _epoch_rng(seed, epoch)
        for rank in np.unique(rank_of_pack):
            mine = np.flatnonzero(rank_of_pack == rank)
            mine = mine[rng.permutation(len(mine))]
            i = np.arange(len(mine))
            m = i // layout.micro_batch_size
            cols.append(
                (
                    mine,
                    np.full(len(mine), epoch),
                    m // layout.grad_accum,
                    m % layout.grad_accum,
                    np.full(len(mine), rank),
                    i % layout.micro_batch_size,
                )
            )
    return sort_placement(Placement(*[np.concatenate(c) for c in zip(*cols)]))


def sort_placement(p: Placement) -> Placement:
    order = np.lexsort((p.slot, p.rank, p.micro, p.step, p.epoch))
    return Placement(
        *(getattr(p, f)[order].astype(np.int64) for f in ("pack", "epoch", "step", "micro", "rank", "slot"))
    )


@dataclass(frozen=True)
class CostRatios:
    """max/mean rank cost per optimizer step and per micro-batch, their max and mean (1.0 = perfectly balanced)."""

    max_step: float
    mean_step: float
    max_micro: float
    mean_micro: float


def _ratios(placement: Placement, c: np.ndarray, world_size: int, keys) -> np.ndarray:
    key = np.zeros(len(c), dtype=np.int64)
    for k in keys:
        key = key * (int(k.max()) + 1) + k
    uniq, idx = np.unique(key, return_inverse=True)
    per_rank = np.zeros((len(uniq), world_size))
    np.add.at(per_rank, (idx, placement.rank), c)
    return per_rank.max(axis=1) / np.maximum(per_rank.mean(axis=1), 1e-12)


def rank_cost_ratios(placement: Placement, costs: np.ndarray, world_size: int) -> CostRatios:
    """max/mean rank cost per optimizer step and per micro-batch (1.0 = perfectly balanced)."""
    c = costs[placement.pack]
    step = _ratios(placement, c, world_size, (placement.epoch, placement.step))
    micro = _ratios(placement, c, world_size, (placement.epoch, placement.step, placement.micro))
    return CostRatios(float(step.max()), float(step.mean()), float(micro.max()), float(micro.mean()))

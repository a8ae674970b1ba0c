"""The planner's pure core: documents into packs (bfd and the remainder policy), packs into places (assign).

Its own module so that the pack stage (plan.py) and continued plans (segments.py) both call it without
importing each other.
"""

from __future__ import annotations

import numpy as np

from wattgate.pack.assign import Layout, assign_ranks, assign_uneven, pack_costs
from wattgate.pack.remainder import apply_remainder


def plan_packs(
    lengths: np.ndarray, seq_len: int, layout: Layout, remainder: str, epochs: int, seed: int, attn_weight: float
):
    """Pure core of the stage: (packs, placement, tokens per pack, cost per pack)."""
    packs = apply_remainder(
        lengths, seq_len, remainder, layout.world_size, layout.packs_per_step, layout.one_document_rows
    )
    tokens = packs.sum_per_pack(lengths)
    sum_sq = packs.sum_per_pack(lengths**2)
    costs = pack_costs(tokens, sum_sq, attn_weight)
    if packs.rank_of_pack is not None:
        placement = assign_uneven(packs.rank_of_pack, layout, epochs, seed)
    else:
        placement = assign_ranks(costs, layout, epochs, seed)
    return packs, placement, tokens, costs

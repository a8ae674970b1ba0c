"""Ranks grouped by everything that can change the collectives they issue; the proof dry-runs one rank of each group.

A rank's dry run is the trainer's own code given four inputs that differ between ranks (docs/gate.md):
- its plan: the class of every step it runs and the packed rows of each of its micro-batches (proof/classes.py);
- its shard of every parameter: FSDP2 splits dim 0 into shard-degree chunks of ceil(n / shard degree) rows (the
  shard degree is the world size on the 1-D mesh), so a rank holds a full chunk, a shorter last one, or nothing
  (padded to the full chunk in every all-gather and reduce-scatter, but the local tensors DCP and the export read
  have its own shape);
- its place in the mesh (train/mesh.py): on the 1-D mesh the rank is its place; with HSDP (parallel.replicate)
  its place in its shard group decides its shard, over the shard degree rather than the world, and its replica
  changes nothing the record compares (each collective is recorded on its mesh dimension, the group's ranks named
  but not compared); with expert parallelism (parallel.expert E) its place in its expert group decides which
  experts it holds (every place the same number: E divides them) and its place among the ranks holding the same
  experts decides its shard of them, as FSDP2 splits the expert group's share over the shard degree / E; with
  context parallelism (parallel.context C) its place in its context group decides which chunks of each row it
  holds (head-tail: its attention's keys are gathered from the others, its padding differs), and the C ranks of
  a context group train the same data rank's plan;
- whether it is rank 0, which alone publishes checkpoints, writes final/ and sends what the others receive.
Ranks equal in all four run the same code on the same shapes and counts and so issue the same collectives (the
proof's premise: collectives follow counts and shapes, never values). Rank 0 is a group of its own, and every other
group is dry-run through its lowest rank, so a rank whose plan differs in one step is its own group and is named.
The number of groups is bounded by the plan's distinct rank plans (one when the plan is balanced) times the few
shard boundaries, not by the world size nor by the mesh's replica and expert degrees.
"""

from __future__ import annotations

from dataclasses import dataclass

from wattgate.proof.classes import RankPlan
from wattgate.records.gate import Depth, RankGroup


@dataclass(frozen=True)
class MeshPlaces:
    """The mesh's degrees, as far as they decide what a rank holds: `shard` ranks share one copy of the model
    (world / parallel.replicate); `expert` (parallel.expert) consecutive ranks of a shard group hold disjoint
    experts, `experts` per layer (0: a dense model); `context` (parallel.context) consecutive ranks share each
    row, each holding its own chunks of it."""

    shard: int
    expert: int = 1
    experts: int = 0
    context: int = 1

    def kinds(self, rank: int, dims: tuple[int, ...]) -> tuple[int, ...]:
        """What `rank` holds of each dim 0 in `dims` (shard_kind), and with experts of its share of them."""
        place = rank % self.shard  # its replica holds the same as replica 0's rank at this place
        held = tuple(shard_kind(n, self.shard, place) for n in dims)
        if self.context > 1:
            held = (*held, rank % self.context)  # its chunks of every row: its own collectives' sizes and inputs
        if not self.experts:
            return held
        share = self.experts // self.expert  # rows of each expert weight this expert group place holds
        return (*held, shard_kind(share, self.shard // self.expert, place // self.expert))


def shard_dims(depth: Depth) -> tuple[int, ...]:
    """The distinct dim-0 sizes of the model's parameters (what FSDP2 splits over the ranks)."""
    shapes = depth.params.shapes if depth.params is not None else ()
    return tuple(sorted({shape[0] for shape in shapes if len(shape)}))


def shard_kind(rows: int, world: int, rank: int) -> int:
    """What `rank` holds of a dim 0 of `rows` rows: 2 a full chunk, 1 a shorter last chunk, 0 nothing."""
    chunk = -(-rows // world)
    held = min(max(rows - rank * chunk, 0), chunk)
    return 2 if held == chunk else 1 if held else 0


def rank_groups(plans: list[RankPlan], dims: tuple[int, ...], mesh: MeshPlaces | None = None) -> list[list[int]]:
    """The ranks in groups that issue the same collectives (module docstring), rank 0's first and alone, each
    group's ranks ascending; `mesh`: its degrees (None: the 1-D mesh over the world)."""
    mesh = mesh or MeshPlaces(shard=len(plans))
    groups: dict = {}
    for rank, plan in enumerate(plans):
        key = None if rank == 0 else (tuple(plan.classes), plan.rows, mesh.kinds(rank, dims))
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def group_records(groups: list[list[int]]) -> tuple[RankGroup, ...]:
    """gate.json `collectives.rank_groups`: each group's dry-run rank, how many ranks it stands for, its last."""
    return tuple(RankGroup(rank=g[0], ranks=len(g), last=g[-1]) for g in groups)

"""The device mesh FSDP2 shards over, one function for every place that builds one: training (train/seams.py),
`wattgate load-check` and the collective proof's dry run (proof/dryrun.py), so what the gate proves is the mesh the
run shards over.

parallel.replicate 1 (the default) is a 1-D mesh over the world: every parameter, gradient and optimizer state
sharded over all ranks (ZeRO-3). R > 1 is FSDP2's HSDP: a 2-D mesh (dp_replicate, dp_shard) of R replicas, each
sharding the model over world / R ranks; fully_shard all-gathers and reduce-scatters within a shard group and
all-reduces the reduced gradient shards across the replica group. Data parallelism stays over the whole world:
every rank trains its own micro-batches, as the plan assigns them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wattgate.errors import InputError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

REPLICATE_DIM, SHARD_DIM = "dp_replicate", "dp_shard"


def mesh_shape(world: int, replicate: int) -> tuple[int, ...]:
    """(world,) for replicate 1, else (replicate, world / replicate); a replicate that does not divide the world
    (a launch whose world is not the config's) is one line naming the key."""
    if replicate < 1 or world % replicate:
        raise InputError(
            f"parallel.replicate: {replicate} does not divide the world size {world}; give a divisor of it, or auto"
        )
    return (world,) if replicate == 1 else (replicate, world // replicate)


def data_parallel_mesh(device_type: str, world: int, replicate: int) -> DeviceMesh:
    """The mesh of `world` ranks with `replicate` replica groups (module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(world, replicate)
    if len(shape) == 1:
        return init_device_mesh(device_type, shape)  # as before HSDP existed: the default run is unchanged
    # row-major: rank = replica x shard degree + position, so a shard group is consecutive ranks (a node's ranks
    # when the shard degree is a multiple of the GPUs per node): all-gathers stay on the node's fast links
    return init_device_mesh(device_type, shape, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def mesh_groups(mesh: DeviceMesh) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each named dimension's process group of this rank, by the group's name: (the dimension's name, the group's
    ranks). Empty for the 1-D mesh, whose one group is the world's (the default group, recorded as before)."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names or ()
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in names:
        group = mesh.get_group(name)
        out[group.group_name] = (name, tuple(dist.get_process_group_ranks(group)))
    return out

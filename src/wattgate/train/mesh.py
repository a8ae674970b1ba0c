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
# parallel.expert E > 1 splits each shard group into (shard / E, E): EXPERT_DIM is E consecutive ranks that hold
# disjoint experts and exchange tokens, EXPERT_SHARD_DIM the ranks of a shard group holding the same experts;
# SHARD_DIM is then their flattening (the same ranks, in the same order, as without EP)
EXPERT_DIM, EXPERT_SHARD_DIM = "ep", "ep_shard"
# parallel.context C > 1 splits each shard group into (shard / C, C): CONTEXT_DIM is C consecutive ranks that share
# each packed row (their attention gathers keys and values over it), DATA_DIM the ranks of a shard group training
# distinct rows; SHARD_DIM is again their flattening, so parameters shard over data and context ranks together
CONTEXT_DIM, DATA_DIM = "cp", "dp"


def mesh_shape(world: int, replicate: int) -> tuple[int, ...]:
    """(world,) for replicate 1, else (replicate, world / replicate); a replicate that does not divide the world
    (a launch whose world is not the config's) is one line naming the key."""
    if replicate < 1 or world % replicate:
        raise InputError(
            f"parallel.replicate: {replicate} does not divide the world size {world}; give a divisor of it, or auto"
        )
    return (world,) if replicate == 1 else (replicate, world // replicate)


def mesh_layout(world: int, replicate: int, expert: int = 1, context: int = 1) -> dict[str, int]:
    """The mesh `data_parallel_mesh` builds, each named dimension's size in mesh order (TRAINED `mesh`); empty
    for the 1-D mesh, whose one dimension is the world."""
    shape = mesh_shape(world, replicate)
    dims = {REPLICATE_DIM: replicate} if len(shape) == 2 else {}
    if expert > 1:
        return dims | {EXPERT_SHARD_DIM: shape[-1] // expert, EXPERT_DIM: expert}
    if context > 1:
        return dims | {DATA_DIM: shape[-1] // context, CONTEXT_DIM: context}
    return dims | ({SHARD_DIM: shape[-1]} if dims else {})


def data_parallel_mesh(device_type: str, world: int, replicate: int, expert: int = 1, context: int = 1) -> DeviceMesh:
    """The mesh of `world` ranks with `replicate` replica groups (module docstring), and with `expert` > 1 each
    shard group split into expert groups (train/expert_parallel.py), with `context` > 1 into context groups."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(world, replicate)
    if expert > 1:
        return expert_mesh(device_type, shape, expert)
    if context > 1:
        return context_mesh(device_type, shape, context)
    if len(shape) == 1:
        return init_device_mesh(device_type, shape)  # as before HSDP existed: the default run is unchanged
    # row-major: rank = replica x shard degree + position, so a shard group is consecutive ranks (a node's ranks
    # when the shard degree is a multiple of the GPUs per node): all-gathers stay on the node's fast links
    return init_device_mesh(device_type, shape, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def expert_mesh(device_type: str, shape: tuple[int, ...], expert: int) -> DeviceMesh:
    """(dp_replicate,) ep_shard, ep: row-major, so an expert group is `expert` consecutive ranks inside a shard
    group; dp_shard is flattened from (ep_shard, ep) for the parameters that are not experts."""
    from torch.distributed.device_mesh import init_device_mesh

    shard = shape[-1]
    if shard % expert:
        raise InputError(f"parallel.expert: {expert} does not divide the shard group size {shard}")
    names = ((REPLICATE_DIM,) if len(shape) == 2 else ()) + (EXPERT_SHARD_DIM, EXPERT_DIM)
    mesh = init_device_mesh(device_type, (*shape[:-1], shard // expert, expert), mesh_dim_names=names)
    mesh[(EXPERT_SHARD_DIM, EXPERT_DIM)]._flatten(SHARD_DIM)
    return mesh


def context_mesh(device_type: str, shape: tuple[int, ...], context: int) -> DeviceMesh:
    """(dp_replicate,) dp, cp: row-major, so a context group is `context` consecutive ranks inside a shard group
    (a node's when it divides the GPUs per node: the per-layer key/value gathers stay on its fast links) and rank
    r trains data rank r // context's rows; dp_shard is flattened from (dp, cp) for FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    shard = shape[-1]
    if shard % context:
        raise InputError(f"parallel.context: {context} does not divide the shard group size {shard}")
    names = ((REPLICATE_DIM,) if len(shape) == 2 else ()) + (DATA_DIM, CONTEXT_DIM)
    mesh = init_device_mesh(device_type, (*shape[:-1], shard // context, context), mesh_dim_names=names)
    mesh[(DATA_DIM, CONTEXT_DIM)]._flatten(SHARD_DIM)
    return mesh


def context_group(mesh: DeviceMesh):
    """(the context group's process group, its size, this rank's place in it), or None without a cp dimension."""
    names = mesh.mesh_dim_names or ()
    if CONTEXT_DIM not in names:
        return None
    return mesh.get_group(CONTEXT_DIM), mesh.size(names.index(CONTEXT_DIM)), mesh.get_local_rank(CONTEXT_DIM)


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh the parameters that are not experts shard over: `mesh` itself, or under EP (and CP) its
    data-parallel dimensions with the expert (context) ones flattened (the same groups as without them)."""
    names = mesh.mesh_dim_names or ()
    if EXPERT_DIM not in names and CONTEXT_DIM not in names:
        return mesh
    return mesh[(REPLICATE_DIM, SHARD_DIM)] if REPLICATE_DIM in names else mesh[SHARD_DIM]


def experts_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Under EP, the mesh over which the ranks holding the same experts shard them (FSDP2's mesh for them)."""
    names = mesh.mesh_dim_names or ()
    return mesh[(REPLICATE_DIM, EXPERT_SHARD_DIM)] if REPLICATE_DIM in names else mesh[EXPERT_SHARD_DIM]


def forget_meshes() -> None:
    """Empty torch's DTensor caches that hold meshes: sharding propagation (Python and C++), redistribution plans
    and transforms, the mesh topology. They key on DeviceMesh equality, which compares the ranks' layout and not
    which rank this process is, so a process that builds the mesh as another rank (the collective proof's dry runs,
    one after another on fresh fake process groups) would get the earlier rank's mesh back, with group names its
    own world does not hold ("Could not resolve the process group registered under the name 1")."""
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def mesh_groups(mesh: DeviceMesh) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each named dimension's process group of this rank, by the group's name: (the dimension's name, the group's
    ranks). Empty for the 1-D mesh, whose one group is the world's (the default group, recorded as before)."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names or ()
    if EXPERT_DIM in names or CONTEXT_DIM in names:
        names = (*names, SHARD_DIM)  # the flattened dimension the other parameters shard over
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in names:
        group = mesh.get_group(name)
        # two dimensions over the same ranks share one group (cp and dp_shard when C is the shard group): both named
        same = out.get(group.group_name)
        label = name if same is None or same[0] == name else f"{same[0]}={name}"
        out[group.group_name] = (label, tuple(dist.get_process_group_ranks(group)))
    return out

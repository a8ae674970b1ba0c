"""Expert parallelism (parallel.expert = E > 1): each rank of an expert group (E consecutive ranks of a shard group,
train/mesh.py) holds 1 / E of every layer's experts, and tokens travel to the rank that holds their expert.

What stays transformers' own: the sparse-MoE block, its router (float32 softmax, top-k, normalisation), the
load-balancing loss and the experts' kernel (`config._experts_implementation`), run on this rank's experts with
local expert ids. Only the experts module's forward is replaced, by `ExpertDispatch`: the (token, expert) pairs
sorted by expert are grouped by the rank holding the expert; an all_to_all_single of the per-expert counts tells
every rank how many rows it gets, a second (the tokens, split sizes from the counts) brings them, the experts run,
a third sends the results back, and the sender weights and sums them per token as transformers' kernels do.
Every rank issues the three all-to-alls (and their two backward ones) whatever the router chose: a rank that
routed no token to a peer sends it zero rows, and a rank that received none still runs its experts on an empty
batch connected to the graph, so its backward all-to-alls run too.

Parameters. The 3-D expert parameters ([E_total, ...], one per projection) become DTensors sharded on dim 0 over
the expert group, then FSDP2 shards this rank's slice again over the ranks holding the same experts (ep_shard,
with dp_replicate under HSDP): a rank gathers only its own experts, and their gradients are reduce-scattered
over exactly the ranks holding them. Each such gradient already sums every token of the expert group (the
backward all-to-all brings them), so the reduction divides by the whole data-parallel world, as every other
parameter's does, not by the ranks it runs over. Every other parameter is sharded over the whole shard group as
without EP. Checkpoints and final/ see the logical [E_total, ...] tensors (DTensor placements).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from wattgate.errors import InputError
from wattgate.train.moe import experts_modules

EXPERT_PARAMS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj_bias")


@contextlib.contextmanager
def local_parameters(module):
    """The module's DTensor parameters as their local tensors (this rank's experts) for its kernel; to_local is
    differentiable, so the gradients reach the DTensors."""
    from torch.distributed.tensor import DTensor

    own = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    module._parameters.update({n: p.to_local() for n, p in own.items()})
    try:
        yield
    finally:
        module._parameters.update(own)


class ExpertDispatch:
    """The forward of one experts module under EP: (hidden_states [T, H], top_k_index [T, k] global expert ids,
    top_k_weights [T, k]) -> [T, H], the routed experts' weighted sum per token (module docstring)."""

    def __init__(self, module, kernel, group, ranks: int, local_experts: int) -> None:
        self.module = module
        self.kernel = kernel  # transformers' forward of the class (it picks the experts implementation)
        self.group = group
        self.ranks = ranks
        self.local_experts = local_experts

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        from torch.distributed.nn.functional import all_to_all_single

        tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)  # pairs by expert: by the rank holding it, too
        send_counts = torch.zeros(self.ranks * self.local_experts, dtype=torch.long, device=hidden_states.device)
        send_counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        send_counts = send_counts.view(self.ranks, self.local_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_sizes, recv_sizes = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
        # every pair is sent (the counts sum to them); taking the counts' number keeps the shapes consistent
        # with the split sizes wherever those come from
        sent = order[: sum(send_sizes)]
        received = hidden_states.new_empty(sum(recv_sizes), hidden_states.size(-1))
        received = all_to_all_single(received, hidden_states[sent // top_k], recv_sizes, send_sizes, self.group)
        local_ids = torch.arange(self.local_experts, device=hidden_states.device).repeat(self.ranks)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        with local_parameters(self.module):
            out = self.kernel(self.module, received, local_ids, torch.ones_like(local_ids, dtype=received.dtype))
            if out.requires_grad is False and received.requires_grad:
                # no row arrived: transformers' kernels return a constant, which would end the graph here and
                # skip this rank's backward all-to-alls; an empty product keeps them (and every expert) in it
                out = out + self._empty_product(received)
        back = hidden_states.new_empty(sum(send_sizes), out.size(-1))
        back = all_to_all_single(back, out.to(hidden_states.dtype), send_sizes, recv_sizes, self.group)
        pairs = back.new_zeros(tokens * top_k, back.size(-1)).index_copy(0, sent, back)
        weighted = pairs.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)
        return weighted.sum(dim=1).to(hidden_states.dtype)

    def _empty_product(self, received: torch.Tensor) -> torch.Tensor:
        """[0, H] zeros that depend on the received rows and on every local expert parameter."""
        out = received
        for name in EXPERT_PARAMS:
            param = self.module._parameters.get(name)
            if param is not None:
                out = out + (param.reshape(-1)[:0].sum() * 0).to(out.dtype)
        return out


def shard_experts(model, ep_mesh) -> int:
    """Each experts module's 3-D parameters sharded on dim 0 over `ep_mesh` (still on the meta device) and its
    forward replaced by the dispatch; returns how many modules."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ranks = ep_mesh.size()
    modules = experts_modules(model)
    for _, module in modules:
        total = int(module.__dict__["num_experts"])  # a plain attribute of transformers' experts classes
        if total % ranks:
            raise InputError(f"parallel.expert: {ranks} does not divide the {total} experts of {type(module).__name__}")
        for name in EXPERT_PARAMS:
            param = module._parameters.get(name)
            if param is None:
                continue
            if param.dim() == 0 or param.shape[0] != total:
                raise InputError(
                    f"parallel.expert: {type(module).__name__}.{name} is not laid out [experts, ...]; EP needs "
                    "transformers' 3-D expert parameters"
                )
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module._parameters[name] = torch.nn.Parameter(sharded, requires_grad=param.requires_grad)
        local = total // ranks
        module.num_experts = local  # the kernel counts this rank's experts only
        module.forward = ExpertDispatch(module, type(module).forward, ep_mesh.get_group(), ranks, local)
    return len(modules)


def parallelize_experts(model, mesh, mp_policy) -> None:
    """Under EP (`mesh` has the expert dimension): every experts module sharded over its expert group, then its own
    FSDP2 unit over the ranks holding the same experts, with the gradient divided by the whole data-parallel
    world (module docstring). Before the decoder layers' fully_shard, which then leaves these parameters out."""
    from torch.distributed.fsdp import fully_shard

    from wattgate.train.mesh import EXPERT_DIM, EXPERT_SHARD_DIM, experts_data_mesh

    if shard_experts(model, mesh[EXPERT_DIM]) == 0:
        raise InputError(f"parallel.expert: {type(model).__name__} has no experts module to shard")
    data_mesh = experts_data_mesh(mesh)
    for _, module in experts_modules(model):
        unit = fully_shard(module, mesh=data_mesh, mp_policy=mp_policy)
        unit.set_gradient_divide_factor(float(mesh.size()))
        if mesh[EXPERT_SHARD_DIM].size() > 1:
            # a sum, then the division: gloo has no pre-scaled sum. Not on one rank: torch 2.13 then divides twice
            unit.set_force_sum_reduction_for_comms(True)

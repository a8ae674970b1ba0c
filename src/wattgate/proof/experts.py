"""Mixture-of-Experts in the collective proof: the experts' kernel the dry run can execute, and the skewed routing
it is proven on.

Why routing cannot move a collective once train/moe.py's construction is in place: FSDP2's collectives are issued
per unit (a decoder layer, the root) by hooks around the unit's forward and backward, never by the ops inside it:
the all-gathers fetch all of the unit's parameters whatever the router chose, and with every unit reduce-scattering
all its parameters (a zero gradient for one no token reached) the reduce-scatter's list, shapes and dtypes are the
same too. Which experts got tokens changes only arithmetic inside the unit. The proof checks it rather than assuming
it: rank 0 is dry-run a second time with every experts module starved (no token reaches any expert, so none of the
experts' parameters gets a gradient on that rank: the most skewed routing there is, and for experts held as
separate parameters the union of every "this rank sent no token to expert e"), and its collectives must equal the
routed run's in every phase. Without the construction they differ at the first MoE layer's reduce-scatter.

The kernel. A FakeTensor has no values, so the dry run cannot run transformers' `eager` experts (a loop over the
experts `nonzero` finds hit: a data-dependent shape), and torch's meta kernel of `_grouped_mm` accepts bf16 only
(training's default `grouped_mm` runs fp32 on a real CPU). The dry run keeps training's kernel when it can run it
(grouped_mm under bf16 mixed precision, the GPU default) and otherwise runs `batched_mm`: the same parameters and
shapes, each token's experts gathered; the kernel moves no collective (above).
"""

from __future__ import annotations

from typing import Any

import torch

from wattgate.train.expert_parallel import ExpertDispatch
from wattgate.train.moe import experts_modules


def training_kernel(model) -> str:
    """The experts implementation training runs for this model (transformers resolves its default at build)."""
    return str(getattr(model.config, "_experts_implementation", None) or "eager")


def dry_run_kernel(model, compute_dtype: torch.dtype) -> str:
    """What the dry run runs the experts with: training's kernel when fake tensors can run it, else batched_mm."""
    kernel = training_kernel(model)
    if kernel == "grouped_mm" and compute_dtype == torch.bfloat16:
        return kernel
    return "batched_mm"


def prepare_dry_run_experts(model, compute_dtype: torch.dtype, starved: bool) -> dict | None:
    """Set the dry-run model's experts kernel (and starve them when `starved`); None for a dense model, else
    {training, dry_run, starved} for the proof's report."""
    experts = experts_modules(model)
    if not experts:
        return None
    kernel = training_kernel(model)
    chosen = dry_run_kernel(model, compute_dtype)
    # transformers configs (torch types a module's other attributes Tensor | Module)
    configs: dict[int, Any] = {id(m.config): m.config for _, m in experts if getattr(m, "config", None) is not None}
    for config in configs.values():
        config._experts_implementation = chosen
    if starved:
        for _, module in experts:
            dispatch = module.__dict__.get("forward")
            if isinstance(dispatch, ExpertDispatch):  # EP: the tokens still travel, none reaches an expert
                dispatch.kernel = _starved_kernel
            else:
                module.forward = _starved_forward
    return {"training": kernel, "dry_run": chosen, "starved": starved}


def _starved_kernel(module, hidden_states, *args):
    return _starved_forward(hidden_states, *args)


def _starved_forward(hidden_states, *args, **kwargs):
    """An experts module no token reaches: its output is zero and none of its parameters is used. The router's
    weights stay in the graph (times zero), as they would with its tokens all sent elsewhere."""
    out = torch.zeros_like(hidden_states)
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            out = out + (value * 0).sum().to(out.dtype)
    return out

"""Mixture-of-Experts models under FSDP2: which models are MoE, the construction that makes every rank's gradient
reduction the same whatever the router does, and the router's load-balancing term.

The hazard. A token goes to its router's top-k experts only, so which experts' parameters take part in a
rank's backward follows the data. FSDP2 (torch 2.13, `_fsdp_param_group.py` `post_backward`) reduce-scatters,
per unit, the parameters that received a gradient on that rank, in one flat buffer whose size is the sum of
their (padded) sizes; a parameter without a gradient is left out unless the unit's `reduce_scatter_unused_params`
is set, and a unit none of whose parameters got one skips its reduce-scatter. When experts are separate
parameters (transformers 4's `experts.<e>` ModuleList, custom model code) and one rank routes no token to an
expert, that rank's reduce-scatter is smaller than the others': gloo aborts ("Received data size doesn't match
expected size", measured), NCCL hangs or mixes up the gradients. transformers 5 holds each projection of all
experts in one 3-D parameter (`mlp.experts.gate_up_proj` [E, 2I, H]): an expert without a token gets zero rows
in a defined gradient, so these models are safe as long as every layer's experts see at least one token on
every rank, which top-k routing guarantees for a non-empty micro-batch, and no longer once the layout or the
experts' code is another.

The construction (`reduce_every_parameter`, applied by train/model.py `parallelize` right after fully_shard, so
the collective proof's dry run gets it too): on an MoE model every FSDP2 unit reduce-scatters every parameter it
holds, with a zero gradient for one that got none on this rank (FSDP2's own `set_reduce_scatter_unused_params`).
Exact: the gradient of the loss with respect to a parameter outside this rank's graph is zero, and the reduced
sum over ranks is the gradient of the global loss; no term is added to the loss. Each unit's reduce-scatter is
then the same list of parameters, shapes and dtypes on every rank whatever the routing, and its all-gathers
were never routing-dependent (a unit gathers all its parameters before its forward and backward). The collective
proof dry-runs one rank a second time with no token reaching any expert (proof/experts.py) and fails if anything
it issues differs.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import torch

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MOE_MODULE = re.compile(r"Experts|Moe|MoE")  # Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, GptOssExperts, ...
AUX_NOTICE = "wattgate_router_aux_notice"


def moe_reason(config, model) -> str | None:
    """Why the model is a Mixture-of-Experts (its first config key that says so, or its expert modules), or None.
    One key: configs alias them (Qwen3-MoE's num_local_experts is its num_experts)."""
    for k in MOE_KEYS:
        value = getattr(config, k, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return f"{k} {value}"
    kinds = sorted({type(m).__name__ for m in model.modules() if MOE_MODULE.search(type(m).__name__)})
    return f"expert modules {', '.join(kinds)}" if kinds else None


def experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """The modules that compute the experts from (hidden states, routing): transformers 5's `*Experts` classes."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]


def reduce_every_parameter(model) -> bool:
    """On an MoE model (already under fully_shard): every FSDP2 unit reduce-scatters all its parameters, a zero
    gradient for any this rank's tokens did not reach. True when it was applied (a dense model is left as it is:
    its parameters take part in every backward, and one never used keeps no gradient, as in a single process)."""
    from torch.distributed.fsdp import FSDPModule

    if moe_reason(model.config, model) is None or not isinstance(model, FSDPModule):
        return False
    model.set_reduce_scatter_unused_params(True)  # recurse: every unit below the root, each decoder layer
    return True


def every_parameter_reduced(model) -> bool:
    """Whether every FSDP2 unit of `model` reduce-scatters all its parameters (the construction is in place)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [
        g
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups  # noqa: SLF001 - the flag FSDP2 reads is on each group
    ]
    return bool(groups) and all(g.reduce_scatter_unused_params for g in groups)


# ---------------------------------------------------------------- the router's load-balancing term


def router_aux(model) -> tuple[float, Callable[..., torch.Tensor]] | None:
    """(router_aux_loss_coef, the model's own load_balancing_loss_func) when the model's forward adds the router's
    load-balancing loss to its loss (config.output_router_logits true, a nonzero coefficient), else None."""
    config = model.config
    coef = getattr(config, "router_aux_loss_coef", None)
    if not getattr(config, "output_router_logits", False) or not coef:
        return None
    func = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if func is None:  # an FSDP2 subclass lives in torch's module: the model's own class is its base
        for base in type(model).__mro__[1:]:
            func = getattr(sys.modules.get(base.__module__), "load_balancing_loss_func", None)
            if func is not None:
                break
    if func is None:
        return None
    return float(coef), func


def router_aux_term(model, router_logits, loss_tokens: torch.Tensor) -> torch.Tensor:
    """coef x the model's load_balancing_loss_func over this micro-batch's router logits x its loss tokens: divided
    by the global batch's loss tokens (as the token losses are) it is the token-weighted mean over micro-batches
    of the term transformers' forward adds to its mean token loss (for one micro-batch, exactly that term)."""
    aux = router_aux(model)
    assert aux is not None  # router logits are collected only for a model that trains the term (train/loss.py)
    coef, func = aux
    experts = int(getattr(model, "num_experts", 0) or _config_experts(model.config))
    top_k = int(getattr(model, "num_experts_per_tok", 0) or model.config.num_experts_per_tok)
    aux = func(tuple(router_logits), experts, top_k, None)
    return coef * aux.float() * loss_tokens


def _config_experts(config) -> int:
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))


def gradient_only(value: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """`value` with `term`'s gradient and not its value: value + (term - term), the difference exactly zero for a
    finite term (a non-finite one makes the loss non-finite, which the step's guard then reports)."""
    return value + (term - term.detach())


def aux_notice(model) -> None:
    """Rank 0's one line, once per model, when the router's load-balancing term is trained."""
    if model.__dict__.get(AUX_NOTICE) or (aux := router_aux(model)) is None:
        return
    object.__setattr__(model, AUX_NOTICE, True)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        coef, _ = aux
        print(
            f"train: output_router_logits is on: the router's load-balancing loss (x {coef:g}) is trained with the "
            "token loss; the reported losses are the token cross-entropy",
            flush=True,
        )

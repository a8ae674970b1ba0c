"""The gate's resource checks: `fit` (every phase's estimated memory peak within its budget) and
`checkpoint_space` (room on disk for the checkpoints kept and the final export).
"""

from __future__ import annotations

from wattgate.gate.checks import Check
from wattgate.gate.memory import GIB, Budget


FIT_HINTS = {
    "load": "more GPUs shard the fp32 parameters further",
    "steady": "try train.activation_checkpointing, a smaller micro batch, or more GPUs",
    "export": "more GPUs shard the parameters and AdamW state further",
    "host_per_node": "fewer ranks per node, or set cluster.host_mem_gib to what the nodes have",
}


def _budget_text(budget: Budget, headroom: float) -> str:
    assert budget.bytes is not None  # check_fit words only the budgets it checked
    usable = budget.bytes * (1 - headroom)
    return f"{usable / GIB:.1f} GiB usable ({budget.bytes / GIB:.1f} GiB from {budget.source}, {headroom:.0%} headroom)"


def context_suggestion(context_steady: dict[int, int], usable: float) -> str:
    """The smallest parallel.context whose steady peak fits `usable` bytes, or that none of them does; empty when
    there is no degree to try (parallel.expert > 1, a model with recurrent-state layers, already the largest)."""
    if not context_steady:
        return ""
    fitting = [c for c, total in sorted(context_steady.items()) if total <= usable]
    if fitting:
        return f"parallel.context {fitting[0]} would fit ({context_steady[fitting[0]] / GIB:.1f} GiB per rank)"
    largest = max(context_steady)
    return f"no parallel.context up to {largest} fits ({largest}: {context_steady[largest] / GIB:.1f} GiB per rank)"


def check_fit(
    phases: dict[str, dict[str, int]],
    budgets: dict[str, Budget],
    headroom: float,
    mesh: str = "",
    context_steady: dict[int, int] | None = None,
) -> Check:
    """Estimated peak of every phase (device per rank: load, steady, export; host per node) within its budget;
    `mesh`, when not empty, ends the detail (the mesh the estimate is for: parallel.expert's, parallel.context's).
    When steady does not fit, `context_steady` (the steady peak at each parallel.context the run could grow to)
    names the smallest that would, after the steady item: more context ranks split each row's activations.

    A phase whose budget is unknown (bytes None) is reported as not checked and does not fail.
    """
    over, fits, unchecked = [], {}, []
    for phase, terms in phases.items():
        budget, total = budgets[phase], sum(terms.values())
        if budget.bytes is None:
            unchecked.append(f"{phase} {total / GIB:.1f} GiB per {budget.per} {budget.source}")
        elif total > budget.bytes * (1 - headroom):
            biggest = max(terms, key=terms.__getitem__)
            over.append(
                f"{phase}: estimated peak {total / GIB:.1f} GiB per {budget.per} > "
                f"{_budget_text(budget, headroom)}; largest term {biggest} {terms[biggest] / GIB:.1f} GiB "
                f"({FIT_HINTS.get(phase, 'more GPUs')})"
            )
            if phase == "steady":
                over.extend(filter(None, [context_suggestion(context_steady or {}, budget.bytes * (1 - headroom))]))
        else:
            fits.setdefault(budget, []).append(f"{phase} {total / GIB:.1f}")
    if over:
        fitting = [f"{', '.join(items)} GiB per {budget.per}" for budget, items in fits.items()]
        rest = ([f"fits: {', '.join(fitting)}"] if fitting else []) + unchecked
        return Check("fit", False, "; ".join(over + rest + [mesh] * bool(mesh)))
    fitting = [
        f"{', '.join(items)} GiB per {budget.per} of {_budget_text(budget, headroom)}" for budget, items in fits.items()
    ]
    return Check("fit", True, "; ".join(fitting + unchecked + [mesh] * bool(mesh)))


def check_checkpoint_space(checkpoint_bytes: int, keep: int, final_bytes: int, free_bytes: int, where: str) -> Check:
    """Room for keep checkpoints (+1 being written before the oldest is deleted) and the final export."""
    need = (keep + 1) * checkpoint_bytes + final_bytes
    detail = (
        f"need {need / GIB:.2f} GiB ({keep}+1 x {checkpoint_bytes / GIB:.2f} GiB checkpoints + "
        f"{final_bytes / GIB:.2f} GiB final), {free_bytes / GIB:.1f} GiB free at {where}"
    )
    return Check("checkpoint_space", need <= free_bytes, detail)

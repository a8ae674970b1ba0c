"""Gate check `document_isolation`: packed documents cannot see each other in this model.

wattgate packs several documents into one row and keeps them apart by restarting `position_ids` at each
document, which transformers' attention honours (tests/test_attention.py). A layer with a recurrent state
(Mamba/SSM, a short convolution, linear attention: Jamba, Bamba, Granite 4 hybrids, LFM2, Qwen3-Next) carries
that state from one document into the next on the paths transformers runs here, so a packed row would train each
document on the end of the one before it: another objective, silently. Which layers hold such a state is
transformers' own answer (train/model.py `recurrent_layers`), read from the proof's depth record when the proof ran
or was reused (no torch import on a rerun), else asked here. Such a model passes only when every pack of the plan,
training and validation, holds one document (the pack stage plans that for it: pack.documents_per_row auto), and
the detail says what that costs: the plan's packing efficiency against the same documents packed many per row."""

from __future__ import annotations

import math

import numpy as np

from wattgate.errors import InputError, first_line
from wattgate.gate.checks import Check
from wattgate.pack.bfd import pack_bfd
from wattgate.records.gate import Collectives
from wattgate.records.plan import Plan
from wattgate.records.run_config import RunConfig
from wattgate.run_files import PackRows

NAME = "document_isolation"


def shared_packs(packs: list[PackRows]) -> tuple[int, int]:
    """(packs holding two or more documents, all packs) over `packs`."""
    shared = sum(int((p.docs_per_row >= 2).sum()) for p in packs)
    return shared, sum(len(p.docs_per_row) for p in packs)


def packing_cost(plan: Plan, packs: PackRows) -> str:
    """This plan's packing efficiency (tokens / (rows x seq_len)) beside what its first epoch's documents would
    have packed to many per row: best-fit decreasing into seq_len, the row count rounded up to whole steps, as the
    pack stage's bfd+rebin does."""
    seq_len, per_step = plan.seq_len, plan.world_size * plan.micro_batch_size * plan.grad_accum
    if not len(packs):
        return "no packs"
    one = float(packs.num_tokens.sum() / (len(packs) * seq_len))
    first = np.repeat(packs.epoch == packs.epoch.min(), packs.docs_per_row)
    lengths = packs.doc_lengths[first]
    if not len(lengths) or lengths.min() < 1 or lengths.max() > seq_len:
        return f"packing efficiency {one:.3f}"  # pack_contents names the lengths that are out of range
    bins = int(pack_bfd(lengths, seq_len).max()) + 1
    many = float(lengths.sum() / (math.ceil(bins / per_step) * per_step * seq_len))
    return (
        f"packing efficiency {one:.3f} (tokens / (rows x seq_len)) against {many:.3f} for the same documents packed "
        f"many per row (best-fit decreasing, whole steps): {many / one:.2f}x the rows"
    )


def model_recurrence(config: RunConfig, proof: Collectives | None) -> tuple[str, tuple[str, ...]]:
    """(how the model is named, its layers with a recurrent state): from the proof's depth when it has one."""
    if proof is not None and proof.depth is not None:
        return proof.depth.model, proof.depth.recurrent or ()
    from wattgate.proof.depth import model_label
    from wattgate.hf_config import model_hf_config, recurrent_layers

    hf_config = model_hf_config(config.model)
    return model_label(config.model, hf_config), recurrent_layers(hf_config)


def check_document_isolation(
    config: RunConfig, plan: Plan, packs: list[PackRows], proof: Collectives | None = None
) -> Check:
    """Pass for a model whose layers all attend (position_ids keep packed documents apart), or whose packs each
    hold one document (saying what that costs); fail naming the recurrent layers and how many packs share them
    otherwise. `packs`: the training packs first, then the validation pass's."""
    try:
        label, layers = model_recurrence(config, proof)
    except InputError as exc:
        return Check(NAME, False, str(exc))
    except Exception as exc:  # noqa: BLE001 - transformers cannot say which layers keep a state: not proven, named
        return Check(
            NAME,
            False,
            "model: transformers cannot build a cache for it, so which layers carry a recurrent state across "
            f"packed documents is unknown ({first_line(exc)})",
        )
    if not layers:
        return Check(NAME, True, "every layer attends: packed documents restart position_ids and see only themselves")
    shared, total = shared_packs(packs)
    shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    carry = "carries a recurrent state" if len(layers) == 1 else "carry a recurrent state"
    if not shared:
        planned = " (plan.json max_documents_per_row 1)" if plan.max_documents_per_row == 1 else ""
        return Check(
            NAME,
            True,
            f"{label}: {shown} {carry}, so rows hold one document each{planned}: every one of {total} packs holds "
            f"one document at most; {packing_cost(plan, packs[0]) if packs else 'no packs'}",
        )
    return Check(
        NAME,
        False,
        f"{label}: {shown} {carry} (SSM, convolution or linear attention) that transformers does not restart where "
        f"a packed document starts, and {shared} of {total} packs hold two or more documents: each would be "
        "trained on the one before it. wattgate keeps packed documents apart in attention layers only: rerun pack "
        "with pack.documents_per_row auto or one (one document per row; docs/architectures.md)",
    )

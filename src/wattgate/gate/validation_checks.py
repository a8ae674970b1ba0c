"""The gate's validation checks: the held-out pass proven like training (pack/validation.py, data/split.py).

validation_steps: every rank runs the same validation micro-batch sequence, so no rank waits alone in an
all-gather during a pass; validation_conservation: every held-out document exactly once per pass;
leakage: no held-out document's content equals a training document's, and none is packed for training.
Each is a pure function over loaded arrays (gate/inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wattgate.gate.checks import Check, _listed, _per_rank, _where
from wattgate.gate.inputs import PackRows, ValidationInputs
from wattgate.records.manifest import ManifestValidation

NO_SPLIT = "no validation split (data.validation not set)"
LEAKAGE_TABLE = 1 << 22  # entries of the leakage screen (4 MB): few false candidates up to ~100k held out


def _problems_check(name: str, v: ValidationInputs) -> Check | None:
    if v.packs is None or v.problems:
        return Check(name, False, _listed(list(v.problems) or ["the plan has no validation pass; rerun pack"]))
    return None


@dataclass(frozen=True)
class ValidationParting:
    """Where ranks with different validation micro-batch counts part: the first micro-batch index some rank runs
    and another does not, the ranks on either side, and each rank's count."""

    micro: int
    ranks_with: tuple[int, ...]
    ranks_without: tuple[int, ...]
    per_rank: tuple[int, ...]


def validation_divergence(packs: PackRows, world_size: int) -> ValidationParting | None:
    """Where ranks with different validation micro-batch counts part; None when the counts agree."""
    counts = np.array([len(np.unique(packs.micro[packs.rank == r])) for r in range(world_size)])
    if counts.min() == counts.max():
        return None
    low = int(counts.min())
    return ValidationParting(
        micro=low,
        ranks_with=tuple(int(r) for r in np.flatnonzero(counts > low)),
        ranks_without=tuple(int(r) for r in np.flatnonzero(counts == low)),
        per_rank=tuple(counts.astype(int).tolist()),
    )


def check_validation_steps(
    v: ValidationInputs | None, world_size: int, micro_batch_size: int, planned_micro_batches: int | None
) -> Check:
    """Every rank runs the same validation micro-batches, each of eval_micro_batch_size packs."""
    name = "validation_steps"
    if v is None:
        return Check(name, True, NO_SPLIT)
    if (bad := _problems_check(name, v)) is not None:
        return bad
    packs = v.packs
    assert packs is not None  # else _problems_check returned its Check
    if len(packs) == 0:
        return Check(name, False, "the validation pass has no packs; rerun pack")
    outside = np.flatnonzero((packs.rank < 0) | (packs.rank >= world_size) | (packs.epoch != 0) | (packs.step != 0))
    if outside.size:
        return Check(
            name, False, f"a row outside rank 0..{world_size - 1}, epoch 0, step 0 at {_where(packs, outside)}"
        )
    per_rank_packs = np.bincount(packs.rank, minlength=world_size)
    problems = []
    div = validation_divergence(packs, world_size)
    sequences = [np.unique(packs.micro[packs.rank == r]) for r in range(world_size)]
    micro = np.array([len(seq) for seq in sequences])
    if div is not None:
        few, many = div.ranks_without[0], int(np.argmax(micro))
        problems.append(
            f"validation micro-batches per rank {_per_rank(micro)}: rank {many} would run micro-batch "
            f"{div.micro + 1} of every validation pass alone and hang in its all-gather while rank {few} "
            "has left the pass"
        )
    else:
        if any(not np.array_equal(sequences[0], s) for s in sequences[1:]):
            problems.append("ranks run different validation micro-batch sequences")
        if planned_micro_batches is not None and micro[0] != planned_micro_batches:
            problems.append(f"{micro[0]} validation micro-batches per rank, plan.json says {planned_micro_batches}")
    key = packs.rank * (int(packs.micro.max()) + 1) + packs.micro
    _, per_micro = np.unique(key, return_counts=True)
    if (per_micro != micro_batch_size).any():
        problems.append(
            f"{int((per_micro != micro_batch_size).sum())} validation micro-batch(es) with a pack count other "
            f"than eval_micro_batch_size {micro_batch_size}"
        )
    if problems:
        return Check(name, False, _listed(problems) + f" (packs per rank {_per_rank(per_rank_packs)})")
    return Check(
        name,
        True,
        f"{world_size} ranks x {int(micro[0])} validation micro-batches x {micro_batch_size} packs, identical on "
        "every rank",
    )


def check_validation_conservation(
    v: ValidationInputs | None, doc_tokens: np.ndarray, section: ManifestValidation | None, seq_len: int
) -> Check:
    """Every held-out document exactly once in the validation pass, nothing else; lengths and sums match."""
    name = "validation_conservation"
    if v is None:
        return Check(name, True, NO_SPLIT)
    if (bad := _problems_check(name, v)) is not None:
        return bad
    packs, n = v.packs, len(doc_tokens)
    assert packs is not None  # else _problems_check returned its Check
    ids = packs.doc_ids
    if len(ids) and (ids.min() < 0 or ids.max() >= n):
        return Check(name, False, f"validation doc_id outside 0..{n - 1}")
    problems = []
    seen = np.bincount(ids, minlength=n)
    held = np.zeros(n, dtype=bool)
    held[v.held_out] = True
    twice, missing, foreign = (
        np.flatnonzero(seen > 1),
        np.flatnonzero(held & (seen == 0)),
        np.flatnonzero(~held & (seen > 0)),
    )
    if twice.size:
        problems.append(f"{twice.size} held-out document(s) more than once, e.g. doc_id {twice[0]} x{seen[twice[0]]}")
    if missing.size:
        problems.append(f"{missing.size} held-out document(s) not in the pass, e.g. doc_id {missing[0]}")
    if foreign.size:
        problems.append(f"{foreign.size} document(s) outside the split in the pass, e.g. doc_id {foreign[0]}")
    if not np.array_equal(packs.offsets, packs.length_offsets) or (doc_tokens[ids] != packs.doc_lengths).any():
        problems.append("validation doc_lengths differ from the shards")
    elif (packs.sum_per_row(packs.doc_lengths) != packs.num_tokens).any():
        problems.append("a validation pack's num_tokens differs from the sum of its doc_lengths")
    if (packs.num_tokens > seq_len).any():
        problems.append(f"a validation pack over seq_len {seq_len}")
    want = section.num_tokens if section is not None else None
    if int(doc_tokens[v.held_out].sum()) != want:
        problems.append(f"held-out documents hold {int(doc_tokens[v.held_out].sum())} tokens, the manifest says {want}")
    if problems:
        return Check(name, False, _listed(problems))
    empty = int((packs.docs_per_row == 0).sum())
    return Check(
        name,
        True,
        f"{len(v.held_out)} held-out documents ({int(doc_tokens[v.held_out].sum())} tokens) exactly once per "
        f"pass in {len(packs)} packs ({empty} empty: padding with no loss token)",
    )


def check_leakage(v: ValidationInputs | None, train_packs: PackRows) -> Check:
    """No held-out document's content equals a training document's, and no held-out doc_id is packed for training."""
    name = "leakage"
    if v is None:
        return Check(name, True, NO_SPLIT)
    if v.problems and not len(v.held_out):
        return Check(name, False, _listed(list(v.problems)))
    problems = []
    hashes = v.content_hashes
    held = np.zeros(max(len(hashes), int(train_packs.doc_ids.max(initial=-1)) + 1), dtype=bool)
    held[v.held_out] = True
    in_training = held[train_packs.doc_ids]  # a gather: O(entries), no sort
    if in_training.any():
        d = int(train_packs.doc_ids[np.flatnonzero(in_training)[0]])
        problems.append(f"{int(in_training.sum())} held-out document entries packed for training, e.g. doc_id {d}")
    # a table of the held-out hashes' low bits screens every training hash with one gather; only the few
    # that pass are looked up exactly among the sorted held-out hashes: O(n), no sort of the corpus
    low = hashes & (LEAKAGE_TABLE - 1)
    table = np.zeros(LEAKAGE_TABLE, dtype=bool)
    table[low[v.held_out]] = True
    train = np.flatnonzero(~held[: len(hashes)] & table[low])
    held_hashes = np.sort(hashes[v.held_out])
    at = np.minimum(np.searchsorted(held_hashes, hashes[train]), max(len(held_hashes) - 1, 0))
    twins = train[held_hashes[at] == hashes[train]] if len(held_hashes) else train[:0]
    if twins.size:
        copied = np.flatnonzero(held[: len(hashes)] & np.isin(hashes, hashes[twins]))
        twin = int(twins[hashes[twins] == hashes[copied[0]]][0])
        problems.append(
            f"{copied.size} held-out document(s) are exact copies of training documents, e.g. validation "
            f"doc_id {int(copied[0])} = training doc_id {twin}; remove them from data.validation.inputs "
            "(or carve with data.validation.fraction, which keeps copies on one side)"
        )
    if problems:
        return Check(name, False, _listed(problems))
    return Check(name, True, f"{len(v.held_out)} held-out documents share no content with the training documents")

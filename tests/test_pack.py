"""Pack-and-balance invariants for arbitrary corpora and layouts (hypothesis)."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wattgate.errors import InputError
from wattgate.pack.assign import Layout
from wattgate.pack.bfd import pack_bfd
from wattgate.pack.planner import plan_packs


def reference_bfd_bins(lengths, capacity):
    """Item-by-item best-fit decreasing: the number of bins it opens."""
    rooms = []
    for size in sorted(lengths, reverse=True):
        fits = [i for i, r in enumerate(rooms) if r >= size]
        if fits:
            best = min(fits, key=lambda i: rooms[i])
            rooms[best] -= size
        else:
            rooms.append(capacity - size)
    return len(rooms)


@st.composite
def lengths_and_capacity(draw):
    capacity = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=400))
    return np.array(lengths), capacity


@given(lengths_and_capacity())
@settings(max_examples=300, deadline=None)
def test_bfd_fits_places_every_doc_and_matches_reference(case):
    lengths, capacity = case
    pack_of = pack_bfd(lengths, capacity)
    assert pack_of.shape == lengths.shape
    fill = np.bincount(pack_of, weights=lengths)
    assert (fill <= capacity).all() and (fill > 0).all()  # fits, dense ids, none empty
    assert pack_of.max() + 1 == reference_bfd_bins(lengths.tolist(), capacity)
    assert np.array_equal(pack_of, pack_bfd(lengths, capacity))  # deterministic


def test_bfd_rejects_lengths_out_of_range():
    with pytest.raises(ValueError):
        pack_bfd(np.array([5, 11]), 10)
    with pytest.raises(ValueError):
        pack_bfd(np.array([0]), 10)


def test_bfd_efficiency_on_heavy_tail():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(6, 1, 50_000)), 1, 8192).astype(int)
    packs = pack_bfd(lengths, 8192).max() + 1
    assert lengths.sum() / (packs * 8192) >= 0.998


@st.composite
def plans(draw, remainder):
    seq_len = draw(st.integers(8, 256))
    n = draw(st.integers(1, 600))
    lengths = np.array(draw(st.lists(st.integers(1, seq_len), min_size=n, max_size=n)))
    layout = Layout(draw(st.integers(1, 8)), draw(st.integers(1, 3)), draw(st.integers(1, 4)))
    epochs = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    return lengths, seq_len, layout, remainder, epochs, seed


def per_rank_counts(placement, epoch, rank):
    sel = (placement.epoch == epoch) & (placement.rank == rank)
    micro = set(zip(placement.step[sel].tolist(), placement.micro[sel].tolist()))
    return int(sel.sum()), len(micro), len(set(placement.step[sel].tolist()))


def assert_equal_schedule(placement, layout, epochs):
    for epoch in range(epochs):
        counts = {per_rank_counts(placement, epoch, r) for r in range(layout.world_size)}
        assert len(counts) == 1, f"epoch {epoch}: ranks differ {counts}"
        packs, micros, steps = counts.pop()
        assert packs == micros * layout.micro_batch_size
        assert micros == steps * layout.grad_accum
        sel = placement.epoch == epoch
        # every (step, micro, rank) holds exactly micro_batch_size slots 0..mbs-1
        keys = Counter(zip(placement.step[sel], placement.micro[sel], placement.rank[sel], placement.slot[sel]))
        assert max(keys.values()) == 1
        assert set(placement.slot[sel].tolist()) == set(range(layout.micro_batch_size))


def assert_every_doc_once_per_epoch(packs, placement, n_docs, epochs, dropped=()):
    for epoch in range(epochs):
        used = np.concatenate([packs.members(p) for p in placement.pack[placement.epoch == epoch]])
        seen = Counter(used.tolist())
        assert max(seen.values()) == 1
        assert set(seen) | set(dropped) == set(range(n_docs))
        assert not set(seen) & set(dropped)


def assert_packs_fit(packs, tokens, lengths, seq_len):
    assert (packs.sizes > 0).all()
    assert (tokens <= seq_len).all()
    assert all(int(lengths[packs.members(p)].sum()) == t for p, t in enumerate(tokens))


@given(plans("rebin"))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_rebin_equal_schedule_every_doc_once(case):
    lengths, seq_len, layout, remainder, epochs, seed = case
    try:
        packs, placement, tokens, _ = plan_packs(lengths, seq_len, layout, remainder, epochs, seed, 1e-3)
    except InputError:  # refused only when too few documents exist to fill the packs
        n_packs = pack_bfd(lengths, seq_len).max() + 1
        assert len(lengths) < n_packs + (-n_packs) % layout.packs_per_step
        return
    assert len(packs) % layout.packs_per_step == 0
    assert_packs_fit(packs, tokens, lengths, seq_len)
    assert_equal_schedule(placement, layout, epochs)
    assert_every_doc_once_per_epoch(packs, placement, len(lengths), epochs)
    again = plan_packs(lengths, seq_len, layout, remainder, epochs, seed, 1e-3)[1]
    assert all(np.array_equal(getattr(placement, f), getattr(again, f)) for f in vars(placement))


@given(plans("drop"))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_drop_equal_schedule_and_dropped_listed(case):
    lengths, seq_len, layout, remainder, epochs, seed = case
    try:
        packs, placement, tokens, _ = plan_packs(lengths, seq_len, layout, remainder, epochs, seed, 0.0)
    except InputError:
        assert pack_bfd(lengths, seq_len).max() + 1 < layout.packs_per_step
        return
    assert_packs_fit(packs, tokens, lengths, seq_len)
    assert_equal_schedule(placement, layout, epochs)
    assert_every_doc_once_per_epoch(packs, placement, len(lengths), epochs, packs.dropped_docs.tolist())
    assert len(packs.dropped_docs) == len(set(packs.dropped_docs.tolist()))


def test_rebin_drops_nothing_where_drop_loses_documents():
    rng = np.random.default_rng(3)
    lengths = np.clip(np.round(rng.lognormal(4, 1, 2000)), 1, 512).astype(int)
    layout = Layout(4, 2, 2)
    rebinned, placement, _, _ = plan_packs(lengths, 512, layout, "rebin", 1, 0, 0.0)
    dropped = plan_packs(lengths, 512, layout, "drop", 1, 0, 0.0)[0]
    assert len(rebinned.dropped_docs) == 0 and len(dropped.dropped_docs) > 0
    assert len(rebinned) % 16 == 0


def test_none_control_leaves_ranks_uneven():
    lengths = np.array([100] * 7 + [10] * 3)
    layout = Layout(2, 1, 1)
    packs, placement, _, _ = plan_packs(lengths, 100, layout, "none", 1, 0, 0.0)
    counts = [per_rank_counts(placement, 0, r)[0] for r in range(2)]
    assert counts[0] != counts[1]


def test_epochs_get_different_orders_and_balance_holds():
    rng = np.random.default_rng(5)
    lengths = np.clip(np.round(rng.lognormal(5, 1, 5000)), 1, 1024).astype(int)
    layout = Layout(8, 1, 4)
    packs, placement, tokens, costs = plan_packs(lengths, 1024, layout, "rebin", 2, 7, 1e-5)
    first = placement.pack[placement.epoch == 0]
    second = placement.pack[placement.epoch == 1]
    assert not np.array_equal(first, second)
    from wattgate.pack.assign import rank_cost_ratios

    ratios = rank_cost_ratios(placement, costs, layout.world_size)
    assert ratios.max_step < 1.10
    # no rank is a permanent straggler: total cost per rank within 1%
    per_rank = np.bincount(placement.rank, weights=costs[placement.pack])
    assert per_rank.max() / per_rank.mean() < 1.01


def test_different_seeds_differ_same_seed_same():
    lengths = np.arange(1, 200) % 50 + 1
    layout = Layout(2, 2, 1)
    a = plan_packs(lengths, 64, layout, "rebin", 1, 1, 0.0)[1]
    b = plan_packs(lengths, 64, layout, "rebin", 1, 1, 0.0)[1]
    c = plan_packs(lengths, 64, layout, "rebin", 1, 2, 0.0)[1]
    assert np.array_equal(a.pack, b.pack)
    assert not np.array_equal(a.pack, c.pack)


@pytest.mark.parametrize(
    "docs, world, grad_accum",
    [(20_000, 16, 8), (100_000, 2, 8), (100_000, 256, 8), (100_000, 1024, 8), (3_000, 7, 3)],
)
def test_the_plan_fills_its_packs_to_the_remainder_bound(docs, world, grad_accum):
    """Efficiency (tokens / (packs x seq_len)) can only be lost to the rounding of each epoch's packs to whole steps:
    the plan reaches that bound, at 20k documents and at 1024 ranks too."""
    from wattgate.pack.plan import efficiency_bound

    seq_len = 8192
    lengths = np.clip(np.rint(np.random.default_rng(0).lognormal(6.0, 1.0, docs)), 1, seq_len).astype(np.int64)
    layout = Layout(world, 1, grad_accum)
    packs, _, tokens, _ = plan_packs(lengths, seq_len, layout, "rebin", 1, 0, 1e-5)
    efficiency = tokens.sum() / (len(packs) * seq_len)
    bound = efficiency_bound([int(lengths.sum())], seq_len, layout.packs_per_step)
    assert bound - 1e-12 <= efficiency <= bound + 1e-12, (efficiency, bound)


def test_the_gate_says_why_a_small_corpus_on_a_wide_world_cannot_fill_its_packs():
    from wattgate.gate.checks import fill_note
    from wattgate.records.plan import Plan, PlanStats

    def plan(efficiency, bound):
        stats = PlanStats(efficiency=efficiency, efficiency_bound=bound)
        return Plan(
            world_size=16,
            seq_len=8192,
            micro_batch_size=1,
            grad_accum=8,
            epochs=1,
            steps_per_epoch=13,
            seed=0,
            attn_weight=1e-5,
            remainder="rebin",
            stats=stats,
        )

    small = fill_note(plan(0.9684, 0.9684))
    assert "whole steps of 128 packs cap any plan of these tokens at 0.9684" in small
    assert fill_note(plan(0.9995, 0.9995)) == "; packs 0.9995 full"
    coarse = fill_note(plan(0.8457, 0.9867))
    assert "packs 0.8457 full" in coarse and "do not pack tighter" in coarse

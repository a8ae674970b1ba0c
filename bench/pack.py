"""Packing speed and efficiency: wattgate's BFD (+ rebin + rank placement) vs TRL's BFD.

Both sides get the same document lengths, all within [1, seq_len], so TRL's
`bfd` strategy (truncate overflow) truncates nothing and both pack the same
tokens. TRL is run with its defaults: `Dataset.map` in batches of 1000 rows, so
it packs each batch of 1000 documents on its own; its time includes moving the
token data (pc.take), ours works on lengths only, which is what the pack stage
gets from the pretokenized manifest.

TRL is the `bench` extra (`pip install -c constraints/cpu.txt -e '.[bench]'`): without it the full run stops
with one line, and `--smoke` measures our side only and says the baseline was not measured.

    python bench/pack.py [--n 1000000] [--quick] [--smoke] [--repeat N]
"""

from __future__ import annotations

import os
import time
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from benchlib import Parser, fail, figure, positive_int
from wattgate.pack.assign import Layout
from wattgate.pack.bfd import pack_bfd
from wattgate.pack.plan import efficiency_bound
from wattgate.pack.planner import plan_packs

SEQ_LEN = 8192
WORLD_SIZE, MICRO_BATCH, GRAD_ACCUM = 16, 1, 8
ATTN_WEIGHT = 1.0e-5  # the schema default for pack.attn_weight
TARGET_SPEEDUP = 20.0
TARGET_EFFICIENCY = 0.998  # on lognormal
CHECK_DOCS = 20_000  # docs for the pack-count cross-check against one TRL batch
SMOKE_DOCS, SMOKE_WARM_DOCS = 3000, 300
NO_TRL = "TRL pack_dataset bfd not measured: trl is not installed (the bench extra)"


def trl_available() -> bool:
    try:
        import trl.data_utils  # noqa: F401
    except ImportError:
        return False
    return True


def lognormal_lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(mean=6.0, sigma=1.0, size=n)), 1, SEQ_LEN).astype(np.int64)


def pareto_lengths(n: int, seed: int) -> np.ndarray:
    # Lomax(a=1.5) has median 2**(1/a) - 1; scale it so the median is ~300 tokens.
    rng = np.random.default_rng(seed)
    scale = 300.0 / (2.0 ** (1 / 1.5) - 1.0)
    return np.clip(np.rint(scale * rng.pareto(1.5, size=n)), 1, SEQ_LEN).astype(np.int64)


def timed(fn, *args, repeat: int = 1):
    """Result and fastest wall time of `repeat` calls (this 2-core VM's timings vary by tens of percent)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - start)
    return out, best


def build_dataset(lengths: np.ndarray):
    """A Dataset whose `input_ids` rows have the given lengths (content irrelevant), built from Arrow buffers."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.ones(int(offsets[-1]), dtype=np.int32))  # ones, not zeros: pages resident like real data
    if offsets[-1] < 2**31:
        column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    else:
        column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    # an explicit fingerprint: otherwise datasets hashes every token (seconds per 100M tokens)
    return datasets.Dataset(pa.table({"input_ids": column}), fingerprint=uuid.uuid4().hex)


def trl_pack(dataset, map_kwargs=None):
    from trl.data_utils import pack_dataset

    return pack_dataset(dataset, seq_length=SEQ_LEN, strategy="bfd", map_kwargs=map_kwargs)


def trl_stats(packed) -> tuple[int, int]:
    """(rows, tokens) of TRL's output, counting the tokens it actually kept."""
    column = packed.data.column("seq_lengths")
    return packed.num_rows, int(pc.sum(pc.list_flatten(column)).as_py())


def ours_bfd(lengths: np.ndarray) -> np.ndarray:
    return pack_bfd(lengths, SEQ_LEN)


def ours_full(lengths: np.ndarray):
    """What the pack stage does before writing: BFD, rebin to a multiple of the global batch, rank placement."""
    layout = Layout(WORLD_SIZE, MICRO_BATCH, GRAD_ACCUM)
    packs, placement, tokens, _ = plan_packs(lengths, SEQ_LEN, layout, "rebin", 1, 0, ATTN_WEIGHT)
    return packs, tokens, placement


def check_packs(pack_of_doc: np.ndarray, lengths: np.ndarray) -> int:
    """Every pack fits in seq_len; returns the pack count."""
    loads = np.bincount(pack_of_doc, weights=lengths)
    assert loads.max() <= SEQ_LEN, f"a pack holds {loads.max()} > {SEQ_LEN} tokens"
    return len(loads)


def check_full(packs, tokens: np.ndarray, placement, lengths: np.ndarray) -> None:
    """Rebin kept every document exactly once, fits seq_len, and the placement is even across ranks."""
    docs = np.sort(packs.docs)
    assert np.array_equal(docs, np.arange(len(lengths))), "rebin lost or duplicated documents"
    assert tokens.max() <= SEQ_LEN, f"a rebinned pack holds {tokens.max()} > {SEQ_LEN} tokens"
    assert len(packs) % (WORLD_SIZE * MICRO_BATCH * GRAD_ACCUM) == 0
    per_rank = np.bincount(placement.rank, minlength=WORLD_SIZE)
    assert per_rank.min() == per_rank.max(), f"uneven packs per rank: {per_rank}"


def cross_check(lengths: np.ndarray) -> tuple[int, int]:
    """BFD's pack count depends only on the lengths, so ours must equal TRL's run as one single batch."""
    sample = lengths[:CHECK_DOCS]
    ours = check_packs(ours_bfd(sample), sample)
    theirs, _ = trl_stats(trl_pack(build_dataset(sample), {"batch_size": len(sample)}))
    assert ours == theirs, f"pack counts differ on {len(sample)} docs: ours {ours}, TRL one-batch {theirs}"
    return ours, theirs


def warm_up(docs: int, with_trl: bool) -> None:
    """One tiny run of each side, so lazy imports and first-call setup are timed on neither."""
    lengths = lognormal_lengths(docs, seed=1)
    if with_trl:
        trl_pack(build_dataset(lengths))
    ours_full(lengths)


def run(name: str, lengths: np.ndarray, repeat: int, with_trl: bool) -> dict:
    """Both sides on `lengths`; without TRL (smoke only) ours alone, and the TRL figures are None."""
    total = int(lengths.sum())
    t_build = t_trl = trl_rows = None
    if with_trl:
        dataset, t_build = timed(build_dataset, lengths)
        packed, t_trl = timed(trl_pack, dataset, repeat=repeat)
        trl_rows, trl_tokens = trl_stats(packed)
        assert trl_tokens == total, f"TRL kept {trl_tokens} of {total} tokens"
        del dataset, packed

    pack_of_doc, t_bfd = timed(ours_bfd, lengths, repeat=repeat)
    n_bfd = check_packs(pack_of_doc, lengths)
    (packs, tokens, placement), t_full = timed(ours_full, lengths, repeat=repeat)
    check_full(packs, tokens, placement, lengths)
    check = cross_check(lengths) if with_trl else None

    eff = lambda n_packs: None if n_packs is None else total / (n_packs * SEQ_LEN)  # noqa: E731
    bound = efficiency_bound([total], SEQ_LEN, WORLD_SIZE * MICRO_BATCH * GRAD_ACCUM)
    return {
        "bound": bound,
        "name": name,
        "n": len(lengths),
        "tokens": total,
        "t_build": t_build,
        "t_trl": t_trl,
        "t_bfd": t_bfd,
        "t_full": t_full,
        "trl_rows": trl_rows,
        "bfd_packs": n_bfd,
        "rebin_packs": len(packs),
        "eff_trl": eff(trl_rows),
        "eff_bfd": eff(n_bfd),
        "eff_rebin": eff(len(packs)),
        "check": check,
    }


def report(r: dict) -> None:
    ok = lambda cond: "PASS" if cond else "FAIL"  # noqa: E731
    print(
        f"== {r['name']}: {r['n']:,} docs, {r['tokens']:,} tokens, seq_len {SEQ_LEN}, "
        f"world {WORLD_SIZE} x mbs {MICRO_BATCH} x ga {GRAD_ACCUM}"
    )
    if r["t_trl"] is None:
        print(f"  {NO_TRL}")
    else:
        print(f"  dataset build (not timed below)  {r['t_build']:8.2f} s")
        print(
            f"  TRL pack_dataset bfd             {r['t_trl']:8.2f} s  {r['trl_rows']:,} rows  "
            f"efficiency {r['eff_trl']:.5f}"
        )
    print(
        f"  ours pack_bfd                    {r['t_bfd']:8.2f} s  {r['bfd_packs']:,} packs "
        f"efficiency {r['eff_bfd']:.5f}"
    )
    print(
        f"  ours bfd+rebin+assign            {r['t_full']:8.2f} s  {r['rebin_packs']:,} packs "
        f"efficiency {r['eff_rebin']:.5f} (the remainder bound {r['bound']:.5f})"
    )
    if r["t_trl"] is not None:
        sp_bfd, sp_full = r["t_trl"] / r["t_bfd"], r["t_trl"] / r["t_full"]
        print(
            f"  speedup TRL/ours (BFD)   {sp_bfd:8.1f}x  target >= {TARGET_SPEEDUP:.0f}x  "
            f"{ok(sp_bfd >= TARGET_SPEEDUP)}"
        )
        print(
            f"  speedup TRL/ours (full)  {sp_full:8.1f}x  target >= {TARGET_SPEEDUP:.0f}x  "
            f"{ok(sp_full >= TARGET_SPEEDUP)}"
        )
    if r["name"] == "lognormal":  # no plan of these tokens beats the remainder bound (a small corpus, a wide world)
        target = min(TARGET_EFFICIENCY, r["bound"])
        print(
            f"  efficiency (rebin) {r['eff_rebin']:.5f}  target >= {target:.5f} (min of {TARGET_EFFICIENCY} and the "
            f"bound)  {ok(r['eff_rebin'] >= target - 1e-12)}"
        )
    if r["check"] is not None:
        ours, theirs = r["check"]
        print(f"  check: pack count on first {CHECK_DOCS:,} docs, ours {ours:,} == TRL one-batch {theirs:,}")
    what = f"{r['name']} {r['n']:,} docs, full plan (BFD + rebin + assign)"
    if r["t_trl"] is None:
        figure("pack", what, f"{r['t_full']:.3f} s, efficiency {r['eff_rebin']:.5f} (bound {r['bound']:.5f})", NO_TRL)
    else:
        figure(
            "pack",
            what,
            f"{r['t_full']:.3f} s, {r['t_trl'] / r['t_full']:.1f}x TRL (BFD alone {r['t_trl'] / r['t_bfd']:.1f}x), "
            f"efficiency {r['eff_rebin']:.5f} (bound {r['bound']:.5f})",
            f"TRL pack_dataset bfd {r['t_trl']:.3f} s, efficiency {r['eff_trl']:.5f}",
        )


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0], smoke=f"{SMOKE_DOCS:,} documents, TRL if installed")
    parser.add_argument("--n", type=positive_int, default=1_000_000, help="documents per distribution")
    parser.add_argument("--quick", action="store_true", help="a short run: 20,000 documents")
    parser.add_argument("--repeat", type=positive_int, default=1, help="timed runs per side; the fastest counts")
    args = parser.parse_args()
    n = SMOKE_DOCS if args.smoke else 20_000 if args.quick else args.n
    with_trl = trl_available()
    if not with_trl and not args.smoke:
        fail(
            "bench/pack.py", "the baseline needs TRL, the bench extra: pip install -c constraints/cpu.txt -e '.[bench]'"
        )

    datasets.disable_progress_bars()
    warm_up(SMOKE_WARM_DOCS if args.smoke else 2000, with_trl)
    for name, make in (("lognormal", lognormal_lengths), ("pareto", pareto_lengths)):
        report(run(name, make(n, seed=0), args.repeat, with_trl))


if __name__ == "__main__":
    main()

"""Array helpers the triage rules share: per-GPU bounds, runs of equal values, concatenated ranges.

Windows are held GPU-major (all of GPU 0's known windows in time order, then GPU 1's...), so a GPU's
windows are one slice and a run never crosses GPUs.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Generator

import numpy as np
import pyarrow as pa


@contextlib.contextmanager
def small_pages() -> Generator[None, None, None]:
    """Within: neither numpy nor Arrow asks the kernel for transparent huge pages for its big arrays. numpy
    madvises every array of 4 MB or more; where THP defrag is `madvise` (these VMs) the first touch of such an
    array may compact memory in the kernel, and triage + report allocate hundreds of them: bench/report.py's day
    spent ~1.0 s of system time in page faults with them, ~0.46 s without. Arrow's default pool (mimalloc) does
    the same for the buffers a Parquet trace decodes into and hands freed ones back, so every row group zeroed
    fresh 2 MB pages: a quarter of triage's reading time; within, Arrow allocates from the system allocator
    (Arrow's buffers remember their pool, so one made before or after is freed where it came from). Nothing
    changes but where the pages come from."""
    with _plain_arrow_pool(), _numpy_small_pages():
        yield


@contextlib.contextmanager
def _plain_arrow_pool() -> Generator[None, None, None]:
    before = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(before)


@contextlib.contextmanager
def _numpy_small_pages() -> Generator[None, None, None]:
    core = None
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        with contextlib.suppress(ImportError):
            core = importlib.import_module(name)
            break
    setter = getattr(core, "_set_madvise_hugepage", None)
    if setter is None:  # a numpy without the switch: as it is
        yield
        return
    before = setter(False)
    try:
        yield
    finally:
        setter(before)


def _bounds(gpu: np.ndarray, ngpu: int) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) positions of each GPU's windows in a GPU-sorted array."""
    ids = np.arange(ngpu)
    return np.searchsorted(gpu, ids, "left"), np.searchsorted(gpu, ids, "right")


def gpu_runs(mask_or_cls: np.ndarray, gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of the runs of equal values on each GPU."""
    n = len(gpu)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.ones(n, dtype=bool)
    change[1:] = (mask_or_cls[1:] != mask_or_cls[:-1]) | (gpu[1:] != gpu[:-1])
    starts = np.flatnonzero(change)
    return starts, np.append(starts[1:], n)


def true_runs(mask: np.ndarray, gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of the runs of True on each GPU: gpu_runs' runs of True, from the True positions alone
    (cheaper when they are few)."""
    at = np.flatnonzero(mask)
    if len(at) == 0:
        return at, at
    first = np.empty(len(at), dtype=bool)
    first[0] = True
    g = gpu[at]
    first[1:] = (at[1:] != at[:-1] + 1) | (g[1:] != g[:-1])
    last = np.append(first[1:], True)
    return at[first], at[last] + 1


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], ends[i])."""
    lens = ends - starts
    if lens.sum() == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(lens.sum()) + offsets


def cumsum0(x: np.ndarray) -> np.ndarray:
    """Cumulative sum with a leading 0: the sum over [a, b) is c[b] - c[a]."""
    out = np.empty(len(x) + 1)
    out[0] = 0.0
    np.cumsum(x, dtype=np.float64, out=out[1:])
    return out


def reduce_into(ufunc: np.ufunc, out: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """`ufunc.at(out, index, values)`: by runs of one index with `ufunc.reduceat` when `index` never decreases (a
    time series binned in order, a table grouped in write order), several times faster than `ufunc.at`."""
    if len(index) > 1 and not (index[1:] >= index[:-1]).all():
        ufunc.at(out, index, values)
        return
    if not len(index):
        return
    starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
    at = index[starts]
    out[at] = ufunc(out[at], ufunc.reduceat(values, starts))

"""Arrow string columns as integer codes, without a Python string per row.

Traces and phase tables hold millions of rows over a handful of hosts and
phases; grouping them goes through each chunk's dictionary (small) and one
integer gather per row.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def column_codes(column: pa.Array | pa.ChunkedArray) -> tuple[list, np.ndarray]:
    """(values, code per row) of a string or dictionary column: codes index `values`, the distinct values in
    order of first appearance, None standing for the null rows."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    values: list = []
    seen: dict = {}
    out = np.empty(len(column), np.int64)
    at = 0
    for chunk in chunks:
        if not pa.types.is_dictionary(chunk.type):
            chunk = pc.dictionary_encode(chunk)
        entries = chunk.dictionary.to_pylist()
        indices = chunk.indices
        if indices.null_count:
            entries.append(None)
            indices = pc.fill_null(indices, len(entries) - 1)
        lut = np.array([seen.setdefault(v, len(seen)) for v in entries], np.int64)
        values += [v for v in entries if seen[v] >= len(values)]
        n = len(chunk)
        if n:  # mode="clip": the indices are the dictionary's own; "raise" would copy through a buffer
            np.take(lut, indices.to_numpy(zero_copy_only=False), out=out[at : at + n], mode="clip")
        at += n
    return values, out

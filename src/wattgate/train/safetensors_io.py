"""Row slices read from, and whole tensors streamed into, safetensors files, with plain file I/O.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape and byte
range of each tensor) and the raw row-major data. A block of rows of one tensor is therefore
one contiguous byte range: a rank reads exactly its rows with one positioned read into a
fresh buffer. Unlike a memory map, that adds nothing to the process's resident set beyond the
buffer itself (the pages stay in the shared page cache), so a rank's measured peak is its shard
plus the slice in flight.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from wattgate.errors import InputError

TORCH_DTYPE = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_CODE = {v: k for k, v in TORCH_DTYPE.items()}
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    end: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype, shape and absolute byte range, from the file's header only."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise InputError(f"{path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise InputError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    tensors = {name: _entry(path, name, meta, base) for name, meta in header.items() if name != "__metadata__"}
    _check_layout(path, tensors, base)
    return tensors


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(path: Path, name: str, meta, base: int) -> TensorInfo:
    """One header entry, checked against itself: its byte range holds exactly shape x dtype."""
    if not isinstance(meta, dict):
        raise InputError(f"{path}: corrupt safetensors header (tensor '{name}' is not an object)")
    dtype = TORCH_DTYPE.get(meta.get("dtype", ""))  # "": no dtype code
    if dtype is None:
        raise InputError(
            f"{path}: tensor '{name}' has dtype {meta.get('dtype')}, which wattgate cannot load "
            "(quantized checkpoints need dequantizing first)"
        )
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not isinstance(shape, list) or not all(map(_whole, shape)):
        raise InputError(f"{path}: corrupt safetensors header (tensor '{name}' shape {shape!r})")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_whole, offsets)) or offsets[1] < offsets[0]:
        raise InputError(f"{path}: corrupt safetensors header (tensor '{name}' data_offsets {offsets!r})")
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != size:
        raise InputError(
            f"{path}: tensor '{name}' claims {meta['dtype']} {shape} ({size} bytes) but its data_offsets hold "
            f"{offsets[1] - offsets[0]} bytes: the header does not match the data; re-export or re-copy the model"
        )
    return TensorInfo(dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _check_layout(path: Path, tensors: dict[str, TensorInfo], base: int) -> None:
    """The byte ranges tile the data exactly, in order, to the end of the file (the safetensors library's own
    rule): an overlap would read another tensor's bytes, a gap or a short file bytes no tensor owns."""
    at = base
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if info.start != at:
            raise InputError(
                f"{path}: tensor '{name}' starts at data byte {info.start - base}, expected {at - base} "
                "(tensors overlap or leave a gap): the header does not match the data; re-copy the model"
            )
        at = info.end
    size = os.path.getsize(path)
    if size != at:
        raise InputError(
            f"{path}: the header describes {at} bytes, the file has {size}: "
            f"{'truncated' if size < at else 'trailing bytes'}; re-copy the model"
        )


def read_rows(path: Path, info: TensorInfo, offset: int, rows: int) -> torch.Tensor:
    """Rows [offset, offset + rows) of the tensor (all of a 0-d tensor), in the file's dtype."""
    if not info.shape:
        start, nbytes, shape = info.start, info.end - info.start, ()
    else:
        start, nbytes, shape = info.start + offset * info.row_bytes, rows * info.row_bytes, (rows, *info.shape[1:])
    out = torch.empty(nbytes, dtype=torch.uint8)
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            got = f.readinto(out.numpy().data)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    if got != nbytes:
        raise InputError(f"{path}: truncated (a tensor's data ends past the end of the file); re-copy the model")
    return out.view(info.dtype).reshape(shape)


class SafetensorsStream:
    """A safetensors file written tensor by tensor: the header is known up front from names, shapes and
    dtypes, so the writer never holds more than the tensor it is writing. Published by rename on close."""

    def __init__(self, path: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp")
        self.dtypes = iter([dtype for _, _, dtype in tensors])  # of each tensor to come, in order
        header: dict = {"__metadata__": {"format": "pt"}}
        start = 0
        for name, shape, dtype in tensors:
            end = start + math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_CODE[dtype], "shape": list(shape), "data_offsets": [start, end]}
            start = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.file = open(self.tmp, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu", next(self.dtypes)).contiguous().view(-1).view(torch.uint8)
        self.file.write(data.numpy().data)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

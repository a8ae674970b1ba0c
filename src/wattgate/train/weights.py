"""Each rank's local shards: allocated after fully_shard, filled from safetensors row slices or a seeded init,
and exported back to a sharded Hugging Face folder without gathering the model on one rank.

FSDP2 shards every parameter on dim 0, so a rank's local shard is a contiguous block of rows
[offset, offset + rows) of the full tensor. Loading reads exactly that block from the
checkpoint with one positioned read (safetensors_io), one parameter at a time: a rank's host
peak is its shard plus one parameter slice, never the model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.config import model_config
from wattgate.errors import InputError
from wattgate.records.run_config import ModelConfig
from wattgate.train.checkpoint_layout import (
    LAYOUT_ATTR,
    ExportEntry,
    Source,
    checkpoint_layout,
    export_layout,
    float32_kept,
)
from wattgate.train.safetensors_io import SafetensorsStream, TensorInfo, read_header

WRAPPER_PREFIX = "_checkpoint_wrapped_module."
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
INIT_BLOCK_ELEMENTS = 1 << 20  # random init is drawn in row blocks of about this many values
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_name(name: str) -> str:
    """The checkpoint key of a parameter (activation checkpointing wraps layers under another name)."""
    return name.replace(WRAPPER_PREFIX, "")


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """(first row, row count) of this rank's shard along dim 0; the whole tensor when not sharded."""
    from torch.distributed.tensor import DTensor

    if param.ndim == 0:
        return 0, 1
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(o != 0 for o in offset[1:]) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise NotImplementedError(f"only dim-0 sharding is supported, got placements {param.placements}")
    return offset[0], shape[0]


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param.data


# ---------------------------------------------------------------- materialize: allocate and fill


def materialize(
    model, device: torch.device, model_cfg: ModelConfig | dict, seed: int, fill: bool = True, full_depth=None
) -> str:
    """Allocate the local shards on `device` and fill them; returns where the values came from.

    fill=False leaves parameters uninitialized (a checkpoint is about to overwrite every one). `full_depth`: the
    model at model.path's own depth on meta when `model` is a reduced-depth proxy of it (the collective proof).
    """
    model.to_empty(device=device)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty gives a module not under fully_shard separate head and embedding
    restore_buffers(model, device)
    # where each tensor is in model.path, from the headers: the load reads it, and the export writes final/ in that
    # layout also when a checkpoint (resume) fills the parameters instead
    model_cfg = model_config(model_cfg)
    sources = checkpoint_sources(model, Path(model_cfg.path), full_depth) if model_cfg.path else None
    object.__setattr__(model, LAYOUT_ATTR, sources)
    with torch.no_grad():
        if not fill:
            return "checkpoint"
        if sources is not None:
            load_local_shards(sources)
            return f"{model_cfg.path} (local slices)"
        init_local_shards(model, seed)
        return f"random init (seed {seed}, independent of world size)"


def restore_buffers(model, device: torch.device) -> None:
    """Recompute the buffers (rotary inv_freq, Gemma's embed_scale) that to_empty left uninitialized.

    Each buffer-owning module gets the model's own init (transformers' `_init_weights`, what its
    from_pretrained runs for non-persistent buffers after its own meta build) on a stand-in that shares
    the module's attributes but holds fresh buffers and meta parameters: no constructor signature is
    assumed (Gemma3TextScaledWordEmbedding takes embed_scale, not a config) and no real weight is touched.
    A buffer that init leaves unwritten falls back to rebuilding the module from the model config.
    """
    for name, module in model.named_modules():
        own = [b for b, buf in module._buffers.items() if buf is not None]
        if not own:
            continue
        values = _initialized_buffers(model, name, module, device)
        missing = [b for b in own if b not in values]
        if missing:
            values.update(_constructed_buffers(model, name, module, missing, device))
        for b in own:
            module._buffers[b] = values[b]


def _owning_init(model, name: str):
    """The `_init_weights` of the innermost transformers PreTrainedModel holding module `name` (a composite
    model's submodels each have their own, as transformers' initialize_weights dispatches them)."""
    from transformers import PreTrainedModel

    parts = name.split(".") if name else []
    for k in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:k]))
        if isinstance(owner, PreTrainedModel):
            return owner._init_weights
    return model._init_weights


def _stand_in(module, buffers: dict, params: dict) -> Any:
    """A shallow copy of `module` (its config, rope type, scalars) with the given buffers and parameters and
    no children: the model's init writes into it, never into the real module's tensors."""
    from torch.distributed.fsdp import FSDPModule

    # the module's own class: copy.copy of a sharded module would call FSDP2's __new__, which runs the class's
    # constructor with no arguments (a router's needs its config)
    own_class: type[torch.nn.Module] = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    twin = own_class.__new__(own_class)
    twin.__dict__.update(module.__dict__)
    object.__setattr__(twin, "_buffers", dict(buffers))
    object.__setattr__(twin, "_parameters", dict(params))
    object.__setattr__(twin, "_modules", {})
    return twin


def _meta_params(module) -> dict:
    return {
        k: None if p is None else torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), False)
        for k, p in module._parameters.items()
    }


def _initialized_buffers(model, name: str, module, device: torch.device) -> dict[str, torch.Tensor]:
    """The buffers the model's own init computes for `module`. It runs twice, over zeros and over ones: a
    buffer it does not write (or writes only in part) differs between the two and is left out."""
    init = _owning_init(model, name)
    results = []
    for fill in (0, 1):
        buffers = {
            k: torch.full(b.shape, fill, dtype=b.dtype, device=device)
            for k, b in module._buffers.items()
            if b is not None
        }
        twin = _stand_in(module, buffers, _meta_params(module))
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                init(twin)
        except Exception:  # noqa: BLE001 - any init failure: the constructor path below decides
            return {}
        results.append(twin._buffers)
    zeros, ones = results
    return {k: v for k, v in zeros.items() if k in ones and torch.equal(v, ones[k])}


def _constructed_buffers(model, name: str, module, wanted: list[str], device: torch.device) -> dict:
    """`wanted` buffers from a fresh module built from the model config (rotary embeddings of older models)."""
    try:
        with torch.device(device):
            fresh = type(module)(config=model.config)
    except TypeError as exc:
        raise InputError(
            f"{type(module).__name__} ({name}): the model's init does not set its buffers {wanted} and it "
            f"cannot be rebuilt from the model config ({exc}); use a model transformers initializes on meta"
        ) from None
    return {b: fresh._buffers[b].to(device) for b in wanted}


def checkpoint_tensors(path: Path) -> dict[str, tuple[Path, TensorInfo]]:
    """Tensor name -> (safetensors file, its header entry) of a Hugging Face model folder, sharded or not."""
    index = path / SAFETENSORS_INDEX
    if index.exists():
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise InputError(f"{index}: unreadable safetensors index ({exc}); re-save the model") from None
    elif (path / SINGLE_FILE).exists():
        files = [path / SINGLE_FILE]
    else:
        raise InputError(
            f"{path}: no {SAFETENSORS_INDEX} or {SINGLE_FILE}; model.path needs safetensors weights "
            "(convert .bin checkpoints with save_pretrained(safe_serialization=True))"
        )
    return {name: (f, info) for f in files for name, info in read_header(f).items()}


def checkpoint_sources(model, path: Path, full_depth=None) -> list[Source]:
    """Where every parameter (tied ones once) and persistent buffer of `model` is in the checkpoint
    (train/checkpoint_layout.py: as stored, renamed, or stacked from one tensor per expert), checked from the
    files' headers alone: every name present, no checkpoint tensor unused, each shape equal, and a floating-point
    tensor for a floating-point one (the load casts between float dtypes, never from integers: those are
    quantized weights). The same checks whether `model` is sharded (training) or on the meta device (the gate's
    `weights` check, before anything is submitted).

    `full_depth`: `model` is a proxy holding the first layers of that model (the collective proof builds one period
    of the layer pattern): the folder is checked whole against `full_depth`, then `model` reads what its own
    tensors read there, and the tensors of the layers it does not hold are left to `full_depth`'s check."""
    tensors = checkpoint_tensors(path)
    if full_depth is not None:
        held = {hf_name(n) for n, _ in _local_state(model)}
        beyond = {
            p.key for s in _checked_sources(full_depth, path, tensors) if s.name not in held for p in s.all_pieces()
        }
        tensors = {k: v for k, v in tensors.items() if k not in beyond}
    return _checked_sources(model, path, tensors)


def _checked_sources(model, path: Path, tensors: dict[str, tuple[Path, TensorInfo]]) -> list[Source]:
    state = [(hf_name(n), t) for n, t in _local_state(model)]
    sources, unread = checkpoint_layout(model, path, tensors, state)
    _check_all_used(model, path, unused_tensors(model, unread))
    found = {s.name: s for s in sources}
    for name, tensor in state:
        source = found.get(name)
        if source is None:
            raise InputError(
                f"{path}: no tensor '{name}' in the checkpoint; model.path does not "
                f"hold weights for this {model.config.architectures[0]}"
            )
        piece = source.pieces[0] if source.pieces else None
        if piece is not None and piece.info.shape != tuple(tensor.shape):
            raise InputError(
                f"{piece.file}: '{piece.key}' has shape {piece.info.shape}, the model expects {tuple(tensor.shape)}; "
                "model.path and its config.json disagree"
            )
        for p in source.all_pieces():
            if p.info.dtype.is_floating_point != tensor.dtype.is_floating_point:
                raise InputError(
                    f"{p.file}: '{p.key}' is {str(p.info.dtype).removeprefix('torch.')}, the model's tensor is "
                    f"{str(tensor.dtype).removeprefix('torch.')}; model.path holds quantized or other weights "
                    "(dequantize them, or point model.path at the model's own folder)"
                )
    return sources


def load_local_shards(sources: list[Source]) -> None:
    """Fill every parameter's local rows from the checkpoint, reading only those rows (whole experts for a stacked
    one, one expert at a time), cast on copy."""
    for source in sources:
        offset, rows = local_rows(source.tensor)
        if rows:
            local_tensor(source.tensor).copy_(source.read(offset, rows))


def unused_tensors(model, unread: list[str]) -> list[str]:
    """The checkpoint tensors no parameter or persistent buffer of the model reads (tied aliases count as read),
    less the names transformers itself ignores on load, such as old checkpoints' rotary inv_freq."""
    tied = {hf_name(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    base = getattr(model, "base_model_prefix", "")
    return sorted(
        k
        for k in unread
        if k not in tied
        and f"{base}.{k}" not in tied
        and not k.endswith("rotary_emb.inv_freq")
        and not any(p.search(k) for p in ignore)
    )


def _check_all_used(model, path: Path, unused: list[str]) -> None:
    """A checkpoint with weights the model does not use means config.json describes another model (fewer
    layers, say): training it would silently drop those weights."""
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        layers = getattr(model.config, "num_hidden_layers", None)
        raise InputError(
            f"{path}: {len(unused)} checkpoint tensor(s) the model does not use ({shown}): config.json "
            f"({f'num_hidden_layers {layers}, ' if layers is not None else ''}"
            f"{model.config.architectures[0] if model.config.architectures else type(model).__name__}) disagrees "
            "with its weights; fix config.json or point model.path at the matching folder"
        )


def _local_state(model):
    """(name, tensor) for every parameter (tied ones once) and persistent buffer."""
    yield from model.named_parameters()
    for mod_name, module in model.named_modules():
        for b, buf in module._buffers.items():
            if buf is not None and b not in module._non_persistent_buffers_set:
                yield (f"{mod_name}.{b}" if mod_name else b), buf


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_normal_rows(name: str, shape: tuple[int, ...], offset: int, rows: int, seed: int) -> torch.Tensor:
    """Rows [offset, offset + rows) of a standard-normal tensor of `shape` that does not depend on sharding.

    The full tensor is cut into fixed row blocks, each drawn from a generator seeded by
    (seed, name, block): any rank can draw any rows without drawing the rows before them.
    """
    row = math.prod(shape[1:])
    per_block = max(1, INIT_BLOCK_ELEMENTS // max(row, 1))
    out = torch.empty((rows, *shape[1:]))
    for b in range(offset // per_block, (offset + rows - 1) // per_block + 1):
        start, stop = b * per_block, min(shape[0], (b + 1) * per_block)
        gen = torch.Generator().manual_seed(_block_seed(seed, name, b))
        block = torch.randn((stop - start, *shape[1:]), generator=gen)
        lo, hi = max(offset, start), min(offset + rows, stop)
        out[lo - offset : hi - offset] = block[lo - start : hi - start]
    return out


def init_local_shards(model, seed: int) -> None:
    """transformers' default init for decoder LMs (normal(0, initializer_range) for embeddings and linear
    weights, zero biases), drawn so that every world size gets the same model; any other module's parameters
    (norms: ones, or Gemma's zeros under its 1 + weight) take the model's own init (own_init_values)."""
    std = float(getattr(model.config, "initializer_range", 0.02))
    own: tuple[str, dict] = ("", {})  # the last module's own-init values (a module's parameters come together)
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        offset, rows = local_rows(param)
        if rows == 0:
            continue
        local = local_tensor(param)
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            if leaf == "bias":
                local.zero_()
                continue
            local.copy_(seeded_normal_rows(hf_name(name), tuple(param.shape), offset, rows, seed).mul_(std))
            pad = getattr(module, "padding_idx", None)
            if pad is not None and offset <= pad < offset + rows:
                local[pad - offset].zero_()
            continue
        if own[0] != module_name:
            own = (module_name, own_init_values(model, module_name, module, seed))
        local.copy_(own[1][leaf][offset : offset + rows])


def own_init_values(model, name: str, module, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of `module` (whole, on the CPU) as the model's own `_init_weights` sets it, with the
    random generator seeded by (seed, module name): the same on every rank and world size. A parameter the
    init leaves unset (NaN) has no rule to follow."""
    # an absent parameter stays None (a Conv1d without bias: its init reads `module.bias is not None`)
    params = {
        k: None if p is None else torch.nn.Parameter(torch.full(p.shape, math.nan, dtype=p.dtype), False)
        for k, p in module._parameters.items()
    }
    # scratch buffers the init may write (DeepSeek-V3's router zeroes its e_score_correction_bias), then dropped
    scratch = {k: torch.zeros(b.shape, dtype=b.dtype) for k, b in module._buffers.items() if b is not None}
    twin = _stand_in(module, scratch, params)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(_block_seed(seed, hf_name(name), 0))
        _owning_init(model, name)(twin)
    values = {k: twin._parameters[k].detach() for k, p in params.items() if p is not None}
    unset = [f"{name}.{k}" for k, v in values.items() if torch.isnan(v).any()]
    if unset:
        raise InputError(
            f"model.config: no random init rule for {hf_name(unset[0])} ({type(module).__name__}); "
            "use model.path with pretrained weights"
        )
    return values


# ---------------------------------------------------------------- export: sharded safetensors


def export_entries(model, dtype: torch.dtype) -> list[ExportEntry]:
    """final/'s tensors: in the layout of the checkpoint the model was loaded from (its names and shapes, experts
    one tensor each where it had them so), else (random init) as the model holds them; each in `dtype`, or float32
    where transformers keeps it so (a model saved by transformers gets back its own dtypes)."""
    kept = float32_kept(model, dtype)

    def dtype_of(name: str) -> torch.dtype:
        return torch.float32 if kept(name) else dtype

    sources = model.__dict__.get(LAYOUT_ATTR)
    if sources is not None:
        return export_layout(sources, dtype_of)
    return [ExportEntry(hf_name(n), t, tuple(t.shape), dtype_of(hf_name(n))) for n, t in _local_state(model)]


def plan_export_files(entries: list[ExportEntry], max_shard_bytes: int) -> list[list[ExportEntry]]:
    """Consecutive tensors grouped into files of at most max_shard_bytes (a bigger tensor gets a file alone)."""
    files: list[list[ExportEntry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def export_file_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def gather_full(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor on every rank, cast before the all-gather (half the traffic for bf16)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return cast(DTensor, tensor.detach().to(dtype)).full_tensor()  # a DTensor's detach and to give DTensors
    return tensor.detach().to(dtype)


class ExportFiles(Protocol):
    """Where final/'s bytes go; the collectives around them are `export_hf_folder`'s, the same whatever the
    files. Methods marked rank 0 run there only."""

    def begin(self, tmp: Path) -> None:
        """Rank 0: a fresh, empty `final.tmp/`."""

    def stream(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> TensorStream:
        """A safetensors file of `entries` (name, shape, dtype), written tensor by tensor in that order."""

    def write_json(self, path: Path, record: dict) -> None:
        """Rank 0: a JSON file (the safetensors index)."""

    def write_config(self, path: Path, config) -> None:
        """Rank 0: the model's config.json."""

    def copy(self, src: Path, dest: Path) -> None:
        """Rank 0: a file carried beside the weights (the tokenizer's)."""

    def publish(self, tmp: Path, final: Path) -> None:
        """Rank 0: `tmp` renamed onto `final` (an earlier final/ replaced)."""


class TensorStream(Protocol):
    def write(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class ExportFolder:
    """ExportFiles in the run folder: final/ as export_hf_folder's docstring describes it."""

    def begin(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftovers (wattgate wrote them)
        tmp.mkdir(parents=True)

    def stream(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> TensorStream:
        return SafetensorsStream(path, entries)

    def write_json(self, path: Path, record: dict) -> None:
        write_json_atomic(path, record)

    def write_config(self, path: Path, config) -> None:
        config.to_json_file(str(path))

    def copy(self, src: Path, dest: Path) -> None:
        write_bytes_atomic(dest, src.read_bytes())

    def publish(self, tmp: Path, final: Path) -> None:
        if final.exists():  # a fresh name for the old final/: a user's own final.old/ is never touched
            old = Path(tempfile.mkdtemp(prefix=".final.", suffix=".old", dir=final.parent))
            os.replace(final, old / "final")
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)


EXPORT_FOLDER = ExportFolder()


def write_sharded_safetensors(
    model, folder: Path, dtype: torch.dtype, max_shard_bytes: int, files_to: ExportFiles = EXPORT_FOLDER
) -> tuple[dict[str, str], int]:
    """Every rank takes part in each tensor's all-gather; file k is written by rank k % world.

    Returns the index's weight_map (tensor -> file) and total_size (bytes). No rank holds more than one full tensor.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    every = export_entries(model, dtype)
    files = plan_export_files(every, max_shard_bytes)
    names = export_file_names(len(files))
    for k, (name, entries) in enumerate(zip(names, files)):
        layout = [(e.name, e.shape, e.dtype) for e in entries]
        stream = files_to.stream(folder / name, layout) if k % world == rank else None
        full, of = None, None  # the last model tensor gathered: a stacked one's entries follow one another
        for e in entries:
            if of is not e.tensor:
                full, of = gather_full(e.tensor, e.dtype), e.tensor
            if stream is not None:
                assert full is not None  # gathered above: e.tensor's, at the latest for this entry
                stream.write(e.take(full))
        del full, of
        if stream is not None:
            stream.close()
    weight_map = {e.name: name for name, entries in zip(names, files) for e in entries}
    return weight_map, sum(e.nbytes for e in every)


def export_config(model, dtype: torch.dtype):
    cfg = copy.deepcopy(model.config)
    cfg.dtype = dtype  # written as "dtype" (transformers 5) and read back by from_pretrained
    cfg.use_cache = True  # inference default; training turned it off
    return cfg


def export_hf_folder(
    model, out: Path, dtype: torch.dtype, max_shard_bytes: int, extra_files, files: ExportFiles = EXPORT_FOLDER
) -> Path:
    """`out/final/`: sharded safetensors + index + config + `extra_files` (tokenizer), published atomically.

    Ranks write into `final.tmp/`; rank 0 renames it onto `final/` only when every file is
    complete, so a killed export leaves the previous final/ (or none), never a partial one.
    `extra_files` may be a callable returning the list: every rank calls it after the weights are written
    (train/export_files.py verifies the tokenizer there, the same answer on every rank, so none waits alone).
    The bytes go through `files` (ExportFolder; the collective proof passes its own, which writes nothing).
    """
    rank = dist.get_rank()
    tmp, final = out / "final.tmp", out / "final"
    if rank == 0:
        files.begin(tmp)
    dist.barrier()
    weight_map, total = write_sharded_safetensors(model, tmp, dtype, max_shard_bytes, files)
    dist.barrier()
    if rank == 0:
        if len(set(weight_map.values())) > 1:
            files.write_json(
                tmp / SAFETENSORS_INDEX,
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            )
        files.write_config(tmp / "config.json", export_config(model, dtype))
    extra_files = extra_files() if callable(extra_files) else extra_files
    if rank == 0:
        for src in extra_files:
            files.copy(src, tmp / src.name)
        files.publish(tmp, final)
    dist.barrier()  # no rank leaves before the export is published
    return final

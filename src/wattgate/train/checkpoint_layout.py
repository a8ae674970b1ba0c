"""Where each of the model's tensors is in a model folder's safetensors, and back: transformers' own conversion
mapping, applied per expert.

transformers 5 holds a Mixture-of-Experts layer's experts as one 3-D parameter per projection
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), while the checkpoints it saves for
Qwen3-MoE and Mixtral (and theirs on the Hub) hold one 2-D tensor per expert and projection
(`mlp.experts.3.gate_proj.weight` [I, H]; Mixtral's `block_sparse_moe.experts.3.w1.weight`). Its from_pretrained
maps one onto the other with the model's conversion mapping (`conversion_mapping.get_model_conversion_mapping`):
renamings (Mixtral's `.block_sparse_moe.` -> `.mlp.`), then at most one converter per key, whose operations stack
the experts' tensors in expert order (`MergeModulelist(dim=0)`) and concatenate the stacked gate and up
(`Concatenate(dim=1)`); save_pretrained reverts it. GPT-OSS is saved as it is held (3-D, with biases).

wattgate takes the names from that mapping (`rename_source_key`, as from_pretrained does) and applies the two
operations itself, expert by expert: FSDP2 shards dim 0, which for a stacked tensor is the expert, so a rank's
rows are whole experts and it reads exactly those experts' tensors, one at a time (never the whole stack). A
converter with any other operation is refused in one line naming the model and the operation. The export writes
each tensor back under the checkpoint's own name and shape, one expert's slice of the gathered stack at a time,
so final/ has the input's layout.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from wattgate.errors import InputError
from wattgate.train.safetensors_io import TensorInfo, read_rows

LAYOUT_ATTR = "wattgate_checkpoint_layout"  # the layout materialize read, kept on the model for the export
MAPPING_ATTR = "wattgate_conversion_mapping"  # transformers' mapping, taken for the model's own class
SUPPORTED = "MergeModulelist(dim=0), then optionally Concatenate(dim=1)"


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor."""

    key: str
    file: Path
    info: TensorInfo


@dataclass(frozen=True)
class Source:
    """Where one model tensor's values are: `pieces` (one) for a tensor stored as the model holds it, under
    `pieces[0].key`; for stacked experts, `experts[e]` the pieces of expert e, concatenated along their first dim
    (gate then up), which is the model tensor's dim 1."""

    name: str  # the model's name for it (activation-checkpoint wrappers removed)
    tensor: torch.Tensor
    pieces: tuple[Piece, ...] = ()
    experts: tuple[tuple[Piece, ...], ...] = ()

    @property
    def stacked(self) -> bool:
        return bool(self.experts)

    def all_pieces(self) -> list[Piece]:
        return [p for group in self.experts for p in group] if self.experts else list(self.pieces)

    def read(self, offset: int, rows: int) -> torch.Tensor:
        """Rows [offset, offset + rows) of the model's tensor, in the checkpoint's dtype: a positioned read of
        those rows, or of whole experts (each expert's pieces read and concatenated, one expert at a time)."""
        if not self.experts:
            piece = self.pieces[0]
            return read_rows(piece.file, piece.info, offset, rows)
        parts = self.experts[offset : offset + rows]
        first = parts[0][0].info
        out = torch.empty((rows, *self.tensor.shape[1:]), dtype=first.dtype)
        for i, group in enumerate(parts):
            at = 0
            for p in group:
                n = p.info.shape[0]
                out[i, at : at + n] = read_rows(p.file, p.info, 0, n)
                at += n
        return out


def source_rows(source: Source, piece_index: int) -> tuple[int, int, int]:
    """(expert, first row, row count) in the model tensor's [expert, rows, ...] of the piece-th piece of a stacked
    source, in the order all_pieces lists them."""
    k = 0
    for e, group in enumerate(source.experts):
        at = 0
        for p in group:
            if k == piece_index:
                return e, at, p.info.shape[0]
            at += p.info.shape[0]
            k += 1
    raise IndexError(piece_index)


# ---------------------------------------------------------------- the mapping


def keep_conversion_mapping(model) -> None:
    """Keep transformers' conversion mapping for `model` on it, taken while its class is its own: transformers looks
    a mapping up by class name first (GPT-NeoX's `embed_out.` -> `lm_head.` is filed under GPTNeoXForCausalLM), and
    FSDP2 renames the root's class (FSDPGPTNeoXForCausalLM), after which that lookup misses."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    object.__setattr__(model, MAPPING_ATTR, get_model_conversion_mapping(model))


def _transforms(model):
    """(renamings, converters) of transformers' conversion mapping for `model`, as from_pretrained applies them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = model.__dict__.get(MAPPING_ATTR) or get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _expert_index(key: str, pattern: str) -> int | None:
    """The expert number the `*` of a converter's source pattern stands for in `key` (None if not a number)."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, key)
    return int(found.group(1)) if found else None


def _describe_ops(converter) -> str:
    ops = []
    for op in getattr(converter, "operations", []):
        dims = {k: v for k, v in vars(op).items() if k in ("dim", "dim0", "dim1")}
        ops.append(f"{type(op).__name__}({', '.join(f'{k}={v}' for k, v in dims.items())})")
    return ", ".join(ops) or "no operation"


def _supported(converter) -> bool:
    ops = list(getattr(converter, "operations", []))
    names = [type(op).__name__ for op in ops]
    if not names or names[0] != "MergeModulelist" or getattr(ops[0], "dim", None) != 0:
        return False
    if names == ["MergeModulelist"]:
        return len(converter.source_patterns) == 1
    return names == ["MergeModulelist", "Concatenate"] and getattr(ops[1], "dim", None) == 1


def checkpoint_layout(
    model, path: Path, tensors: dict[str, tuple[Path, TensorInfo]], state: list[tuple[str, torch.Tensor]]
) -> tuple[list[Source], list[str]]:
    """(a Source for each model tensor found in the checkpoint, in `state`'s order; the checkpoint keys no model
    tensor reads). `state` is the model's (name, tensor) list, names without wrapper prefixes. A key transformers
    converts with operations wattgate does not apply, or stacked experts that do not fill the model's tensor, is an
    InputError in one line."""
    from transformers.core_model_loading import rename_source_key

    names = {n for n, _ in state}
    renamings, converters = _transforms(model)
    base = getattr(model, "base_model_prefix", "") or None
    meta_state = dict.fromkeys(names, True)
    plain: dict[str, Piece] = {}
    stacked: dict[str, dict] = {}  # target -> {"converter", "parts": {pattern: {expert: Piece}}}
    unread: list[str] = []
    label = f"{path} ({model.config.model_type})"
    for key, (file, info) in tensors.items():
        target, pattern = rename_source_key(key, renamings, converters, base, meta_state)
        if pattern is None:
            if target in names and target not in plain:
                plain[target] = Piece(key, file, info)
            elif key in names and key not in plain:
                plain[key] = Piece(key, file, info)
            else:
                unread.append(key)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        if not _supported(converter):
            raise InputError(
                f"{label}: checkpoint tensor '{key}' needs transformers' conversion {_describe_ops(converter)} "
                f"into '{target}', which wattgate's sharded loader does not apply (it applies {SUPPORTED}); "
                "re-save the model in the layout transformers holds in memory"
            )
        expert = _expert_index(key, pattern)
        if expert is None or target not in names:
            unread.append(key)
            continue
        entry = stacked.setdefault(target, {"converter": converter, "parts": {}})
        entry["parts"].setdefault(pattern, {})[expert] = Piece(key, file, info)
    sources = []
    for name, tensor in state:
        if name in stacked:
            sources.append(_stacked_source(label, name, tensor, stacked[name]))
        elif name in plain:
            sources.append(Source(name, tensor, pieces=(plain[name],)))
    return sources, sorted(unread)


def _stacked_source(label: str, name: str, tensor: torch.Tensor, entry: dict) -> Source:
    patterns = [p for p in entry["converter"].source_patterns if p in entry["parts"]]
    missing = [p for p in entry["converter"].source_patterns if p not in entry["parts"]]
    experts = tensor.shape[0] if tensor.ndim else 0
    if missing:
        raise InputError(
            f"{label}: '{name}' is stacked from checkpoint tensors "
            f"'{' and '.join(entry['converter'].source_patterns)}' but the checkpoint has none matching "
            f"'{missing[0]}'; model.path and its config.json disagree"
        )
    groups = []
    for e in range(experts):
        group = []
        for p in patterns:
            piece = entry["parts"][p].get(e)
            if piece is None:
                raise InputError(
                    f"{label}: no checkpoint tensor '{p.replace('*', str(e))}' for expert {e} of '{name}' "
                    f"({experts} experts); model.path and its config.json disagree"
                )
            group.append(piece)
        groups.append(tuple(group))
    extra = sorted({e for parts in entry["parts"].values() for e in parts if e >= experts})
    if extra:
        key = next(iter(entry["parts"][patterns[0]].values())).key
        raise InputError(
            f"{label}: the checkpoint has expert {extra[0]} (e.g. near '{key}') but '{name}' holds {experts} "
            "experts; config.json (num_experts) disagrees with its weights"
        )
    want = tuple(tensor.shape[1:])
    for e, group in enumerate(groups):
        rows = sum(p.info.shape[0] if p.info.shape else 0 for p in group)
        trailing = {tuple(p.info.shape[1:]) for p in group}
        if rows != (want[0] if want else 0) or trailing != {want[1:]}:
            shapes = " + ".join(str(p.info.shape) for p in group)
            keys = ", ".join(p.key for p in group)
            raise InputError(
                f"{group[0].file}: expert {e} of '{name}' is {shapes} in the checkpoint ({keys}), "
                f"the model expects {want}; model.path and its config.json disagree"
            )
    return Source(name, tensor, experts=tuple(groups))


# ---------------------------------------------------------------- the export in the input's layout


def float32_kept(model, dtype: torch.dtype):
    """name -> whether transformers holds that tensor in float32 when the model is in `dtype`, as from_pretrained
    and save_pretrained do: `_keep_in_fp32_modules_strict` (DeepSeek-V3's and GLM-4.5's routers) under bf16 or
    fp16, `_keep_in_fp32_modules` under fp16 too. Patterns are matched as transformers matches them (a search,
    `*` any run of characters)."""
    patterns = set()
    if dtype in (torch.float16, torch.bfloat16):
        patterns |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        patterns |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not patterns:
        return lambda name: False
    regex = re.compile("|".join(p.replace("*", ".*") for p in sorted(patterns)))
    return lambda name: regex.search(name) is not None


@dataclass(frozen=True)
class ExportEntry:
    """One tensor of final/: its `name`, `shape` and `dtype` there; the model tensor (sharded parameter or buffer)
    it comes from, and for a stacked source the expert and the rows (first, count) of the gathered stack it is."""

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: int | None = None
    rows: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This entry's values from the model tensor gathered whole."""
        if self.expert is None:
            return full
        assert self.rows is not None  # a stacked source's entry has both (export_layout)
        start, count = self.rows
        return full[self.expert, start : start + count]


def export_layout(sources: list[Source], dtype_of) -> list[ExportEntry]:
    """final/'s tensors for what the model loaded, each under its checkpoint name and shape, in `dtype_of(model
    name)`; a stacked tensor's pieces one after another (expert by expert, gate then up), so the export gathers
    each model tensor once."""
    entries: list[ExportEntry] = []
    for s in sources:
        dtype = dtype_of(s.name)
        if not s.stacked:
            entries.append(ExportEntry(s.pieces[0].key, s.tensor, tuple(s.tensor.shape), dtype))
            continue
        for i, piece in enumerate(s.all_pieces()):
            e, start, count = source_rows(s, i)
            entries.append(ExportEntry(piece.key, s.tensor, tuple(piece.info.shape), dtype, e, (start, count)))
    return entries

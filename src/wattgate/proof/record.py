"""Recording every collective one rank issues, in order, while the trainer runs on the fake process group.

Two sources, because collectives reach the process group two ways:
- tensor collectives (FSDP2's all-gathers and reduce-scatters, the loop's all-reduces and all-gathers,
  clip_grad_norm_'s reduction, DTensor.full_tensor) are c10d / _c10d_functional operators: a TorchDispatchMode
  sees each one (CommDebugMode crashed on Qwen3 with FSDP2, and is module-level only);
- object collectives (all_gather_object, broadcast_object_list, barrier, ...) pickle through the process group
  in ways the fake group cannot answer, so they are wrapped at torch.distributed and recorded as themselves;
  what they return is every rank's object taken to be this rank's (a gather), or what rank 0 sent (a broadcast or
  scatter from rank 0, carried by wattgate.proof.relay).

The model's tensors are FakeTensors (no data), so the few places the trainer reads a value on the host
(`float(loss)`, `torch.equal`) get a made-up value: the fake process group makes up every collective's result
the same way. Nothing the trainer decides from such a value may change its collectives; the proof's premise is
that the schedule depends on the plan only (docs/architecture.md, "The collective proof").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
PRIM_DEVICE = torch.ops.prim.device.default
NOT_COLLECTIVES = frozenset({"wait_tensor", "wait"})  # completing a collective is not another one
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
)


@dataclass(frozen=True)
class Collective:
    """One collective as every rank must issue it: operator, process group, tensors (dtype and shape), and
    the rest of its arguments (reduce op, root rank, ...)."""

    op: str
    group: str  # a mesh dimension's name (dp_shard, dp_replicate) for its group, else the group's name
    tensors: tuple[str, ...]  # "float32[1024,5120]"
    args: tuple[str, ...]
    # a mesh dimension's group: this rank's ranks in it, named but not compared (every rank's differ)
    members: str = field(default="", compare=False)

    def __str__(self) -> str:
        inner = ", ".join(self.tensors + self.args)
        return f"{self.op}({inner}) on group {self.group}" + (f" ({self.members})" if self.members else "")

    def key(self) -> list:
        return [self.op, self.group, list(self.tensors), list(self.args)]


def fingerprint(collectives: list[Collective]) -> str:
    """16 hex of the sha256 of a collective sequence: equal sequences, equal fingerprints."""
    raw = json.dumps([c.key() for c in collectives], separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _tensor_text(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(str(d) for d in t.shape)}]"


def _group_name(pg) -> str:
    if isinstance(pg, torch._C.ScriptObject):  # how c10d operators receive their process group
        pg = dist.ProcessGroup.unbox(pg)
    name = getattr(pg, "group_name", None)
    return str(name) if name is not None else type(pg).__name__


REDUCE_OPS = {v.value: k.lower() for k, v in dist.ReduceOp.RedOpType.__members__.items()}  # pybind11 enum values


def _reduce_op_name(op) -> str:
    if isinstance(op, torch._C.ScriptObject):
        return REDUCE_OPS.get(int(op._get_method("op")()), "reduce op ?")
    return str(getattr(op, "op", op)).lower()


def _describe(value, kind: str, found: dict[str, list[str]]) -> None:
    """Sort one operator argument (`kind`: its schema type) into tensors, groups and the rest."""
    if isinstance(value, torch.Tensor):
        found["tensors"].append(_tensor_text(value))
    elif isinstance(value, (list, tuple)):
        for v in value:
            _describe(v, kind, found)
    elif "ReduceOp" in kind or isinstance(value, dist.ReduceOp):
        found["args"].append(_reduce_op_name(value))
    elif "ProcessGroup" in kind or isinstance(value, dist.ProcessGroup):
        found["groups"].append(_group_name(value))
    elif value is not None and not isinstance(value, bool):
        found["args"].append(str(value))


def tensor_collective(func, args: tuple, kwargs: dict) -> Collective:
    found: dict[str, list[str]] = {"tensors": [], "args": [], "groups": []}
    kinds = {a.name: str(a.type) for a in func._schema.arguments}
    for name, value in list(zip(kinds, args)) + list(kwargs.items()):
        if name in ("timeout", "asyncOp", "async_op"):
            continue  # a setting of the call, not what the ranks exchange
        if name in ("group_name", "tag") and isinstance(value, str):
            found["groups"].append(value)
            continue
        _describe(value, kinds.get(name, ""), found)
    op = f"{func.namespace}.{func._opname}"
    return Collective(op, "/".join(found["groups"]) or "-", tuple(found["tensors"]), tuple(found["args"]))


class CollectiveRecorder(TorchDispatchMode):
    """Records the c10d operators one rank issues, and answers host reads of fake values."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []
        # a 2-D mesh's process groups by name: (its dimension's name, its ranks). Group names are counters each rank
        # makes alike for every group, so rank 0's shard group and rank 2's have different names: a collective is
        # recorded on its dimension, which every rank shares, and names its ranks
        self.mesh_groups: dict[str, tuple[str, tuple[int, ...]]] = {}

    def on_group(self, collective: Collective) -> Collective:
        found = self.mesh_groups.get(collective.group)
        if found is None:
            return collective
        dim, ranks = found
        return replace(collective, group=dim, members=ranks_text(ranks))

    def __torch_dispatch__(self, func, types, args: tuple = (), kwargs: dict | None = None):
        if func is PRIM_DEVICE and isinstance(args[0], FakeTensor):
            # half of all dispatches (FSDP2 and the optimizer ask every tensor's device): FakeTensor's own
            # answer, without the second trip through the mode stack
            t = args[0]
            return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
        kwargs = kwargs or {}
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # DTensor unwraps itself and comes back with plain tensors
        if func.namespace in NAMESPACES and func._opname not in NOT_COLLECTIVES:
            self.collectives.append(self.on_group(tensor_collective(func, args, kwargs)))
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return _made_up_scalar(args[0].dtype)
        if func is torch.ops.aten.equal.default and any(isinstance(a, FakeTensor) for a in args):
            return True  # the fake group's all-reduces agree by construction
        return func(*args, **kwargs)

    def add(self, op: str, group, *args: str) -> None:
        collective = Collective(op, _group_name(group) if group is not None else "default", (), args)
        self.collectives.append(self.on_group(collective))


def ranks_text(ranks: tuple[int, ...]) -> str:
    return "ranks " + ", ".join(str(r) for r in ranks)


@contextlib.contextmanager
def fake_host_reads():
    """`tolist()` of a fake tensor answers the made-up value for every element at once, as `.item()` does for one
    (the trainer reads every rank's step figures in one call; FakeTensor's own tolist goes element by element
    through the dispatch stack: ~1 s at world 1024, each step). The fake tensor class is the proof's, not the
    trainer's: nothing the trainer runs is changed."""

    def tolist(self: FakeTensor):
        value = _made_up_scalar(self.dtype)

        def filled(shape: tuple) -> list | float | int | bool:
            return [filled(shape[1:]) for _ in range(shape[0])] if shape else value

        return filled(tuple(self.shape))

    own = FakeTensor.tolist
    FakeTensor.tolist = tolist
    try:
        yield
    finally:
        FakeTensor.tolist = own


def _made_up_scalar(dtype: torch.dtype):
    """A value for `.item()` of a fake tensor: 1 keeps divisions (Adam's bias correction, losses) finite."""
    if dtype == torch.bool:
        return True
    return 1.0 if dtype.is_floating_point else 1


def _default_group(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


@contextlib.contextmanager
def object_collectives(recorder: CollectiveRecorder, relay=None):
    """torch.distributed's object collectives recorded as themselves. A gather takes every rank's object to be this
    rank's (what the fake group makes up for tensors; a rank that branches on another's object is outside the
    proof); a broadcast or scatter from rank 0 gives this rank what rank 0 sent, through `relay`
    (wattgate.proof.relay: rank 0 puts, the others take; None: the objects stay as they were), matched by
    operator, call site and count there."""
    calls: Counter = Counter()

    def from_rank_0(op: str, src, here: list, caller):
        """Rank 0: `here` put for the others, None returned; another rank: what rank 0 put, or None. `caller`: the
        frame that called torch.distributed's function (its file and line name the call site)."""
        site = f"{op}@{caller.f_code.co_filename}:{caller.f_lineno}"
        calls[site] += 1
        key = f"{site}#{calls[site]}"
        if relay is None or src != 0:
            return None
        if dist.get_rank() == 0:
            relay.put(key, list(here))
            return None
        return relay.get(key)

    def all_gather_object(object_list, obj, group=None):
        recorder.add("all_gather_object", _default_group(group), f"{len(object_list)} objects")
        for i in range(len(object_list)):
            object_list[i] = obj

    def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
        recorder.add("gather_object", _default_group(group), f"dst {dst if dst is not None else group_dst}")
        if object_gather_list is not None:
            for i in range(len(object_gather_list)):
                object_gather_list[i] = obj

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        src = src if src is not None else group_src
        recorder.add("broadcast_object_list", _default_group(group), f"{len(object_list)} objects", f"src {src}")
        got = from_rank_0("broadcast_object_list", src, object_list, sys._getframe(1))
        if got is not None and len(got) == len(object_list):
            object_list[:] = got

    def scatter_object_list(
        scatter_object_output_list, scatter_object_input_list=None, src=None, group=None, group_src=None
    ):
        src = src if src is not None else group_src
        recorder.add("scatter_object_list", _default_group(group), f"src {src}")
        if scatter_object_input_list:
            scatter_object_output_list[0] = scatter_object_input_list[dist.get_rank()]
        got = from_rank_0("scatter_object_list", src, scatter_object_input_list or [], sys._getframe(1))
        if got is not None and len(got) > dist.get_rank():
            scatter_object_output_list[0] = got[dist.get_rank()]

    def barrier(group=None, async_op=False, device_ids=None, timeout=None):
        recorder.add("barrier", _default_group(group))

    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        recorder.add("monitored_barrier", _default_group(group))

    wrapped = {
        "all_gather_object": all_gather_object,
        "gather_object": gather_object,
        "broadcast_object_list": broadcast_object_list,
        "scatter_object_list": scatter_object_list,
        "barrier": barrier,
        "monitored_barrier": monitored_barrier,
    }
    modules = (dist, dist.distributed_c10d)
    saved = [(m, name, getattr(m, name)) for m in modules for name in wrapped]
    try:
        for m in modules:
            for name, fn in wrapped.items():
                setattr(m, name, fn)
        yield recorder
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)

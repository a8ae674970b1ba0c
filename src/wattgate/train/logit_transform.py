"""What a causal LM's forward does to its head's output before its loss, read from that forward's source.

Some models change the logits before their loss (Granite divides by logits_scaling, Cohere multiplies by
logit_scale, Gemma 2/3 softcap with tanh(x / c) * c). The chunked loss (train/loss.py) never makes the full logits,
so it must apply the same change to each chunk: `logit_transform` parses the forward (transformers' own source, with
the config values and attributes it names) into a LogitTransform, or says why it cannot. It reads code and config
only, so every rank, and the gate's proof over fake tensors, decides alike.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import torch

LOGIT_TRANSFORM = "wattgate_logit_transform"  # logit_transform's answer, cached on the model


@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to its head's output before the loss, in order: ("scale", s) multiplies by
    s, ("tanh", None) takes tanh. Gemma's softcap c is scale 1/c, tanh, scale c; () is a plain head."""

    ops: tuple[tuple[str, float | None], ...] = ()

    @property
    def scale(self) -> float | None:
        """The one factor the ops multiply by, or None when a tanh makes them nonlinear."""
        if any(op == "tanh" for op, _ in self.ops):
            return None
        return math.prod(v for _, v in self.ops if v is not None)  # no tanh: every op a scale by its factor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for op, value in self.ops:
            if op == "tanh":
                logits = torch.tanh(logits)
            else:
                assert value is not None  # a scale has its factor
                logits = logits * value
        return logits

    def describe(self) -> str:
        return " then ".join("tanh" if op == "tanh" else f"x {value:.6g}" for op, value in self.ops) or "none"


PLAIN = LogitTransform()


class _Unrecognized(Exception):
    """A statement of the model's forward that logit_transform cannot read as a known logit transform."""


TANH_CALLS = frozenset({"torch.tanh", "nn.functional.tanh", "torch.nn.functional.tanh", "F.tanh"})
UPCASTS = frozenset({"float", "contiguous"})  # the same values (fp32 or a copy): the loss is fp32 anyway


def logit_transform(model) -> tuple[LogitTransform | None, str]:
    """(transform, "") when the model's forward computes its logits as its output embeddings applied to its
    decoder's output followed only by scales and tanh (read from the forward's source, with the values of the
    config and attributes it names); (None, why) for any other forward. Cached on the model. It reads code and
    config only, so every rank, and the gate's proof over fake tensors, decides alike."""
    cached = model.__dict__.get(LOGIT_TRANSFORM)
    if cached is None:
        try:
            cached = (_read_forward(model), "")
        except _Unrecognized as exc:
            cached = (None, " ".join(str(exc).split()))  # one line, whatever the source looked like
        object.__setattr__(model, LOGIT_TRANSFORM, cached)
    return cached


def _read_forward(model) -> LogitTransform:
    forward = inspect.unwrap(type(model).forward)
    where = forward.__qualname__
    try:
        func = cast(ast.FunctionDef, ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0])  # its def
    except (OSError, TypeError, SyntaxError, IndexError) as exc:
        raise _Unrecognized(f"the source of {where} cannot be read ({type(exc).__name__})") from None
    reader = _ForwardReader(model, where)
    reader.block(func.body)
    if reader.ops is None:
        raise _Unrecognized(f"{where} has no `logits = self.<output embeddings>(<decoder output>)`")
    ops: list = []
    for op, value in reader.ops:  # consecutive scales as one; a scale of 1 (Granite's default) as none
        if op == "scale" and ops and ops[-1][0] == "scale":
            value *= ops.pop()[1]
        if op == "tanh" or value != 1.0:
            ops.append((op, value))
    return LogitTransform(tuple(ops))


class _ForwardReader:
    """Walks a causal LM's forward statement by statement: the decoder call, the hidden state it returns (at
    most sliced), the head applied to it, then every later write to `logits`, each a scale or a tanh.
    An `if` that decides any of them must be a constant of the model (self.config.final_logit_softcapping)."""

    RELEVANT = frozenset({"logits", "hidden_states"})

    def __init__(self, model, where: str):
        self.model, self.where = model, where
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.decoder_outputs: set[str] = set()  # names bound to the decoder's output
        self.hidden_ok = False  # hidden_states holds the decoder's last hidden state, at most sliced
        self.ops: list | None = None  # None until the head is applied

    def fail(self, node, what: str):
        raise _Unrecognized(f"{self.where} {what} (`{ast.unparse(node).splitlines()[0]}`)")

    def block(self, statements) -> None:
        for stmt in statements:
            self.statement(stmt)

    @staticmethod
    def writes(node) -> set[str]:
        """Names a statement binds or mutates (a subscript store, an in-place method such as logits.div_)."""
        out = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name):
                out.add(n.value.id)
            elif isinstance(n, ast.Attribute) and n.attr.endswith("_") and isinstance(n.value, ast.Name):
                out.add(n.value.id)
        return out

    def statement(self, stmt) -> None:
        relevant = self.writes(stmt) & (self.RELEVANT | self.decoder_outputs)
        if isinstance(stmt, ast.If):
            if relevant:
                self.block(stmt.body if self.value(stmt.test) else stmt.orelse)
            return
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                self.assign(stmt, targets[0].id, stmt.value)
                return
        if "logits" in relevant or (self.ops is None and relevant):
            self.fail(stmt, "changes the hidden state or the logits")

    def assign(self, stmt, name: str, value) -> None:
        if self.ops is None and self.is_self_call(value, self.decoder):
            self.decoder_outputs.add(name)
        elif name == "hidden_states":
            self.hidden_ok = self.ops is None and self.is_decoder_hidden(value)
        elif name == "logits":
            if self.ops is None and not self.is_head_call(value):
                self.fail(stmt, "computes its logits other than as the output embeddings of the decoder's output")
            self.ops = self.logits_ops(stmt, value)
        else:
            self.decoder_outputs.discard(name)

    def is_self_call(self, node, module) -> TypeGuard[ast.Call]:
        """node calls `module` as an attribute of self (self.model, self.model.decoder)."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            return False
        try:
            return self.value(node.func) is module
        except _Unrecognized:
            return False

    def is_decoder_hidden(self, node) -> bool:
        """outputs.last_hidden_state, outputs[0], or slice_logits_to_keep(hidden_states, ...) of one of them."""
        if isinstance(node, ast.Attribute) and node.attr == "last_hidden_state":
            return isinstance(node.value, ast.Name) and node.value.id in self.decoder_outputs
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            first = isinstance(node.slice, ast.Constant) and node.slice.value == 0
            return node.value.id in self.decoder_outputs and first
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "slice_logits_to_keep" and node.args:
            return self.hidden_ok and ast.unparse(node.args[0]) == "hidden_states"
        return False

    def is_head_call(self, node) -> bool:
        """self.lm_head(h), maybe upcast or scaled, where h is the decoder's hidden state, at most sliced
        along the sequence (hidden_states[:, slice_indices, :])."""
        while True:
            if isinstance(node, ast.BinOp):
                node = node.left
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in UPCASTS:
                node = node.func.value
            else:
                break
        if not (self.is_self_call(node, self.head) and len(node.args) == 1 and not node.keywords):
            return False
        h = node.args[0]
        if isinstance(h, ast.Subscript) and isinstance(h.slice, ast.Tuple) and len(h.slice.elts) == 3:
            first, _, last = h.slice.elts
            if all(isinstance(e, ast.Slice) and not (e.lower or e.upper or e.step) for e in (first, last)):
                h = h.value
        return isinstance(h, ast.Name) and h.id == "hidden_states" and self.hidden_ok

    def logits_ops(self, stmt, node) -> list:
        """The ops of a logits expression: those of the logits so far (or the head's: none), then its own."""
        if isinstance(node, ast.Name) and node.id == "logits" and self.ops is not None:
            return list(self.ops)
        if self.is_self_call(node, self.head):
            return []
        call = isinstance(node, ast.Call)
        if call and isinstance(node.func, ast.Attribute) and node.func.attr in UPCASTS:
            if not node.args and not node.keywords:
                return self.logits_ops(stmt, node.func.value)
        if call and ast.unparse(node.func) in TANH_CALLS and len(node.args) == 1 and not node.keywords:
            return [*self.logits_ops(stmt, node.args[0]), ("tanh", None)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            on_left = self.holds_logits(node.left)
            if on_left == self.holds_logits(node.right) or (isinstance(node.op, ast.Div) and not on_left):
                self.fail(stmt, "combines its logits with something other than a constant")
            inner, factor = (node.left, node.right) if on_left else (node.right, node.left)
            value = self.number(stmt, factor)
            return [*self.logits_ops(stmt, inner), ("scale", 1.0 / value if isinstance(node.op, ast.Div) else value)]
        self.fail(stmt, "transforms its logits in a way the chunked loss does not know")

    @staticmethod
    def holds_logits(node) -> bool:
        return any(isinstance(n, ast.Name) and n.id in ("logits", "hidden_states") for n in ast.walk(node))

    def number(self, stmt, node) -> float:
        value = self.value(node)
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # a learned Parameter, say
            self.fail(stmt, f"scales its logits by `{ast.unparse(node)}`, a {type(value).__name__}, not a number")
        if not math.isfinite(value) or value == 0:
            self.fail(stmt, f"scales its logits by {value!r}, not a finite nonzero number")
        return float(value)

    def value(self, node):
        """A constant expression over self's attributes (self.config.logits_scaling is not None, 1 / self.x)."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id == "self":
                obj = self.model
                for attr in reversed(chain):
                    obj = getattr(obj, attr, None)
                return obj
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            v = self.value(node.operand)
            return not v if isinstance(node.op, ast.Not) else (-v if isinstance(node.op, ast.USub) else v)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](self.value(node.left), self.value(node.right))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARISONS:
            return _COMPARISONS[type(node.ops[0])](self.value(node.left), self.value(node.comparators[0]))
        if isinstance(node, ast.BoolOp):
            values = [self.value(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        raise _Unrecognized(f"{self.where} decides its logits by `{ast.unparse(node)}`, not a constant of the model")


_ARITHMETIC: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
}
_COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}

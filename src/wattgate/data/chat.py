"""Render chat documents with the tokenizer's own template and find the assistant spans.

Approach: for each distinct sequence of roles, render the template once with
placeholder contents. The pieces between placeholders are the template's own
text, so `piece0 + content0 + piece1 + ...` rebuilds a conversation and tells
exactly where each content sits. Each real rendering is compared with the
rebuilt one; templates that change content (trim, split reasoning, ...) fall
back to rendering prefixes of the conversation. The span of an assistant turn
covers its content plus the end-of-turn special token that follows it, so the
model learns to stop.

A template that renders a turn without its content (e.g. one that ignores
`system` messages) would lose that text silently: the placeholder probe shows
it, and the conversation is refused with TemplateError naming the turn and its
role (pretokenize counts it as the bad record `template_error`). A template that does not compile, or
that fails on every chat record of the corpus, is the tokenizer's fault, not the records': the stage stops
naming the template file (`check_template_compiles` here, the all-failed check in pretokenize). Turn order is
the template's business: one that demands alternation raises, one that does
not renders the turns as given, and the loss mask follows the roles (see
`wattgate.data.records` for the policy and how irregular orders are counted).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from wattgate.errors import InputError

_PLACEHOLDER = "\ue000{}\ue001"  # private-use code points: never in real text
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")

Span = tuple[int, int]


class TemplateError(Exception):
    """The chat template refused this conversation (e.g. roles out of order)."""


# Where a tokenizer folder keeps its chat template, in the order transformers prefers them.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def template_file(source: str) -> str:
    """The file a tokenizer folder's chat template comes from (the folder itself if none is there)."""
    folder = Path(source)
    found = next((folder / name for name in TEMPLATE_FILES if (folder / name).is_file()), None)
    return str(found or folder)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_template_compiles(tokenizer, where: str) -> None:
    """A template that does not compile fails every conversation alike: that is the tokenizer's fault, so it
    stops the stage naming the template file instead of counting each record as bad."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - a transformers without it renders (and fails) per record
        return
    try:
        _compile_jinja_template(tokenizer.get_chat_template())
    except Exception as exc:  # jinja's TemplateSyntaxError, or ValueError for a dict without a default
        line = getattr(exc, "lineno", None)
        at = f", template line {line}" if line else ""
        raise InputError(
            f"{where}: chat template does not compile ({_first_line(exc)}{at}); fix the template"
        ) from None


class _DirectTemplate:
    """The tokenizer's compiled chat template with the variables `apply_chat_template` gives it besides the
    messages (no tools, no documents, the special tokens)."""

    def __init__(self, compiled, variables: dict):
        self.compiled = compiled
        self.variables = variables

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.variables)


def _direct_template(tokenizer) -> _DirectTemplate | None:
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(tokenizer.get_chat_template())
    except Exception:  # noqa: BLE001 - no direct rendering: every conversation goes through apply_chat_template
        return None
    return _DirectTemplate(compiled, {"tools": None, "documents": None, **tokenizer.special_tokens_map})


class ChatRenderer:
    def __init__(self, tokenizer, source: str = "tokenizer"):
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(f"{source}: tokenizer has no chat template; chat documents need one")
        self.tok = tokenizer
        self.source = source
        self.template_file = template_file(source)
        check_template_compiles(tokenizer, self.template_file)
        # longest first so "<|im_end|>" wins over a shorter special token it starts with
        self.special: list[str] = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
        self._skeletons: dict[tuple[str, ...], list[str] | None] = {}
        self._dropped: dict[tuple[str, ...], int | None] = {}  # first turn the template renders without content
        # Turns of role and content strings only (nearly every corpus), rendered by calling the compiled template
        # as `apply_chat_template` calls it, without its per-call work on the messages (about half its time):
        # checked per role sequence against apply_chat_template (`_check_direct`).
        self._direct = _direct_template(tokenizer)
        self._direct_checked: set[tuple] = set()

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        plain = self._direct is not None and all(len(m) == 2 and type(m["content"]) is str for m in messages)
        key = (tuple(m["role"] for m in messages), add_generation_prompt)
        try:
            if plain and key in self._direct_checked:
                assert self._direct is not None  # plain: there is a direct template
                return self._direct.render(messages=list(messages), add_generation_prompt=add_generation_prompt)
            text = self.tok.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises TemplateError, templates may raise anything
            raise TemplateError(_first_line(exc)) from None
        if plain:
            self._check_direct(messages, add_generation_prompt, key, text)
        return text

    def _check_direct(self, messages: Sequence[dict], add_generation_prompt: bool, key: tuple, text: str) -> None:
        """Render this role sequence's first conversation the direct way too: the same text, and every later one
        renders directly; a different text (a transformers that passes the template other variables) or an
        error, and none does."""
        assert self._direct is not None  # called only for a plain conversation: there is a direct template
        try:
            same = self._direct.render(messages=list(messages), add_generation_prompt=add_generation_prompt) == text
        except Exception:  # noqa: BLE001 - any failure here only means: no direct rendering
            same = False
        if same:
            self._direct_checked.add(key)
        else:
            self._direct = None

    def _skeleton(self, roles: tuple[str, ...]) -> list[str] | None:
        """Template pieces around each content for this role sequence, or None if not verbatim."""
        if roles not in self._skeletons:
            probe = [{"role": r, "content": _PLACEHOLDER.format(i)} for i, r in enumerate(roles)]
            try:
                text = self._render(probe)
            except TemplateError:
                self._skeletons[roles] = None
                return None
            parts = _PLACEHOLDER_RE.split(text)
            order = [int(x) for x in parts[1::2]]
            self._skeletons[roles] = parts[0::2] if order == list(range(len(roles))) else None
            self._dropped[roles] = next((i for i in range(len(roles)) if i not in set(order)), None)
        return self._skeletons[roles]

    def _end_of_turn(self, following: str) -> int:
        for tok in self.special:
            if following.startswith(tok):
                return len(tok)
        return 0

    def render(self, messages: Sequence[dict]) -> tuple[str, list[Span]]:
        """The rendered conversation and the character spans of assistant turns."""
        text = self._render(messages)
        roles = tuple(m["role"] for m in messages)
        pieces = self._skeleton(roles)
        dropped = self._dropped.get(roles)
        if dropped is not None and messages[dropped]["content"]:
            raise TemplateError(
                f"the chat template drops the content of messages[{dropped}] "
                f"(role {roles[dropped]!r}); fix the template or remove such turns"
            )
        if pieces is not None:
            spans, out, pos = [], [pieces[0]], len(pieces[0])
            for m, piece in zip(messages, pieces[1:]):
                start, pos = pos, pos + len(m["content"])
                if m["role"] == "assistant":
                    spans.append((start, pos + self._end_of_turn(piece)))
                out += (m["content"], piece)
                pos += len(piece)
            if "".join(out) == text:
                return text, spans
        return text, self._spans_from_prefixes(messages, text)

    def _spans_from_prefixes(self, messages: Sequence[dict], text: str) -> list[Span]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], add_generation_prompt=True) if i else ""
            through = self._render(messages[: i + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise InputError(
                    f"{self.source}: chat template renders a conversation differently from its prefixes, "
                    "so assistant spans cannot be located; set pretokenize.loss_on: all"
                )
            end = len(through.rstrip())
            spans.append((len(before), end))
        return spans

"""Seeded synthetic corpora that a tiny model can learn in minutes on a CPU: the embedded default's two sources.

`chat` (demo.jsonl): tasks are algorithmic (addition, multiplication, string
reversal, sorting, counting), so learning is measurable: the loss on assistant
tokens falls well below the entropy of the answers' alphabet. Lengths are
heavy-tailed — most conversations are one short turn, a few are long multi-turn
ones with large operands — so that packing has real work to do and a few
documents exceed `seq_len` (exercising the overlong policy).

`notes` (demo-notes.jsonl): plain text (the `text` field, trained on every
token), short paragraphs of templated facts whose numbers follow from the words
(sums, arithmetic sequences, weekdays, comparisons, the alphabet): another kind
of text with its own, different validation curve, as a mixture's second source.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from wattgate.artifacts import atomic_path, check_file_output
from wattgate.errors import InputError

_LETTERS = string.ascii_lowercase


def _heavy_tail(rng: random.Random, alpha: float, cap: int) -> int:
    """A Pareto draw >= 1 (floor), capped: many small values, a few large."""
    return min(cap, int(rng.paretovariate(alpha)))


def _task_add(rng: random.Random, size: int) -> tuple[str, str]:
    digits = min(3 + size, 30)
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"What is {a} + {b}?", str(a + b)


def _task_mul(rng: random.Random, size: int) -> tuple[str, str]:
    digits = min(1 + size, 12)
    a, b = rng.randrange(10**digits), rng.randrange(100)
    return f"Compute {a} * {b}.", str(a * b)


def _task_reverse(rng: random.Random, size: int) -> tuple[str, str]:
    word = "".join(rng.choice(_LETTERS) for _ in range(3 + 2 * size))
    return f"Reverse the string: {word}", word[::-1]


def _task_sort(rng: random.Random, size: int) -> tuple[str, str]:
    items = [rng.randrange(1000) for _ in range(2 + 3 * size)]
    return (
        "Sort these numbers in ascending order: " + " ".join(map(str, items)),
        " ".join(map(str, sorted(items))),
    )


def _task_count(rng: random.Random, size: int) -> tuple[str, str]:
    letter = rng.choice("abc")
    word = "".join(rng.choice("abcd") for _ in range(4 + 3 * size))
    return f"How many times does '{letter}' occur in {word}?", str(word.count(letter))


TASKS = (_task_add, _task_mul, _task_reverse, _task_sort, _task_count)
SYSTEM_PROMPTS = ("You are a careful calculator.", "Answer with the result only.")


def make_conversation(rng: random.Random, max_turns: int) -> dict:
    turns = _heavy_tail(rng, alpha=1.6, cap=max_turns)
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(turns):
        question, answer = rng.choice(TASKS)(rng, _heavy_tail(rng, alpha=1.3, cap=40))
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def generate(num_docs: int, seed: int, max_turns: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_conversation(rng, max_turns) for _ in range(num_docs)]


_NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana")
_THINGS = ("apple", "book", "coin", "stone", "shell", "card")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _note_sum(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    thing, a, b = rng.choice(_THINGS), rng.randrange(1, 20), rng.randrange(1, 20)
    return f"{name} has {a} {thing}s. {other} gives {name} {b} more, so {name} now has {a + b} {thing}s."


def _note_sequence(rng: random.Random) -> str:
    start, step = rng.randrange(0, 50), rng.randrange(1, 10)
    terms = [start + k * step for k in range(5)]
    return f"The sequence {', '.join(map(str, terms[:4]))} grows by {step}, so the next number is {terms[4]}."


def _note_weekday(rng: random.Random) -> str:
    day, k = rng.randrange(7), rng.randrange(1, 7)
    return f"{k} days after {_DAYS[day]} comes {_DAYS[(day + k) % 7]}."


def _note_compare(rng: random.Random) -> str:
    a, b = rng.sample(range(100), 2)
    return f"{a} is {'larger' if a > b else 'smaller'} than {b}."


def _note_letter(rng: random.Random) -> str:
    k = rng.randrange(25)
    return f"In the alphabet the letter {_LETTERS[k]} comes before {_LETTERS[k + 1]}."


NOTES = (_note_sum, _note_sequence, _note_weekday, _note_compare, _note_letter)


def generate_notes(num_docs: int, seed: int) -> list[dict]:
    """`num_docs` plain-text paragraphs of heavy-tailed length (one to a dozen facts each)."""
    rng = random.Random(f"notes:{seed}")  # its own stream: the chat corpus of the same seed does not move it
    return [
        {"text": " ".join(rng.choice(NOTES)(rng) for _ in range(_heavy_tail(rng, alpha=1.2, cap=12)))}
        for _ in range(num_docs)
    ]


KINDS = {"chat": "conversations", "notes": "notes"}


# every record says where it came from (pretokenize reads only the text and messages fields), so a rerun
# knows an earlier demo corpus from a user's corpus at the same --out
SOURCE = {"source": "wattgate demo-corpus"}


def is_demo_corpus(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        first = json.loads(f.readline(1 << 20) or "null")
    return isinstance(first, dict) and first.get("source") == SOURCE["source"]


def write_demo_corpus(out: str | Path, num_docs: int, seed: int, max_turns: int, kind: str = "chat") -> int:
    """The `kind` corpus (chat or notes) as JSONL at `out`; returns its number of documents."""
    check_file_output(out, "demo-corpus", is_demo_corpus)  # a user's corpus there is never overwritten
    # the corpus is JSONL, and the readers go by the name: one that says Parquet or gzip would be misread
    if not Path(out).name.lower().endswith(".jsonl"):
        raise InputError(f"{out}: demo-corpus writes plain JSONL; give --out a name ending in .jsonl")
    docs = generate(num_docs, seed, max_turns) if kind == "chat" else generate_notes(num_docs, seed)
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc | SOURCE, ensure_ascii=False) + "\n")
    return len(docs)

"""A seeded synthetic chat corpus that a tiny model can learn in minutes on a CPU.

Tasks are algorithmic (addition, multiplication, string reversal, sorting,
counting), so learning is measurable: the loss on assistant tokens falls well
below the entropy of the answers' alphabet. Lengths are heavy-tailed — most
conversations are one short turn, a few are long multi-turn ones with large
operands — so that packing has real work to do and a few documents exceed
`seq_len` (exercising the overlong policy).
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


# every record says where it came from (pretokenize reads only the text and messages fields), so a rerun
# knows an earlier demo corpus from a user's corpus at the same --out
SOURCE = {"source": "wattgate demo-corpus"}


def is_demo_corpus(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        first = json.loads(f.readline(1 << 20) or "null")
    return isinstance(first, dict) and first.get("source") == SOURCE["source"]


def write_demo_corpus(out: str | Path, num_docs: int, seed: int, max_turns: int) -> int:
    check_file_output(out, "demo-corpus", is_demo_corpus)  # a user's corpus there is never overwritten
    # the corpus is JSONL, and the readers go by the name: one that says Parquet or gzip would be misread
    if not Path(out).name.lower().endswith(".jsonl"):
        raise InputError(f"{out}: demo-corpus writes plain JSONL; give --out a name ending in .jsonl")
    docs = generate(num_docs, seed, max_turns)
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc | SOURCE, ensure_ascii=False) + "\n")
    return len(docs)

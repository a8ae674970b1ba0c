"""Weighted data mixtures (`data.inputs` entries that are mappings): the sources, read from the config.

A plain path is a source named for its file's stem, seen once per epoch (today's meaning). A mapping names
its source and gives one of `weight` (a share of the weighted sources' tokens in each epoch), `epochs`
(passes per epoch, fractional allowed) or `max_tokens` (at most that many tokens per epoch); none given
means `epochs: 1`. The pack stage turns these into documents per epoch (pack/mixture.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from wattgate.errors import InputError
from wattgate.records.run_config import DataInputSourceValidationConfig, RunConfig

KINDS = ("weight", "epochs", "max_tokens")


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    kind: str = "epochs"  # weight | epochs | max_tokens
    value: float = 1.0
    validation: DataInputSourceValidationConfig | None = None  # its own carve (fraction, max_docs, seed), if any

    def spec(self) -> dict:
        """What manifest.json and plan.json record of the source's setting."""
        return {"name": self.name, "path": self.path, self.kind: self.value}


def source_name(path: str | os.PathLike[str]) -> str:
    """A plain path's source name: the file name's stem (`.jsonl.gz` and `.json.gz` lose both suffixes)."""
    name = Path(str(path).rstrip("/")).name
    for suffix in (".gz",):
        name = name.removesuffix(suffix)
    return Path(name).stem or name


def is_mixture(config: RunConfig) -> bool:
    """True when any data.inputs entry is a mapping (a mixture source): plans then choose documents per source."""
    return any(not isinstance(e, str) for e in config.data.inputs)


def parse_sources(config: RunConfig, where: str = "data.inputs") -> list[Source]:
    """The sources of data.inputs, in order; one-line InputError naming the source for a bad mixture."""
    sources = []
    for i, entry in enumerate(config.data.inputs):
        if isinstance(entry, str):
            sources.append(Source(source_name(entry), entry))
            continue
        amounts = {"weight": entry.weight, "epochs": entry.epochs, "max_tokens": entry.max_tokens}
        given = [k for k in KINDS if amounts[k] is not None]
        if len(given) > 1:
            raise InputError(
                f"{where}[{i}] (source {entry.name!r}): {' and '.join(given)} given together; give one of "
                "weight, epochs or max_tokens"
            )
        kind = given[0] if given else "epochs"
        value = amounts[kind] if given else 1.0
        assert value is not None  # `given` holds only the amounts set
        sources.append(Source(entry.name, entry.path, kind, value, entry.validation))
    if is_mixture(config):  # in a plain list two files may share a stem: the names are the files' own
        _check_distinct_names(sources, where)
    _check_distinct_files(sources, where, is_mixture(config))
    if any(s.validation for s in sources) and config.data.validation.inputs:
        s = next(s for s in sources if s.validation)
        raise InputError(
            f"{where} (source {s.name!r}): a per-source validation override and data.validation.inputs given "
            "together; hold out either separate files or a carve per source"
        )
    return sources


def _check_distinct_files(sources: list[Source], where: str, mixture: bool) -> None:
    """Each file is named once: a file listed twice would train every document of it twice while the gate counts
    each document once (a mixture source's `epochs` or `weight` repeats it on purpose). The same file under two
    spellings, or through a link, is one file."""
    seen: dict[str, int] = {}
    for i, s in enumerate(sources):
        key = os.path.realpath(s.path)
        if key in seen:
            j = seen[key]
            raise InputError(
                f"{where}: sources {sources[j].name!r} and {s.name!r} are the same file ({s.path}); list it once "
                "(raise its weight or epochs to see it more)"
                if mixture
                else f"{where}[{i}] ({s.path}) is the same file as {where}[{j}]; list it once (a mapping "
                "{path: ..., epochs: 2} trains a source twice on purpose)"
            )
        seen[key] = i


def _check_distinct_names(sources: list[Source], where: str) -> None:
    names: dict[str, Source] = {}
    for s in sources:
        if s.name in names:
            raise InputError(
                f"{where}: two sources named {s.name!r} ({names[s.name].path} and {s.path}); give each source "
                "its own name"
            )
        names[s.name] = s

"""Typed run records: what each stage writes and the next reads, one frozen dataclass tree per file.

`base.py` holds the reading and writing rules (types, ranges, one-line errors naming the file and the key);
each record module defines one file's record; `run_config.py` is the config tree, generated from the schema.
Formats: docs/architecture.md.
"""

"""Write docs/configuration.md from the config schema, or check that it is current.

The schema's descriptions are the reference for every key; this page is a readable view of them, one table per
top-level group with every key in its dotted form (`cluster.slurm.partition`), so a key is documented in one place.
jsonschema2md and json-schema-for-humans were tried: the first writes one long nested list with anchors, test links
and "Cannot contain additional properties" on every object, the second ~2000 lines of per-key tables.

    python scripts/config_docs.py --out docs/configuration.md   # regenerate
    python scripts/config_docs.py --check docs/configuration.md # exit 1 when stale (make lint)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "src" / "wattgate" / "schemas" / "config.schema.yaml"
SCHEMA_REL = SCHEMA.relative_to(REPO).as_posix()

HEADER = f"""# Configuration reference

<!-- Generated from {SCHEMA_REL} by scripts/config_docs.py. Do not edit: change the schema's
descriptions and run `.venv/bin/python scripts/config_docs.py --out docs/configuration.md`
(`make lint` fails when this page is stale). -->

Every key a run config may hold, with its type, default and meaning. A config names only the keys it changes;
every other key takes its default. Keys are written in dotted form: `cluster.slurm.partition: gpu` means

```yaml
cluster:
  slurm:
    partition: gpu
```

Every object is closed: an unknown key or a wrong type stops the run with the key path named. The Snakefile and
every `wattgate` command validate against the same schema, `{SCHEMA_REL}`; under Snakemake the
validated config, every default filled in, is written to `results/config/<run>.yaml`.
"""


def flow(value) -> str:
    """A default as it would be written in a config file (YAML flow style, one line)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def type_of(node: dict) -> str:
    """The key's type with its bounds: `integer >= 1`, `bf16 | none`, `list of string (>= 1 item)`."""
    if "enum" in node:
        return " | ".join(f"`{flow(v)}`" for v in node["enum"])
    kinds = node.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "array" in kinds:
        item = type_of(node.get("items", {}))
        kinds = [f"list of {item}" if k == "array" else k for k in kinds]
    text = " or ".join(kinds)
    bounds = [
        f"{op} {flow(node[key])}"
        for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if key in node
    ]
    lo, hi = node.get("minItems"), node.get("maxItems")
    if lo is not None and lo == hi:
        bounds.append(f"exactly {lo} items")
    else:
        if lo is not None:
            bounds.append(f"at least {lo} item{'s' * (lo != 1)}")
        if hi is not None:
            bounds.append(f"at most {hi} items")
    if "pattern" in node:
        bounds.append(f"matching `{node['pattern']}`")
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def default_of(node: dict) -> str:
    if "default" not in node or (node.get("type") == "object" and node["default"] == {}):
        return ""  # an object's {} default only means: its keys take their own defaults
    return f"`{flow(node['default'])}`"


def rows(name: str, node: dict) -> list[str]:
    """One table row for `name` and, below an object, a row for each of its keys."""
    out = [f"| `{name}` | {cell(type_of(node))} | {cell(default_of(node))} | {cell(node.get('description', ''))} |"]
    for key, child in node.get("properties", {}).items():
        out += rows(f"{name}.{key}", child)
    return out


def render(schema: dict) -> str:
    groups = schema["properties"]
    parts = [HEADER, "Groups: " + ", ".join(f"[`{g}`](#{g})" for g in groups) + ".\n"]
    for group, node in groups.items():
        parts.append(f"## `{group}`\n")
        if node.get("description") and node.get("properties"):
            parts.append(cell(node["description"]) + "\n")
        body = [r for key, child in node.get("properties", {}).items() for r in rows(f"{group}.{key}", child)]
        table = ["| key | type | default | meaning |", "|---|---|---|---|"]
        parts.append("\n".join(table + (body or rows(group, node))) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", type=Path, help="write the page here")
    action.add_argument("--check", type=Path, help="exit 1 when this page differs from the schema")
    args = parser.parse_args(argv)
    page = render(yaml.safe_load(SCHEMA.read_text()))
    if args.out:
        from wattgate.artifacts import write_bytes_atomic

        write_bytes_atomic(args.out, page.encode())
        return 0
    current = args.check.read_text() if args.check.exists() else ""
    if current != page:
        print(
            f"{args.check}: stale ({SCHEMA_REL} changed); run python scripts/config_docs.py --out {args.check}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

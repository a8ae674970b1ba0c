"""One loader for run configs: the same JSON Schema (with defaults) the Snakefile validates with."""

from __future__ import annotations

import copy
import math
import re
from importlib import resources
from pathlib import Path

import yaml

from wattgate.errors import InputError
from wattgate.records.run_config import DataConfig, ModelConfig, RunConfig

SCHEMA_RESOURCE = "schemas/config.schema.yaml"


def load_schema() -> dict:
    text = resources.files("wattgate").joinpath(SCHEMA_RESOURCE).read_text()
    # libyaml's loader when PyYAML has it: the pure-Python one takes a tenth of a second over the schema, a tenth
    # of a proof-reusing gate
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _validator_with_defaults(schema: dict):
    """Draft 2020-12 validator that fills in `default`s while it validates (as Snakemake does), and whose
    numbers are finite."""
    from jsonschema import Draft202012Validator, validators

    validate_properties = Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, subschema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub:
                    # deepcopy: a shared default object must not be mutated by nested defaults
                    instance.setdefault(key, copy.deepcopy(sub["default"]))
        yield from validate_properties(validator, properties, instance, subschema)

    base = Draft202012Validator.TYPE_CHECKER

    def finite_number(checker, instance) -> bool:
        # YAML's .nan and .inf are floats that pass every minimum and maximum (a NaN hang limit is never
        # reached, an infinite poll period overflows), and no setting means them: not numbers here
        return base.is_type(instance, "number") and math.isfinite(instance)

    finite = base.redefine("number", finite_number)
    cls = validators.extend(Draft202012Validator, {"properties": set_defaults}, type_checker=finite)
    return cls(schema)


def _key_path(error) -> str:
    path = ".".join(str(p) for p in error.absolute_path)
    return path or "<top level>"


def validate_config(config: dict, source: str = "config") -> dict:
    """Validate `config` in place (filling defaults) and return it; one-line InputError if invalid."""
    from jsonschema.exceptions import best_match

    if not isinstance(config, dict):
        raise InputError(f"{source}: the config must be a mapping of keys, got {type(config).__name__}")
    validator = _validator_with_defaults(load_schema())
    error = best_match(validator.iter_errors(config))
    if error is not None:
        if error.validator == "additionalProperties":
            allowed = sorted(error.schema.get("properties", {}))
            prefix = ".".join(str(p) for p in error.absolute_path)
            unknown = [f"{prefix}.{k}" if prefix else k for k in error.instance if k not in allowed]
            raise InputError(
                f"{source}: unknown key '{', '.join(unknown)}' (allowed under '{prefix or '<top level>'}': "
                f"{', '.join(allowed)})"
            )
        if _non_finite(error.instance):
            raise InputError(
                f"{source}: key '{_key_path(error)}': {error.instance!r} is not a finite number (NaN and infinity "
                "are refused): give a finite number"
            )
        if _key_path(error) == REPLICATE_KEY:  # anyOf's own message names neither alternative
            raise InputError(f"{source}: {replicate_line(error.instance, config.get('cluster'))}")
        raise InputError(f"{source}: key '{_key_path(error)}': {error.message}")
    replicate = config["parallel"]["replicate"]
    if replicate != "auto" and _world(config["cluster"]) % replicate:
        raise InputError(f"{source}: {replicate_line(replicate, config['cluster'])}")
    expert = config["parallel"]["expert"]
    shard = _world(config["cluster"]) // (config["cluster"]["nodes"] if replicate == "auto" else replicate)
    if shard % expert:
        raise InputError(
            f"{source}: key '{EXPERT_KEY}': {expert} does not divide the shard group size {shard} (world size / "
            f"parallel.replicate); give one of {', '.join(str(d) for d in range(1, shard + 1) if shard % d == 0)}"
        )
    train = config["train"]
    line = context_line(config["parallel"]["context"], shard, expert, train["seq_len"], train["attn_implementation"])
    if line:
        raise InputError(f"{source}: key '{CONTEXT_KEY}': {line}")
    return config


EXPERT_KEY = "parallel.expert"
CONTEXT_KEY = "parallel.context"


def context_line(context: int, shard: int, expert: int, seq_len: int, attention: str = "auto") -> str | None:
    """Why `context` ranks cannot share each row of a shard group of `shard` ranks (None: they can)."""
    if shard % context:
        divisors = ", ".join(str(d) for d in range(1, shard + 1) if shard % d == 0)
        return (
            f"{context} does not divide the shard group size {shard} (world size / parallel.replicate); "
            f"give one of {divisors}"
        )
    if context > 1 and expert > 1:
        return (
            f"{context} together with parallel.expert {expert} is not built yet (experts' token exchange inside "
            "context groups); give 1 for one of them"
        )
    if seq_len % (2 * context):
        return (
            f"{context} needs train.seq_len divisible by {2 * context} (at least two chunks per rank), got "
            f"{seq_len}; give a train.seq_len that is a multiple of {2 * context}"
        )
    if context > 1 and attention == "flash_attention_2":
        return (
            f"{context} runs its own attention over the group's gathered keys (flex_attention on GPUs, else sdpa), "
            "not flash_attention_2's varlen kernel; set train.attn_implementation to auto, flex_attention or sdpa"
        )
    return None


REPLICATE_KEY = "parallel.replicate"


def _world(cluster: dict) -> int:
    return cluster["nodes"] * cluster["gpus_per_node"]


def replicate_line(value, cluster: dict | None) -> str:
    """Why `value` is no parallel.replicate for `cluster` (the validated cluster mapping, or None when it is
    itself invalid), and what is allowed."""
    if not isinstance(cluster, dict) or not {"nodes", "gpus_per_node"} <= set(cluster):
        allowed = "a positive integer that divides the world size, or auto"
    else:
        world = _world(cluster)
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        allowed = (
            f"a divisor of the world size {world} (cluster.nodes {cluster['nodes']} x cluster.gpus_per_node "
            f"{cluster['gpus_per_node']}): {divisors}; or auto, one replica per node"
        )
    return f"key '{REPLICATE_KEY}': {value!r} is not allowed; give {allowed}"


def _non_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last silently, so a
    second `train:` block would drop every key of the first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} given twice in one mapping (the later would replace the earlier)",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# PyYAML follows YAML 1.1, whose floats need a dot and a signed exponent (1.0e+9): 1.0e9, 1e9 and 1e-3 stay
# strings and then fail the schema's "number". YAML 1.2 (and JSON) read them as numbers; so does this loader.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_config(path: str | Path) -> dict:
    """Read a YAML config file and validate it against the schema (defaults filled in)."""
    return validate_config(read_config_file(path), source=str(path))


def load_run_config(path: str | Path) -> RunConfig:
    """A YAML config file as the typed config tree (validated, defaults filled in): what every stage reads."""
    return run_config(read_config_file(path), source=str(path))


def run_config(config: dict | RunConfig, source: str = "config") -> RunConfig:
    """The typed config tree of a config mapping (validated here, defaults filled in); a tree as it is.

    The boundary: the CLI (load_run_config) and the Snakefile convert here, once, and every function past them
    takes the tree; a caller holding a mapping (a test, a notebook) converts it here, with the CLI's validation."""
    if isinstance(config, RunConfig):
        return config
    return RunConfig.from_json(validate_config(config, source), source)


def model_config(model: ModelConfig | dict) -> ModelConfig:
    """The config's `model` section typed: a mapping gives `path` and/or `config` (the other is null)."""
    if isinstance(model, ModelConfig):
        return model
    return ModelConfig.from_json({"path": None, "config": None} | dict(model), "model")


def check_config_files(paths) -> None:
    """The Snakefile's config files read as the CLI reads them (Snakemake's own loader keeps the last of a key
    given twice): a duplicate key or a non-UTF-8 file stops the workflow with the same one line."""
    for path in paths:
        read_config_file(path)


def numbers_as_written(config: dict, paths) -> dict:
    """Snakemake's `config` with each exponent-notation number of its config files (`1.0e9`, `1e-3`) a number
    again: Snakemake reads them with YAML 1.1, as strings that fail the schema's "number". Only a string that is
    the file's own number is replaced (a later file's or --config's other value stays)."""

    def merge(target: dict, given: dict) -> None:
        for key, value in given.items():
            mine = target.get(key)
            if isinstance(value, dict) and isinstance(mine, dict):
                merge(mine, value)
            elif isinstance(mine, str) and isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    same = float(mine) == float(value)
                except ValueError:
                    same = False
                if same:
                    target[key] = value

    for path in paths:
        merge(config, read_config_file(path))
    return config


def read_config_file(path: str | Path) -> dict:
    """A YAML config file's mapping ({} when empty), not yet validated; one-line InputError when unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read config ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from None
    try:
        config = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise InputError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    return config if config is not None else {}


def max_doc_tokens(config: RunConfig) -> int:
    """Longest document pretokenize keeps whole: `pretokenize.max_tokens`, else `train.seq_len`."""
    return config.pretokenize.max_tokens or config.train.seq_len


def world_size(config: RunConfig) -> int:
    return config.cluster.nodes * config.cluster.gpus_per_node


def replicate_degree(config: RunConfig) -> int:
    """HSDP replica groups (parallel.replicate; auto: one per node). The shard degree is world_size / it; the
    schema check (validate_config) has made sure it divides the world size."""
    replicate = config.parallel.replicate
    return config.cluster.nodes if replicate == "auto" else replicate


def context_degree(config: RunConfig) -> int:
    """Context-parallel degree (parallel.context): ranks sharing each packed row; validate_config has checked it
    against the shard group, parallel.expert and train.seq_len."""
    return config.parallel.context


def data_parallel_size(config: RunConfig) -> int:
    """The ranks that train distinct micro-batches: the world over parallel.context (what pack plans for)."""
    return world_size(config) // context_degree(config)


def expert_degree(config: RunConfig) -> int:
    """Expert-parallel degree (parallel.expert): validate_config has made sure it divides the shard group size;
    whether the model has experts it divides is the model spec's check (model_spec.py `expert_checked`)."""
    return config.parallel.expert


def config_bytes(config: RunConfig) -> bytes:
    """The canonical text of a config (sorted keys): what results/config/<run>.yaml and the gate's copy hold,
    and what `config_sha256` hashes, so one config has one hash however its YAML was written."""
    return yaml.safe_dump(config.to_json(), sort_keys=True).encode()


def config_sha256(config: RunConfig) -> str:
    import hashlib

    return hashlib.sha256(config_bytes(config)).hexdigest()


def config_differences(config: RunConfig, gated: RunConfig) -> list[str]:
    """'key.path: value (gated value)' for every key whose value differs between the config and the gate's copy of
    it (as `load_run_config` reads it)."""
    return _mapping_differences(config.to_json(), gated.to_json(), "")


def _mapping_differences(mine: dict, theirs: dict, prefix: str) -> list[str]:
    out = []
    for key in sorted(set(mine) | set(theirs), key=str):
        path = f"{prefix}{key}"
        value, gated = mine.get(key, "<absent>"), theirs.get(key, "<absent>")
        if isinstance(value, dict) and isinstance(gated, dict):
            out.extend(_mapping_differences(value, gated, f"{path}."))
        elif value != gated:
            out.append(f"{path}: {value!r} (gated {gated!r})")
    return out


def dump_resolved(config: RunConfig, dest: str | Path) -> str:
    """Write the validated config (defaults filled) for CLI stages; rewrite only on change.

    It mirrors the config of the latest Snakemake invocation (including
    --config/--configfile overrides). An unchanged file keeps its mtime, and
    rules pass only its fixed path, so it never triggers reruns by itself;
    each rule's settings params do that for the keys it reads. The workflow writes it as its jobs start (onstart),
    so `snakemake -n --configfile other.yaml` never changes what a queued job reads.
    """
    from wattgate.artifacts import write_bytes_atomic

    dest = Path(dest)
    data = config_bytes(config)
    if not dest.exists() or dest.read_bytes() != data:
        write_bytes_atomic(dest, data)
    return str(dest)


def input_paths(data: DataConfig) -> list[str]:
    """data.inputs as paths, in order: a mixture source contributes its `path`."""
    return [entry if isinstance(entry, str) else entry.path for entry in data.inputs]

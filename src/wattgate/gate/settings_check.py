"""Gate check `settings`: the pretokenized data and the plan were made with the settings of the config being gated.

`sources` binds the manifest to the config's input files and `launch` the plan to its world and batch; this binds
the rest of what shaped them: the pretokenize settings the manifest records (`config`), the tokenizer the config
names, and the pack settings the plan records. Snakemake reruns a stage whose settings changed, so a mismatch here
means a stage was skipped or run by hand with another config: one line per key, what the artifact was made with
and what the config says.
"""

from __future__ import annotations

from pathlib import Path

from wattgate.data.pretokenize import recorded_settings
from wattgate.data.tokenizer import tokenizer_sha256
from wattgate.errors import InputError
from wattgate.gate.checks import Check
from wattgate.records.manifest import Manifest
from wattgate.records.plan import Plan
from wattgate.records.run_config import RunConfig

NAME = "settings"
# the recorded settings by the config key they come from (the rest are pretokenize.<field>)
CONFIG_KEYS = {"text_field": "data.text_field", "messages_field": "data.messages_field"}


def _pretokenize_problems(config: RunConfig, manifest: Manifest) -> list[str]:
    made = manifest.config or {}
    now = recorded_settings(config)
    return [
        f"{CONFIG_KEYS.get(key, f'pretokenize.{key}')}: pretokenized with {made[key]!r}, the config says {now[key]!r}"
        for key in sorted(now)
        if key in made and made[key] != now[key]
    ]


def _tokenizer_problems(config: RunConfig, manifest: Manifest) -> list[str]:
    path = config.tokenizer.path
    if not path or manifest.tokenizer_sha256 is None:
        return []  # a tokenizer train_tokenizer made: pretokenize's input, bound by Snakemake and check tokenizer
    try:
        same = tokenizer_sha256(path) == manifest.tokenizer_sha256
    except (InputError, OSError) as exc:
        return [f"tokenizer.path {path}: cannot read its tokenizer files ({exc})"]
    return [] if same else [f"tokenizer.path {path}: not the tokenizer the data was pretokenized with (sha256 differs)"]


def _pack_problems(config: RunConfig, plan: Plan) -> list[str]:
    made = [
        ("pack.seed", plan.seed, config.pack.seed),
        ("pack.attn_weight", plan.attn_weight, config.pack.attn_weight),
        ("pack.remainder", plan.remainder, config.pack.remainder),
    ]
    if plan.mixture is not None:
        made.append(("data.max_repeats", plan.mixture.max_repeats, config.data.max_repeats))
    return [f"{key}: planned with {was!r}, the config says {now!r}" for key, was, now in made if was != now]


def check_settings(config: RunConfig, manifest: Manifest, plan: Plan, pretokenized: Path) -> Check:
    data = _pretokenize_problems(config, manifest) + _tokenizer_problems(config, manifest)
    packing = _pack_problems(config, plan)
    if data or packing:
        rerun = "pretokenize and pack" if data else "pack"
        return Check(
            NAME,
            False,
            "; ".join(data + packing) + f" ({pretokenized}); rerun {rerun} for this config "
            f"(snakemake --forcerun {'pretokenize' if data else 'pack_and_balance'})",
        )
    return Check(NAME, True, "the pretokenize settings, the tokenizer and the pack settings are this config's")

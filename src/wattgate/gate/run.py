"""`wattgate gate`: load the artifacts once, run every check, write the report."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from wattgate.config import world_size
from wattgate.gate import checks as C
from wattgate.gate.inputs import GateInputs, load_inputs
from wattgate.gate.memory import (
    FitSettings,
    ModelSpec,
    checkpoint_bytes,
    device_memory_bytes,
    estimate_memory,
    load_model_spec,
)
from wattgate.gate.report import gate_json, write_report


def fit_settings(config: dict) -> FitSettings:
    t = config["train"]
    on_gpu = config["cluster"]["gpu_model"].lower() != "cpu"
    return FitSettings(
        world_size=world_size(config),
        tokens_per_micro_batch=t["micro_batch_size"] * t["seq_len"],
        activation_checkpointing=t["activation_checkpointing"],
        mixed_precision=on_gpu and t["mixed_precision"] == "bf16",
        on_gpu=on_gpu,
    )


def free_bytes_at(path: Path) -> tuple[int, str]:
    """Free space on the filesystem that will hold `path` (its nearest existing ancestor)."""
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free, str(probe)


def run_checks(inputs: GateInputs, spec: ModelSpec, terms: dict[str, int]) -> list[C.Check]:
    config, plan, packs = inputs.config, inputs.plan, inputs.packs
    stats = plan.get("stats", {})
    budget, source = device_memory_bytes(config)
    free, where = free_bytes_at(inputs.checkpoint_dir)
    final_bytes = spec.num_params * (2 if fit_settings(config).mixed_precision else 4)
    return [
        C.check_equal_steps(packs, plan["world_size"], plan["epochs"], plan["micro_batch_size"], plan["grad_accum"],
                            plan["steps_per_epoch"]),
        C.check_pack_contents(packs, plan["seq_len"], inputs.doc_tokens, inputs.doc_loss_tokens),
        C.check_conservation(packs, plan["epochs"], inputs.doc_tokens, int(inputs.manifest.get("num_tokens", -1)),
                             stats.get("dropped_doc_ids", []), stats.get("dropped", {})),
        C.check_launch(plan, config),
        C.check_provenance(plan, inputs.packs_sha256, inputs.manifest_sha256, inputs.manifest, spec.vocab_size),
        C.check_fit(terms, budget, source, config["gate"]["memory_headroom"]),
        C.check_checkpoint_space(checkpoint_bytes(spec), config["train"]["checkpoint_keep"], final_bytes, free, where),
        C.check_balance(packs, plan["world_size"], float(plan.get("attn_weight", config["pack"]["attn_weight"])),
                        config["gate"]["max_rank_cost_ratio"]),
        C.check_schedule(plan, config),
    ]


def run_gate(config: dict, pretokenized: str | Path, plan_dir: str | Path, out: str | Path) -> dict:
    """Run the gate; returns the report (also written to out/gate.json, out/gate.md, out/PASSED)."""
    out = Path(out)
    for marker in ("PASSED", "UNENFORCED"):  # a stale marker must never outlive a new verdict
        (out / marker).unlink(missing_ok=True)
    start = time.perf_counter()
    checkpoint_dir = out.parent / "train" / config["run_name"] / "checkpoints"
    inputs = load_inputs(config, pretokenized, plan_dir, checkpoint_dir)
    spec = load_model_spec(config)
    terms = estimate_memory(spec, fit_settings(config))
    results = run_checks(inputs, spec, terms)
    report = gate_json(all(c.passed for c in results), time.perf_counter() - start, results, terms,
                       config["gate"]["enforce"])
    write_report(out, report)
    return report

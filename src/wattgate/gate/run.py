"""`wattgate gate`: load the artifacts once, run every check, write the report."""

from __future__ import annotations

import atexit
import gc
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from wattgate.artifacts import sha256_file, write_bytes_atomic
from wattgate.run_files import (
    GATED_CONFIG,
    PLAN,
    PROOF_CACHE,
    STAGE_FILES,
    check_output,
    claim_output,
    run_folder_beside,
)
from wattgate.config import (
    config_bytes,
    config_sha256,
    context_degree,
    expert_degree,
    replicate_degree,
    world_size,
)
from wattgate.gate import checks as C
from wattgate.gate import proof_reuse as R
from wattgate.gate import validation_checks as V
from wattgate.gate.cost import cost_section, jobs_check
from wattgate.gate.conservation_check import Corpus, RemainderPolicy, check_conservation
from wattgate.gate.fit_checks import check_checkpoint_space, check_fit
from wattgate.gate.schedule_checks import check_schedule, check_segments
from wattgate.gpus import is_cpu
from wattgate.gate.inputs import GateInputs, concat_packs, load_inputs
from wattgate.gate.mixture_checks import MixtureInputs, cross_source_duplicates, mixture_inputs
from wattgate.gate.memory import (
    Budget,
    FitEstimate,
    FitSettings,
    checkpoint_bytes,
    checkpoint_source,
    device_memory_bytes,
    fit_estimate,
    host_memory_budget,
    validation_tokens_per_micro_batch,
)
from wattgate.model_spec import DTYPE_BYTES, ModelSpec, export_dtype_name, load_model_spec
from wattgate.gate.report import InputHashes, gate_json, write_report
from wattgate.context_layout import planned_context_kernel
from wattgate.gate.context_balance_check import check_context_balance
from wattgate.gate.isolation_check import check_document_isolation, model_recurrence
from wattgate.gate.tokenizer_check import check_tokenizer
from wattgate.gate.settings_check import check_settings
from wattgate.gate.sources_check import check_sources
from wattgate.gate.weights_check import check_weights, previous_report, with_model_hashes
from wattgate.records.gate import PHASE_STEADY, Collectives, GateReport, PlanHashes
from wattgate.records.plan import Plan
from wattgate.records.run_config import RunConfig


def fit_settings(config: RunConfig) -> FitSettings:
    """What the memory estimates need from the config (reads model.path's config.json and file sizes)."""
    t, cluster = config.train, config.cluster
    on_gpu = not is_cpu(cluster.gpu_model)
    return FitSettings(
        world_size=world_size(config),
        tokens_per_micro_batch=t.micro_batch_size * t.seq_len,
        activation_checkpointing=t.activation_checkpointing,
        mixed_precision=on_gpu and t.mixed_precision == "bf16",
        on_gpu=on_gpu,
        nodes=cluster.nodes,
        source=checkpoint_source(config),
        export_dtype=export_dtype_name(config),
        loss=t.loss,
        loss_chunk_tokens=t.loss_chunk_tokens,
        eval_tokens_per_micro_batch=validation_tokens_per_micro_batch(config),
        optimizer=t.optimizer,
        replicate=replicate_degree(config),
        expert=expert_degree(config),
        context=context_degree(config),
        seq_len=t.seq_len,
        context_kernel=planned_context_kernel(t.attn_implementation, on_gpu),
    )


def config_fit_estimate(
    config: RunConfig,
    spec: ModelSpec,
    steady: dict[str, int] | None = None,
    meminfo: Path = Path("/proc/meminfo"),
) -> FitEstimate:
    """All phases' terms for this config, with the device budget per rank and the host budget per node.

    Needs no pretokenized data or plan: what the examples' tests and `fit` use.
    """
    device, source = device_memory_bytes(config)
    return fit_estimate(
        spec, fit_settings(config), Budget(device, source, "rank"), host_memory_budget(config, meminfo), steady
    )


def attention_only_suggestion(fit: FitEstimate, config: RunConfig, proof: Collectives | None) -> FitEstimate:
    """`fit` without its parallel.context degrees for a model with recurrent-state layers, which cannot split a row
    (pack refuses it: hf_config.context_refusal), or whose layers transformers cannot tell: suggest no C it would
    refuse."""
    if not fit.context_steady:
        return fit
    try:
        _, layers = model_recurrence(config, proof)
    except Exception:  # noqa: BLE001 - unknown layers: the isolation check names why; suggest nothing here
        layers = ("unknown",)
    return replace(fit, context_steady={}) if layers else fit


def free_bytes_at(path: Path) -> tuple[int, str]:
    """Free space on the filesystem that will hold `path` (its nearest existing ancestor)."""
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free, str(probe)


def run_checks(
    inputs: GateInputs, spec: ModelSpec, terms: dict[str, int], fit: FitEstimate | None = None
) -> list[C.Check]:
    """Every check; `terms` is the steady-state estimate, `fit` all phases (computed from the config if None)."""
    config, plan, packs = inputs.config, inputs.plan, inputs.packs
    stats = plan.stats
    fit = fit or config_fit_estimate(config, spec, terms)
    free, where = free_bytes_at(inputs.checkpoint_dir)
    final_bytes = spec.num_params * DTYPE_BYTES[export_dtype_name(config)]
    # a plan that continues a run on another world size (pack/segments.py): equal steps within its current
    # segment, documents exactly once per epoch over the consumed prefix and the current segment together
    segment_steps = (  # Plan refuses segments without segment_steps
        {int(e): n for e, n in plan.segment_steps.items()} if plan.segments and plan.segment_steps is not None else None
    )
    whole = concat_packs([inputs.prefix, packs]) if inputs.prefix is not None else packs
    mixture = gate_mixture(inputs)
    return [
        C.check_equal_steps(
            packs,
            plan.world_size,
            sorted(segment_steps) if segment_steps else plan.epochs,
            plan.micro_batch_size,
            plan.grad_accum,
            segment_steps or plan.steps_per_epoch,
        ),
        C.check_pack_contents(packs, plan.seq_len, inputs.doc_tokens, inputs.doc_loss_tokens, padding_per_epoch(plan)),
        check_conservation(
            whole,
            plan.epochs,
            Corpus(
                doc_tokens=inputs.doc_tokens,
                manifest_tokens=inputs.manifest.num_tokens,
                doc_loss_tokens=inputs.doc_loss_tokens,
                held_out=inputs.validation.held_out if inputs.validation is not None else None,
            ),
            stats,
            remainder=RemainderPolicy(
                policy=plan.remainder,
                global_batch_packs=plan.world_size * plan.micro_batch_size * plan.grad_accum,
                config_policy=config.pack.remainder,
            ),
            mixture=mixture,
        ),
        C.check_launch(plan, config),
        C.check_provenance(
            plan, inputs.packs_sha256, inputs.manifest_sha256, inputs.manifest, spec.vocab_size, inputs.content
        ),
        check_fit(fit.phases, fit.budgets, config.gate.memory_headroom, fit.mesh, fit.context_steady),
        check_checkpoint_space(checkpoint_bytes(spec), config.train.checkpoint_keep, final_bytes, free, where),
        C.check_balance(
            packs,
            plan.world_size,
            plan.attn_weight,
            config.gate.max_rank_cost_ratio,
            padded_steps_allowed=padding_per_epoch(plan) > 0,
        ),
        check_schedule(plan, config),
        check_segments(plan, config, packs, inputs.prefix, inputs.prefix_problems),
        V.check_validation_steps(
            inputs.validation,
            plan.world_size,
            plan.eval_micro_batch_size or plan.micro_batch_size,
            plan.validation.micro_batches_per_rank if plan.validation is not None else None,
        ),
        V.check_validation_conservation(inputs.validation, inputs.doc_tokens, inputs.manifest.validation, plan.seq_len),
        leakage_with_duplicates(V.check_leakage(inputs.validation, whole), mixture, inputs),
    ] + context_checks(packs, plan, config)


def context_checks(packs, plan: Plan, config: RunConfig) -> list[C.Check]:
    """The context_balance check under parallel.context > 1 (none at 1: the gate's checks as before)."""
    context = config.parallel.context
    if context == 1:
        return []
    kernel = planned_context_kernel(config.train.attn_implementation, not is_cpu(config.cluster.gpu_model))
    bound = config.gate.max_context_cost_ratio
    return [check_context_balance(packs, plan.seq_len, context, bound, kernel == "flex")]


def padding_per_epoch(plan: Plan) -> int:
    """The empty packs an epoch of `plan` may hold: fewer than a step's with one document per row and `rebin` (its
    documents cannot be split to make up the count), else none."""
    if plan.max_documents_per_row == 1 and plan.remainder == "rebin":
        return plan.world_size * plan.micro_batch_size * plan.grad_accum - 1
    return 0


def gate_mixture(inputs: GateInputs) -> MixtureInputs | None:
    """The per-source expectations of a mixture plan (gate/mixture_checks.py), or None for a plain list."""
    held = np.zeros(len(inputs.doc_tokens), dtype=bool)
    if inputs.validation is not None and len(inputs.validation.held_out):
        ids = inputs.validation.held_out
        held[ids[(ids >= 0) & (ids < len(held))]] = True
    return mixture_inputs(inputs.config, inputs.manifest, inputs.plan, inputs.doc_tokens, held)


def leakage_with_duplicates(check: C.Check, mixture: MixtureInputs | None, inputs: GateInputs) -> C.Check:
    """The leakage check, its detail naming documents that appear in two sources of a mixture (counted once)."""
    if mixture is None:
        return check
    note = cross_source_duplicates(mixture, inputs.content_hashes)
    return C.Check(check.name, check.passed, f"{check.detail}; {note}" if note else check.detail)


def collectives_section(
    config: RunConfig, pretokenized: Path, plan_dir: Path, out: Path
) -> tuple[Collectives | None, tuple | None]:
    """gate.json's `collectives` (None with gate.collectives false), and (inputs, proof) for the proof cache when
    a proof ran to its verdict. A proof kept in `out` for the same inputs is reused (gate/proof_reuse.py);
    the proof itself is imported only when it runs: it needs torch."""
    if not config.gate.collectives:
        return None, None
    t0 = time.perf_counter()
    try:
        inputs = R.proof_inputs(config, plan_dir)
    except Exception:  # noqa: BLE001 - no key, no reuse: the proof itself names what is wrong with its inputs
        inputs = None
    kept = R.read_cache(out)
    if inputs is not None and kept is not None and kept.inputs == inputs:
        return R.reused_section(kept, inputs, t0), None
    from wattgate.proof.prove import safe_prove

    # the proof imports torch and transformers: millions of objects the interpreter's last garbage collections
    # at exit would walk (0.4-0.7 s of a 5 s gate on 2 cores); frozen at exit they are skipped, and a
    # process that goes on (tests) is not affected before it ends
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    proof = safe_prove(config, pretokenized, plan_dir)
    if inputs is None:
        return proof, None
    changed = R.changed_inputs(kept.inputs if kept else None, inputs)
    proof = proof.replace(
        changed_inputs=tuple(changed) if changed is not None else None, inputs_sha256=R.inputs_sha256(inputs)
    )
    return proof, ((inputs, proof) if R.reusable(proof) else None)


def counted_spec(config: RunConfig, proof: Collectives | None) -> ModelSpec:
    """The model spec with its parameters counted: from the proof's depth record when the proof got that far (run
    or reused: a rerun imports no torch), else counted here on the meta device. The shape's formula stands only
    when transformers cannot build the model, which the weights check and the proof name."""
    spec = load_model_spec(config)
    if proof is not None and proof.depth is not None and proof.depth.params is not None:
        return spec.with_census(proof.depth.params)
    from wattgate.proof.depth import meta_model
    from wattgate.train.model import param_census

    try:
        return spec.with_census(param_census(meta_model(config.model)))
    except Exception:  # noqa: BLE001 - a model transformers cannot build: named by the checks that build it
        return spec


def gate_report(config: RunConfig, pretokenized: Path, plan_dir: Path, out: Path) -> tuple[GateReport, tuple | None]:
    """Every check and the report on them, and what the proof cache keeps (None: nothing); reads the inputs
    (and a proof kept in --out) and writes nothing."""
    start = time.perf_counter()
    checkpoint_dir = run_folder_beside(out, config.run_name) / "checkpoints"
    inputs = load_inputs(config, pretokenized, plan_dir, checkpoint_dir)
    # the collective proof (wattgate.proof): the trainer dry-run on the fake process group, every rank; first, as
    # its record counts the model's parameters for the memory and cost checks
    proof, keep = collectives_section(config, pretokenized, plan_dir, out)
    spec = counted_spec(config, proof)
    fit = attention_only_suggestion(config_fit_estimate(config, spec), config, proof)
    results = run_checks(inputs, spec, fit.phases[PHASE_STEADY], fit)
    # the tokenizer the export will copy into final/, verified now rather than after the last step
    results.append(check_tokenizer(pretokenized))
    # model.path's weights against the model its config builds (headers only), rather than at train start
    previous = previous_report(out)  # what the last gate here hashed: files not written since keep their hashes
    weights, model_files = with_model_hashes(
        check_weights(config), config, previous.model_files if previous is not None else None
    )
    results.append(weights)
    # the manifest was made from the inputs this config names, as they are now
    sources, source_files = check_sources(config, inputs.manifest, previous.source_files if previous else None)
    results.append(sources)
    # ... and with the pretokenize settings, tokenizer and pack settings it names
    results.append(check_settings(config, inputs.manifest, inputs.plan, pretokenized))
    # what the plan will cost, the budget check on it, and what a hang it would cause would have cost
    cost, budget = cost_section(inputs, spec, next(c for c in results if c.name == "equal_steps"))
    results.append(budget)
    results.append(jobs_check(cost))  # the Slurm jobs the run takes, each stopping gracefully before its limit
    # a layer with a recurrent state (Mamba, linear attention) would carry it from one packed document into the next
    validation_packs = inputs.validation.packs if inputs.validation is not None else None
    every_pack = [p for p in (inputs.packs, validation_packs) if p is not None]
    results.append(check_document_isolation(config, inputs.plan, every_pack, proof))
    if proof is not None:
        results.append(C.Check("collectives", proof.passed, proof.detail))
    report = gate_json(
        results,
        time.perf_counter() - start,
        fit,
        config.gate,
        cost=cost,
        collectives=proof,
        mixture=inputs.plan.mixture,  # gate.md's mixture table
        hashes=InputHashes(
            # the verdict markers name the plan they are about; `wattgate launch` checks them
            plan_sha256=PlanHashes(plan=sha256_file(plan_dir / PLAN), packs=inputs.packs_sha256),
            # ... and the config: the gate's copy (GATED_CONFIG) is what the train job trains
            config_sha256=config_sha256(config),
            # ... and model.path's bytes, which every rank checks again before the first step
            model_files=model_files,
            source_files=source_files,
        ),
    )
    return report, keep


def discard_verdict(out: Path) -> None:
    """Remove the previous run's gate.json, gate.md and markers: they are about another plan or config. The
    kept proof stays: it names the inputs it holds for, and is only reused for those."""
    for name in STAGE_FILES["gate"]:
        if name != PROOF_CACHE:
            (out / name).unlink(missing_ok=True)


def run_gate(config: RunConfig, pretokenized: str | Path, plan_dir: str | Path, out: str | Path) -> GateReport:
    """Run the gate; returns the report (also written to out/gate.json, out/gate.md, out/PASSED).

    Every input is read and every check run before --out is written; a run that stops on an input error
    leaves no verdict there (the previous one would speak for inputs it never saw)."""
    out, pretokenized, plan_dir = Path(out), Path(pretokenized), Path(plan_dir)
    check_output(out, "gate")  # a folder the gate did not write is refused before anything is removed
    try:
        report, keep = gate_report(config, pretokenized, plan_dir, out)
    except BaseException:
        discard_verdict(out)  # a stale marker must never outlive a failed run
        raise
    out = claim_output(out, "gate")
    discard_verdict(out)  # a stale marker must never outlive a new verdict
    write_bytes_atomic(out / GATED_CONFIG, config_bytes(config))  # before the markers that name its hash
    write_report(out, report)
    if keep is not None:
        R.write_cache(out, *keep)
    return report

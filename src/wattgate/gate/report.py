"""gate.json (for tools) and gate.md (for people): the same verdicts, and the memory estimate's terms."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from wattgate.artifacts import write_bytes_atomic
from wattgate.gate.checks import Check
from wattgate.gate.cost import CostSection, cost_markdown
from wattgate.gate.memory import GIB, FitEstimate
from wattgate.gate.mixture_checks import mixture_markdown
from wattgate.records.plan import PlanMixture
from wattgate.records.gate import (
    PHASE_STEADY,
    Collectives,
    GateCheck,
    GateReport,
    MemoryPhase,
    ModelFiles,
    PlanHashes,
    SourceFile,
)
from wattgate.records.run_config import GateConfig
from wattgate.run_files import marker_text, write_gate_report


def phases_json(fit: FitEstimate, headroom: float) -> dict[str, MemoryPhase]:
    """Per phase: its terms and total, the budget it is checked against, and whether it fits (None: unchecked)."""
    out = {}
    for phase, terms in fit.phases.items():
        budget, total = fit.budgets[phase], sum(terms.values())
        usable = None if budget.bytes is None else int(budget.bytes * (1 - headroom))
        out[phase] = MemoryPhase(
            per=budget.per,
            terms_bytes=dict(terms),
            total_bytes=total,
            budget_bytes=budget.bytes,
            usable_bytes=usable,
            budget_source=budget.source,
            headroom=headroom,
            fits=None if usable is None else total <= usable,
            note=fit.notes.get(phase, ""),
        )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class InputHashes:
    """What the verdict holds for, by hash: the plan and its packs (the markers name them; `wattgate launch`
    checks them), the config, model.path's files (every rank checks them again before the first step) and the
    data sources' files (the next gate reuses what is unchanged)."""

    plan_sha256: PlanHashes
    config_sha256: str
    model_files: ModelFiles | None = None
    source_files: dict[str, SourceFile] | None = None


def gate_json(
    checks: list[Check],
    elapsed_s: float,
    fit: FitEstimate,
    settings: GateConfig,
    *,
    cost: CostSection,
    collectives: Collectives | None,
    mixture: PlanMixture | None,
    hashes: InputHashes,
) -> GateReport:
    """gate.json's record: the verdict (passed when every check passed) and checks, the memory estimate against
    the config's headroom, the cost section, the proof, the hashes."""
    return GateReport(
        passed=all(c.passed for c in checks),
        enforce=settings.enforce,
        elapsed_s=round(elapsed_s, 4),
        checks=tuple(GateCheck(name=c.name, passed=c.passed, detail=c.detail) for c in checks),
        memory_estimate_bytes=fit.phases[PHASE_STEADY],  # per rank; readers rely on this name
        memory_estimate_phases=phases_json(fit, settings.memory_headroom),
        forecast=cost.forecast,
        forecast_unavailable=cost.forecast_unavailable,
        failure=cost.failure,
        last_run_wait=cost.last_run_wait,
        mixture=mixture,
        collectives=collectives,
        plan_sha256=hashes.plan_sha256,
        config_sha256=hashes.config_sha256,
        model_files=hashes.model_files,
        source_files=hashes.source_files,
    )


PHASE_TITLES = {
    "load": "Load (device, per rank)",
    "steady": "Steady state (device, per rank)",
    "export": "Export of final/ (device, per rank)",
    "host_per_node": "Host RAM (per node)",
}


def phase_markdown(phase: str, p: MemoryPhase) -> list[str]:
    lines = [f"### {PHASE_TITLES.get(phase, phase)}", ""]
    if p.note:
        lines += [p.note, ""]
    lines += ["| term | GiB |", "|---|---:|"]
    lines += [f"| {name} | {value / GIB:.2f} |" for name, value in p.terms_bytes.items()]
    lines.append(f"| **total** | **{p.total_bytes / GIB:.2f}** |")
    if p.usable_bytes is None:
        lines += ["", f"Budget: {p.budget_source}.", ""]
    else:
        verdict = "fits" if p.fits else "**does not fit**"
        assert p.budget_bytes is not None  # usable_bytes is the budget less the headroom (phases_json)
        lines += [
            "",
            f"Budget: {p.usable_bytes / GIB:.2f} GiB usable per {p.per} "
            f"({p.budget_bytes / GIB:.2f} GiB from {p.budget_source}, {p.headroom:.0%} headroom): "
            f"{verdict}.",
            "",
        ]
    return lines


def gate_markdown(report: GateReport) -> str:
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [f"# Invariant gate: {verdict}", ""]
    if not report.passed and not report.enforce:
        lines += ["> **gate.enforce is false: the run goes ahead despite the failed checks below.**", ""]
    lines += [f"Checked in {report.elapsed_s:.3f} s.", "", "| check | result | detail |", "|---|---|---|"]
    for c in report.checks:
        detail = c.detail.replace("|", "\\|")
        lines.append(f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {detail} |")
    if report.mixture:
        lines += mixture_markdown(report.mixture)
    lines += cost_markdown(CostSection.of(report))
    if report.collectives:
        lines += collectives_markdown(report.collectives)
    lines += ["", "## Memory estimate by phase", ""]
    for phase, p in report.memory_estimate_phases.items():
        lines += phase_markdown(phase, p)
    return "\n".join(lines)


def collectives_markdown(p: Collectives) -> list[str]:
    """The collective proof: the verdict, where ranks diverge, and each step class's fingerprint."""
    lines = ["", "## Collectives (dry run on the fake process group)", "", p.detail, ""]
    reused, changed = p.reused, p.changed_inputs
    if reused:
        lines += [
            f"The proof was reused: the proof of {reused.proved_at} (proved then in "
            f"{reused.proved_s} s) holds for these inputs (wattgate and its source, torch, transformers, "
            f"the model config, the train settings, the GPU model, the world size and every rank's step classes "
            f"are unchanged; inputs sha256 `{p.inputs_sha256}`). Read in {p.elapsed_s:.3f} s.",
            "",
        ]
    elif p.elapsed_s is not None:
        why = f" (rerun: {', '.join(changed)} changed since the kept proof)" if changed else ""
        lines += [f"Proved in {p.elapsed_s:.1f} s for {p.world_size} ranks{why}.", ""]
    if p.depth:
        lines += [f"Depth: {p.proxy_layers} proxy layers of {p.depth.layers} ({p.depth.why}).", ""]
    if p.classes:
        lines += ["| step class | steps | first step | collectives (proxy) | at full depth | fingerprint |"]
        lines += ["|---|---:|---:|---:|---:|---|"]
        for c in p.classes:
            full = c.collectives_at_depth
            lines.append(
                f"| {c.label} | {c.steps} | {c.first_step} | {c.collectives} | "
                f"{full if full is not None else '-'} | `{c.fingerprint}` |"
            )
        for name, part in (("startup", p.startup), ("end", p.end)):
            assert part is not None  # a proof with step classes fingerprints its startup and end (proof/prove.py)
            lines.append(f"\n{name}: {part.collectives} collectives, fingerprint `{part.fingerprint}`")
        for name, what, section in (
            ("stop", "graceful stop at step", p.stop),
            ("resume", "resume from checkpoint step", p.resume),
        ):
            if section:  # the stop path from a dry-run step; the resume from the newest checkpoint
                lines.append(
                    f"\n{name}: {section.collectives} collectives, fingerprint `{section.fingerprint}` "
                    f"({what} {section.step})"
                )
    return lines


def write_report(out: Path, report: GateReport) -> None:
    write_gate_report(out, report)
    write_bytes_atomic(out / "gate.md", gate_markdown(report).encode())
    plan, config = report.plan_sha256, report.config_sha256
    if report.passed:
        write_bytes_atomic(out / "PASSED", marker_text("all gate checks passed; see gate.md", plan, config))
    if not report.enforce:
        # what downstream rules wait on when the user chose to run past the gate
        verdict = "passed" if report.passed else "FAILED"
        line = f"gate {verdict}, not enforced (gate.enforce: false); see gate.md"
        write_bytes_atomic(out / "UNENFORCED", marker_text(line, plan, config))

"""gate.json (for tools) and gate.md (for people): the same verdicts, and the memory estimate's terms."""

from __future__ import annotations

from pathlib import Path

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.gate.checks import GIB, Check


def gate_json(passed: bool, elapsed_s: float, checks: list[Check], estimate: dict, enforce: bool) -> dict:
    return {
        "passed": passed,
        "enforce": enforce,
        "elapsed_s": round(elapsed_s, 4),
        "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in checks],
        "memory_estimate_bytes": estimate,
    }


def gate_markdown(report: dict) -> str:
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [f"# Invariant gate: {verdict}", ""]
    if not report["passed"] and not report["enforce"]:
        lines += ["> **gate.enforce is false: the run goes ahead despite the failed checks below.**", ""]
    lines += [f"Checked in {report['elapsed_s']:.3f} s.", "", "| check | result | detail |", "|---|---|---|"]
    for c in report["checks"]:
        detail = c["detail"].replace("|", "\\|")
        lines.append(f"| {c['name']} | {'pass' if c['passed'] else '**FAIL**'} | {detail} |")
    terms = report["memory_estimate_bytes"]
    lines += ["", "## Memory estimate per rank", "", "| term | GiB |", "|---|---:|"]
    lines += [f"| {name} | {value / GIB:.2f} |" for name, value in terms.items()]
    lines += [f"| **total** | **{sum(terms.values()) / GIB:.2f}** |", ""]
    return "\n".join(lines)


def write_report(out: Path, report: dict) -> None:
    write_json_atomic(out / "gate.json", report)
    write_bytes_atomic(out / "gate.md", gate_markdown(report).encode())
    if report["passed"]:
        write_bytes_atomic(out / "PASSED", b"all gate checks passed; see gate.md\n")
    if not report["enforce"]:
        # what downstream rules wait on when the user chose to run past the gate
        verdict = "passed" if report["passed"] else "FAILED"
        write_bytes_atomic(out / "UNENFORCED", f"gate {verdict}, not enforced (gate.enforce: false); see gate.md\n".encode())

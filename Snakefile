# wattgate: pretokenize -> pack-and-balance -> invariant gate -> FSDP2 train -> power analysis.
# Stages live in workflow/rules/*.smk and call the `wattgate` CLI; see docs/architecture.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/gate.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/telemetry.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/experiments.smk"


rule all:
    default_target: True
    input:
        expand(rules.train.output.trained, run=RUN),
        expand(rules.power_triage.output.triage, run=RUN),
        expand(rules.run_report.output.html, run=RUN),


onstart:
    # the run's config as its stages read it: written as the jobs start, never while the workflow is read
    write_run_config()


onerror:
    # each failed job's one-line cause, last, where Snakemake's blocks (command, log dump, traceback) bury it
    shell("python3 {workflow.basedir}/workflow/scripts/failed_jobs.py {log:q}")

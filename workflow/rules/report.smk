# The run report: summary.json and a self-contained index.html (figures embedded) from the
# traces, the triage, metrics, heartbeats, the gate report and the watcher's verdict. Both are
# registered with `report()`, so `snakemake --report report.zip` carries them too.


rule run_report:
    input:
        trained=rules.train.output.trained,
        triage=rules.power_triage.output.triage,
        gate=rules.invariant_gate.output[0],
    output:
        html=report(
            f"{REPORT_DIR}/index.html", caption="../report/run.rst", category="Run report", labels={"file": "report"}
        ),
        summary=report(
            f"{REPORT_DIR}/summary.json",
            caption="../report/summary.rst",
            category="Run report",
            labels={"file": "summary"},
        ),
    log:
        log_file("run_report"),
    conda:
        WATTGATE_ENV
    resources:
        **cpu_job("small"),
    params:
        config=run_config_path,
        run=lambda wildcards, input: os.path.dirname(input.trained),
        power=lambda wildcards, input: os.path.dirname(input.triage),
        gate=lambda wildcards, input: os.path.dirname(input.gate),
        out=lambda wildcards, output: os.path.dirname(output.html),
    shell:
        "wattgate report --config {params.config:q} --run-dir {params.run:q} --power {params.power:q} --gate {params.gate:q}"
        " --out {params.out:q} 2>&1 | tee {log:q}"

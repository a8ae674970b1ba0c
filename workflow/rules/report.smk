# The run report: summary.json and a self-contained index.html (figures embedded) from the
# traces, the triage, metrics, heartbeats, the gate report and the watcher's verdict. Both are
# registered with `report()`, so `snakemake --report report.zip` carries them too.
REPORT_DIR = f"results/report/{config['run_name']}"


rule run_report:
    input:
        trained=f"{TRAIN_DIR}/TRAINED",
        triage=f"{POWER_DIR}/triage.json",
        gate=gate_result(),
    output:
        html=report(f"{REPORT_DIR}/index.html", caption="../report/run.rst", category="Run report",
                    labels={"file": "report"}),
        summary=report(f"{REPORT_DIR}/summary.json", caption="../report/summary.rst", category="Run report",
                       labels={"file": "summary"}),
    params:
        config=RUN_CONFIG,
        run=lambda wildcards, input: os.path.dirname(input.trained),
        power=lambda wildcards, input: os.path.dirname(input.triage),
        gate=lambda wildcards, input: os.path.dirname(input.gate),
        out=lambda wildcards, output: os.path.dirname(output.html),
    resources:
        **cpu_job("small"),
    conda:
        WATTGATE_ENV
    log:
        f"{REPORT_DIR}/report.log",
    shell:
        "wattgate report --config {params.config:q} --run {params.run:q} --power {params.power:q} --gate {params.gate:q}"
        " --out {params.out:q} 2>&1 | tee {log:q}"

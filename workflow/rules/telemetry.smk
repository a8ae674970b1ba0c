# Power analysis after training: label every GPU's 1 s windows from the node traces the
# samplers wrote beside torchrun, sharpened by the run's heartbeats and metrics. A CPU run's
# traces are empty; the rule still writes its outputs, saying there was no GPU telemetry.
# `snakemake calibrate` measures this cluster's GPU phases (a one-node GPU job) into a triage
# table; point telemetry.table at it to use it.


rule power_triage:
    input:
        trained=rules.train.output.trained,
    output:
        phases=f"{POWER_DIR}/phases.parquet",
        summary=f"{POWER_DIR}/phase_summary.csv",
        triage=f"{POWER_DIR}/triage.json",
    log:
        log_file("power_triage"),
    conda:
        WATTGATE_ENV
    resources:
        **cpu_job("small"),
    params:
        **settings_of("telemetry", "watcher.hang_after_s"),
        config=run_config_path,
        run=lambda wildcards, input: os.path.dirname(input.trained),
        out=lambda wildcards, output: os.path.dirname(output.triage),
    shell:
        "wattgate triage --config {params.config:q} --trace {params.run:q}/telemetry --run-dir {params.run:q}"
        " --out {params.out:q} > {log:q} 2>&1"


rule calibrate:
    output:
        table=CALIBRATION,
        samples=CALIBRATION.replace(".yaml", "-samples.parquet"),
    log:
        CALIBRATION.replace(".yaml", ".log"),
    conda:
        WATTGATE_ENV
    resources:
        **gpu_job(config["cluster"] | {"nodes": 1}),
    params:
        gpu_model=config["cluster"]["gpu_model"],
    shell:
        "wattgate calibrate --gpu-model {params.gpu_model:q} --out {output.table:q}"
        " --samples {output.samples:q} 2>&1 | tee {log:q}"

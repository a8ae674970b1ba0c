# The invariant gate runs on the submit host (no allocation) and must pass
# before any train job exists: the train rule takes gate_result() as input.
# Its report is printed into the Snakemake output, not only the log.


localrules:
    invariant_gate,


rule invariant_gate:
    input:
        pretokenized="results/pretokenized",
        plan="results/plan/plan.json",
        packs="results/plan/packs.parquet",
    output:
        gate_result(),
    params:
        config=RUN_CONFIG,
        settings=[config["gate"], CLUSTER, config["train"], config["model"]],
    conda:
        WATTGATE_ENV
    log:
        "results/gate/gate.log",
    shell:
        "wattgate gate --config {params.config:q} --pretokenized {input.pretokenized:q}"
        " --plan results/plan --out results/gate 2>&1 | tee {log:q}"

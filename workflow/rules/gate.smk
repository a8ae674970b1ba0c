# The invariant gate runs on the submit host (no allocation) and must pass
# before any train job exists: the train rule takes gate_result() as input.
# Its report is printed into the Snakemake output, not only the log.


localrules:
    invariant_gate,


rule invariant_gate:
    input:
        pretokenized=rules.pretokenize.output[0],
        plan=rules.pack_and_balance.output.plan,
        packs=rules.pack_and_balance.output.packs,
    output:
        gate_result(),
        config=gated_config(),
    log:
        f"{GATE_DIR}/gate.log",
    conda:
        WATTGATE_ENV
    params:
        config=RUN_CONFIG,
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        out=lambda wildcards, output: os.path.dirname(output[0]),
        # every section the train job reads from the gate's copy (gated_config()): a change reruns the gate, and
        # the train job sees it only through a new verdict
        settings=[
            config["gate"],
            CLUSTER,
            config["train"],
            config["model"],
            config["watcher"],
            config["telemetry"],
            config["forecast"],
        ],
    shell:
        stage_shell("gate")

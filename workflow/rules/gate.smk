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
    log:
        f"{GATE_DIR}/gate.log",
    conda:
        WATTGATE_ENV
    params:
        config=RUN_CONFIG,
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        out=lambda wildcards, output: os.path.dirname(output[0]),
        settings=[config["gate"], CLUSTER, config["train"], config["model"]],
    shell:
        stage_shell("gate")

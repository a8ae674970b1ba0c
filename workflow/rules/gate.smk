# The invariant gate runs on the submit host (no allocation) and must pass
# before any train job exists: the train rule takes gate_result() as input.
# Its report is printed into the Snakemake output, not only the log.


localrules:
    invariant_gate,


rule invariant_gate:
    input:
        pretokenized=pretokenized_of,
        plan=rules.pack_and_balance.output.plan,
        packs=rules.pack_and_balance.output.packs,
        config=variant_config_input,
    output:
        gate_result(),
        config=gated_config(),
    log:
        log_file("invariant_gate"),
    conda:
        WATTGATE_ENV
    params:
        **settings_of("gate", "cluster", "parallel", "train", "model", "watcher", "telemetry", "forecast"),
        config=run_config_path,
        pretokenized=folder_of,
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        out=lambda wildcards, output: os.path.dirname(output[0]),
        # every section the train job reads from the gate's copy (gated_config()): a change reruns the gate, and
        # the train job sees it only through a new verdict
    shell:
        "wattgate gate --config {params.config:q} --pretokenized {params.pretokenized:q} --plan {params.plan:q}"
        " --out {params.out:q} 2>&1 | tee {log:q}"

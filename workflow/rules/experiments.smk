# Measurement targets: `snakemake scaling` (the train stage at each scaling.world_sizes, same
# global batch, scaling.steps steps) and `snakemake dataio` (shards read in place vs copied to
# node-local scratch). Each variant is a full config written by `wattgate variant`, run through
# the ordinary pack, gate and launch stages under results/<experiment>/<variant>/.
wildcard_constraints:
    experiment="scaling|dataio",
    variant="w[0-9]+|shared|local",


localrules:
    scaling,
    dataio,
    experiment_gate,
    experiment_config,
    experiment_table,


rule experiment_config:
    output:
        f"{VARIANT_DIR}/config.yaml",
    log:
        f"{VARIANT_DIR}/variant.log",
    conda:
        WATTGATE_ENV
    params:
        config=RUN_CONFIG,
        settings=[config["scaling"], config["dataio"], config["train"], CLUSTER, config["model"]],
    shell:
        "wattgate variant --config {params.config:q} --experiment {wildcards.experiment:q}"
        " --variant {wildcards.variant:q} --out {output:q} > {log:q} 2>&1"


# experiment_pack, _gate and _train run the main rules' commands (STAGE_SHELL in common.smk) on the variant's
# config and folders.


rule experiment_pack:
    input:
        config=rules.experiment_config.output[0],
        pretokenized=rules.pretokenize.output[0],
    output:
        plan=f"{VARIANT_DIR}/plan/plan.json",
        packs=f"{VARIANT_DIR}/plan/packs.parquet",
    log:
        f"{VARIANT_DIR}/plan/pack.log",
    conda:
        WATTGATE_ENV
    resources:
        **cpu_job("cpu"),
    params:
        out=lambda wildcards, output: os.path.dirname(output.plan),
    shell:
        stage_shell("pack", config="input.config")


rule experiment_gate:
    input:
        config=rules.experiment_config.output[0],
        pretokenized=rules.pretokenize.output[0],
        plan=rules.experiment_pack.output.plan,
    output:
        gate_result(f"{VARIANT_DIR}/gate"),
        config=gated_config(f"{VARIANT_DIR}/gate"),
    log:
        f"{VARIANT_DIR}/gate/gate.log",
    conda:
        WATTGATE_ENV
    params:
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        out=lambda wildcards, output: os.path.dirname(output[0]),
    shell:
        stage_shell("gate", config="input.config")


rule experiment_train:
    input:
        gate=rules.experiment_gate.output[0],
        gated_config=rules.experiment_gate.output.config,
        pretokenized=rules.pretokenize.output[0],
        plan=rules.experiment_pack.output.plan,
    output:
        trained=f"{VARIANT_DIR}/train/TRAINED",
    log:
        f"{VARIANT_DIR}/train/launch.log",
    retries: TRAIN_RETRIES
    conda:
        WATTGATE_ENV
    threads: lambda wildcards: workflow.cores
    resources:
        **variant_gpu_job(),
    params:
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        run=lambda wildcards, output: os.path.dirname(output.trained),
    shell:
        stage_shell("launch", config="input.gated_config")


rule experiment_table:
    input:
        lambda wildcards: variant_runs(wildcards.experiment),
    output:
        table=report(f"{EXPERIMENT_DIR}/table.csv", caption="../report/experiment.rst", category="Experiments"),
        plot=report(f"{EXPERIMENT_DIR}/plot.png", caption="../report/experiment.rst", category="Experiments"),
    log:
        f"{EXPERIMENT_DIR}/compare.log",
    conda:
        WATTGATE_ENV
    params:
        runs=lambda wildcards, input: [os.path.dirname(os.path.dirname(t)) for t in input],
        out=lambda wildcards, output: os.path.dirname(output.table),
    shell:
        "wattgate compare --experiment {wildcards.experiment:q} --runs {params.runs:q} --out {params.out:q} 2>&1 | tee {log:q}"


rule scaling:
    input:
        expand(rules.experiment_table.output.table, experiment="scaling"),


rule dataio:
    input:
        expand(rules.experiment_table.output.table, experiment="dataio"),

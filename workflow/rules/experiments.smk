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


rule scaling:
    input:
        "results/scaling/table.csv",


rule dataio:
    input:
        "results/dataio/table.csv",


rule experiment_config:
    output:
        "results/{experiment}/{variant}/config.yaml",
    params:
        config=RUN_CONFIG,
        settings=[config["scaling"], config["dataio"], config["train"], CLUSTER, config["model"]],
    conda:
        WATTGATE_ENV
    log:
        "results/{experiment}/{variant}/variant.log",
    shell:
        "wattgate variant --config {params.config:q} --experiment {wildcards.experiment:q}"
        " --variant {wildcards.variant:q} --out {output:q} > {log:q} 2>&1"


rule experiment_pack:
    input:
        config="results/{experiment}/{variant}/config.yaml",
        pretokenized="results/pretokenized",
    output:
        plan="results/{experiment}/{variant}/plan/plan.json",
        packs="results/{experiment}/{variant}/plan/packs.parquet",
    params:
        out=lambda wildcards, output: os.path.dirname(output.plan),
    resources:
        **cpu_job("cpu"),
    conda:
        WATTGATE_ENV
    log:
        "results/{experiment}/{variant}/plan/pack.log",
    shell:
        "wattgate pack --config {input.config:q} --pretokenized {input.pretokenized:q} --out {params.out:q} > {log:q} 2>&1"


rule experiment_gate:
    input:
        config="results/{experiment}/{variant}/config.yaml",
        pretokenized="results/pretokenized",
        plan="results/{experiment}/{variant}/plan/plan.json",
    output:
        gate_result("results/{experiment}/{variant}/gate"),
    params:
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        out=lambda wildcards, output: os.path.dirname(output[0]),
    conda:
        WATTGATE_ENV
    log:
        "results/{experiment}/{variant}/gate/gate.log",
    shell:
        "wattgate gate --config {input.config:q} --pretokenized {input.pretokenized:q} --plan {params.plan:q}"
        " --out {params.out:q} 2>&1 | tee {log:q}"


rule experiment_train:
    input:
        config="results/{experiment}/{variant}/config.yaml",
        gate=gate_result("results/{experiment}/{variant}/gate"),
        pretokenized="results/pretokenized",
        plan="results/{experiment}/{variant}/plan/plan.json",
    output:
        trained="results/{experiment}/{variant}/train/TRAINED",
    params:
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        out=lambda wildcards, output: os.path.dirname(output.trained),
    threads: lambda wildcards: workflow.cores
    resources:
        **variant_gpu_job(),
    conda:
        WATTGATE_ENV
    log:
        "results/{experiment}/{variant}/train/train.log",
    shell:
        "wattgate launch --config {input.config:q} --pretokenized {input.pretokenized:q} --plan {params.plan:q}"
        " --out {params.out:q} 2>&1 | tee {log:q}"


rule experiment_table:
    input:
        lambda wildcards: variant_runs(wildcards.experiment),
    output:
        table=report("results/{experiment}/table.csv", caption="../report/experiment.rst", category="Experiments"),
        plot=report("results/{experiment}/plot.png", caption="../report/experiment.rst", category="Experiments"),
    params:
        runs=lambda wildcards, input: [os.path.dirname(os.path.dirname(t)) for t in input],
        out=lambda wildcards, output: os.path.dirname(output.table),
    conda:
        WATTGATE_ENV
    log:
        "results/{experiment}/compare.log",
    shell:
        "wattgate compare --experiment {wildcards.experiment:q} --runs {params.runs:q} --out {params.out:q} 2>&1 | tee {log:q}"

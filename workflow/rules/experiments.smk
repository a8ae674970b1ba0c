# Measurement targets: `snakemake scaling` (the train stage at each scaling.world_sizes, same
# global batch, scaling.steps steps) and `snakemake dataio` (shards read in place vs copied to
# node-local scratch). Each variant is a run of its own, <run_name>-<target>-<variant> (VARIANTS in common.smk), whose
# config `wattgate variant` writes: the ordinary pack, gate and train rules run it under results/<stage>/<run>/,
# on the run's own pretokenized corpus; `wattgate compare` tables the finished runs in results/<target>/<run_name>/.
wildcard_constraints:
    experiment="scaling|dataio",


localrules:
    scaling,
    dataio,
    variant_config,
    experiment_table,


rule variant_config:
    output:
        f"{RESULTS}/config/{{run}}.yaml",
    log:
        log_file("variant_config"),
    wildcard_constraints:
        run="|".join(re.escape(run) for run in VARIANTS) or "(?!)",
    conda:
        WATTGATE_ENV
    params:
        **settings_of("scaling", "dataio", "train", "cluster", "model"),
        config=RUN_CONFIG,
        experiment=lambda wildcards: VARIANTS[wildcards.run][0],
        variant=lambda wildcards: VARIANTS[wildcards.run][1],
    shell:
        "wattgate variant --config {params.config:q} --experiment {params.experiment:q}"
        " --variant {params.variant:q} --out {output:q} > {log:q} 2>&1"


rule experiment_table:
    input:
        variant_runs,
    output:
        table=report(f"{EXPERIMENT_DIR}/table.csv", caption="../report/experiment.rst", category="Experiments"),
        plot=report(f"{EXPERIMENT_DIR}/plot.png", caption="../report/experiment.rst", category="Experiments"),
    log:
        "logs/experiment_table/{experiment}-{run}.log",
    conda:
        WATTGATE_ENV
    params:
        runs=lambda wildcards, input: [os.path.dirname(t) for t in input],
        out=lambda wildcards, output: os.path.dirname(output.table),
    shell:
        "wattgate compare --experiment {wildcards.experiment:q} --runs {params.runs:q} --out {params.out:q} 2>&1 | tee {log:q}"


rule scaling:
    input:
        expand(rules.experiment_table.output.table, experiment="scaling", run=RUN),


rule dataio:
    input:
        expand(rules.experiment_table.output.table, experiment="dataio", run=RUN),

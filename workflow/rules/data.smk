# Data stages: demo corpus -> tokenizer -> pretokenize -> pack-and-balance.
# `params.settings` holds the config sections each stage reads, so Snakemake's
# params trigger reruns exactly the stages whose settings changed.
# On Slurm the demo corpus and the tokenizer (seconds each) run on the submit host; pretokenize and
# pack are one-node CPU jobs.

from wattgate.config import input_paths  # data.inputs as paths (mixture sources are mappings)


localrules:
    demo_corpus,
    demo_notes,
    train_tokenizer,


rule demo_corpus:
    output:
        f"{CORPUS_DIR}/demo.jsonl",
    log:
        f"{CORPUS_DIR}/demo_corpus.log",
    benchmark:
        f"{CORPUS_DIR}/demo_corpus.benchmark.tsv"
    conda:
        WATTGATE_ENV
    params:
        config=RUN_CONFIG,
        settings=config["demo_corpus"],
    shell:
        "wattgate demo-corpus --config {params.config:q} --out {output:q} > {log:q} 2>&1"


# the embedded default's second source (a two-source mixture): generated plain-text notes
rule demo_notes:
    output:
        f"{CORPUS_DIR}/demo-notes.jsonl",
    log:
        f"{CORPUS_DIR}/demo_notes.log",
    benchmark:
        f"{CORPUS_DIR}/demo_notes.benchmark.tsv"
    conda:
        WATTGATE_ENV
    params:
        config=RUN_CONFIG,
        settings=config["demo_corpus"],
    shell:
        "wattgate demo-corpus --kind notes --config {params.config:q} --out {output:q} > {log:q} 2>&1"


rule train_tokenizer:
    input:
        input_paths(config),
    output:
        directory(TOKENIZER_DIR),
    log:
        f"{RESULTS}/train_tokenizer.log",
    benchmark:
        f"{RESULTS}/train_tokenizer.benchmark.tsv"
    conda:
        WATTGATE_ENV
    params:
        config=RUN_CONFIG,
        settings=config["tokenizer"],
    shell:
        "wattgate train-tokenizer --config {params.config:q} --corpus {input:q} --out {output:q} > {log:q} 2>&1"


rule pretokenize:
    input:
        # the held-out files (data.validation.inputs) are read beside the corpus
        corpus=input_paths(config) + config["data"]["validation"]["inputs"],
        # a local tokenizer folder from config, else the one train_tokenizer makes
        tokenizer=config["tokenizer"]["path"] or rules.train_tokenizer.output[0],
    output:
        directory(PRETOKENIZED_DIR),
    log:
        f"{RESULTS}/pretokenize.log",
    benchmark:
        f"{RESULTS}/pretokenize.benchmark.tsv"
    conda:
        WATTGATE_ENV
    threads: 2
    resources:
        **cpu_job("cpu"),
    params:
        config=RUN_CONFIG,
        settings=[config["data"], config["pretokenize"], config["train"]["seq_len"]],
    shell:
        "wattgate pretokenize --config {params.config:q} --tokenizer {input.tokenizer:q} --out {output:q}"
        " > {log:q} 2>&1"


rule pack_and_balance:
    input:
        pretokenized=rules.pretokenize.output[0],
    output:
        plan=f"{PLAN_DIR}/plan.json",
        packs=f"{PLAN_DIR}/packs.parquet",
    log:
        f"{PLAN_DIR}/pack.log",
    benchmark:
        f"{PLAN_DIR}/pack.benchmark.tsv"
    conda:
        WATTGATE_ENV
    resources:
        **cpu_job("cpu"),
    params:
        config=RUN_CONFIG,
        out=lambda wildcards, output: os.path.dirname(output.plan),
        # only what the plan is made of: a learning rate or checkpoint cadence change reruns the gate, not pack
        settings=[config["pack"], pack_train_settings(), CLUSTER, config["data"]["max_repeats"]],
    shell:
        stage_shell("pack")

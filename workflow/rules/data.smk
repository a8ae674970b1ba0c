# Data stages: demo corpus -> tokenizer -> pretokenize -> pack-and-balance.
# `params.settings` holds the config sections each stage reads, so Snakemake's
# params trigger reruns exactly the stages whose settings changed.
# On Slurm the demo corpus and the tokenizer (seconds each) run on the submit host; pretokenize and
# pack are one-node CPU jobs.


localrules:
    demo_corpus,
    train_tokenizer,


rule demo_corpus:
    output:
        "results/corpus/demo.jsonl",
    params:
        config=RUN_CONFIG,
        settings=config["demo_corpus"],
    conda:
        WATTGATE_ENV
    log:
        "results/corpus/demo_corpus.log",
    benchmark:
        "results/corpus/demo_corpus.benchmark.tsv"
    shell:
        "wattgate demo-corpus --config {params.config:q} --out {output:q} > {log:q} 2>&1"


rule train_tokenizer:
    input:
        config["data"]["inputs"],
    output:
        directory("results/tokenizer"),
    params:
        config=RUN_CONFIG,
        settings=config["tokenizer"],
    conda:
        WATTGATE_ENV
    log:
        "results/train_tokenizer.log",
    benchmark:
        "results/train_tokenizer.benchmark.tsv"
    shell:
        "wattgate train-tokenizer --config {params.config:q} --corpus {input:q} --out {output:q} > {log:q} 2>&1"


rule pretokenize:
    input:
        corpus=config["data"]["inputs"],
        tokenizer=tokenizer_dir(),
    output:
        directory("results/pretokenized"),
    params:
        config=RUN_CONFIG,
        settings=[config["data"], config["pretokenize"], config["train"]["seq_len"]],
    conda:
        WATTGATE_ENV
    log:
        "results/pretokenize.log",
    benchmark:
        "results/pretokenize.benchmark.tsv"
    threads: 2
    resources:
        **cpu_job("cpu"),
    shell:
        "wattgate pretokenize --config {params.config:q} --tokenizer {input.tokenizer:q} --out {output:q}"
        " > {log:q} 2>&1"


rule pack_and_balance:
    input:
        "results/pretokenized",
    output:
        plan="results/plan/plan.json",
        packs="results/plan/packs.parquet",
    params:
        config=RUN_CONFIG,
        settings=[config["pack"], config["train"], CLUSTER],
    conda:
        WATTGATE_ENV
    log:
        "results/plan/pack.log",
    benchmark:
        "results/plan/pack.benchmark.tsv"
    resources:
        **cpu_job("cpu"),
    shell:
        "wattgate pack --config {params.config:q} --pretokenized {input:q} --out results/plan > {log:q} 2>&1"

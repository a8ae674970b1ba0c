# Data stages: demo corpus -> tokenizer -> pretokenize -> pack-and-balance, each under results/<stage>/<run>/.
# Each rule's settings params hold the config settings its stage reads (settings_of in common.smk), so Snakemake's
# params trigger reruns exactly the stages whose settings changed.
# On Slurm the demo corpus and the tokenizer (seconds each) run on the submit host; pretokenize and
# pack are one-node CPU jobs.

from wattgate.config import input_paths  # data.inputs as paths (mixture sources are mappings)


# {run}: this config's run_name, or one of its measurement variants (VARIANTS in common.smk)
wildcard_constraints:
    run="|".join(re.escape(run) for run in [RUN, *VARIANTS]),


localrules:
    demo_corpus,
    demo_notes,
    train_tokenizer,


# the corpus files are named by data.inputs itself (results/corpus/demo.jsonl in the embedded default), not by run
rule demo_corpus:
    output:
        f"{CORPUS_DIR}/demo.jsonl",
    log:
        "logs/demo_corpus.log",
    benchmark:
        "logs/demo_corpus.benchmark.tsv"
    conda:
        WATTGATE_ENV
    params:
        **settings_of("demo_corpus"),
        # a function of the output: not a setting, so another run's config file (another path) reruns nothing;
        # the corpus reads only demo_corpus.*, which settings_of holds
        config=lambda wildcards, output: RUN_CONFIG,
    shell:
        "wattgate demo-corpus --config {params.config:q} --out {output:q} > {log:q} 2>&1"


# the embedded default's second source (a two-source mixture): generated plain-text notes
rule demo_notes:
    output:
        f"{CORPUS_DIR}/demo-notes.jsonl",
    log:
        "logs/demo_notes.log",
    benchmark:
        "logs/demo_notes.benchmark.tsv"
    conda:
        WATTGATE_ENV
    params:
        **settings_of("demo_corpus"),
        # a function of the output: not a setting, so another run's config file (another path) reruns nothing;
        # the corpus reads only demo_corpus.*, which settings_of holds
        config=lambda wildcards, output: RUN_CONFIG,
    shell:
        "wattgate demo-corpus --kind notes --config {params.config:q} --out {output:q} > {log:q} 2>&1"


rule train_tokenizer:
    input:
        input_paths(TYPED_CONFIG.data),
    output:
        TOKENIZER_FILE,
    log:
        log_file("train_tokenizer"),
    benchmark:
        log_file("train_tokenizer", "benchmark.tsv")
    conda:
        WATTGATE_ENV
    params:
        **settings_of("tokenizer", "data"),
        config=run_config_path,
        out=lambda wildcards, output: os.path.dirname(output[0]),
    shell:
        "wattgate train-tokenizer --config {params.config:q} --corpus {input:q} --out {params.out:q} > {log:q} 2>&1"


rule pretokenize:
    input:
        # the held-out files (data.validation.inputs) are read beside the corpus
        corpus=input_paths(TYPED_CONFIG.data) + config["data"]["validation"]["inputs"],
        # a local tokenizer folder from config, else the one train_tokenizer makes
        tokenizer=config["tokenizer"]["path"] or TOKENIZER_FILE,
    output:
        MANIFEST_FILE,
    log:
        log_file("pretokenize"),
    benchmark:
        log_file("pretokenize", "benchmark.tsv")
    conda:
        WATTGATE_ENV
    threads: 2
    resources:
        **cpu_job("cpu"),
    params:
        **settings_of("data", "pretokenize", "train.seq_len"),
        config=run_config_path,
        tokenizer=lambda wildcards, input: config["tokenizer"]["path"] or os.path.dirname(input.tokenizer),
        out=lambda wildcards, output: os.path.dirname(output[0]),
    shell:
        "wattgate pretokenize --config {params.config:q} --tokenizer {params.tokenizer:q} --out {params.out:q}"
        " > {log:q} 2>&1"


rule pack_and_balance:
    input:
        pretokenized=pretokenized_of,
        config=variant_config_input,
    output:
        plan=f"{PLAN_DIR}/plan.json",
        packs=f"{PLAN_DIR}/packs.parquet",
    log:
        log_file("pack_and_balance"),
    benchmark:
        log_file("pack_and_balance", "benchmark.tsv")
    conda:
        WATTGATE_ENV
    resources:
        **cpu_job("cpu"),
    params:
        # parallel.context: the plan is made for the data-parallel ranks, world / C
        **settings_of("pack", *PACK_TRAIN_KEYS, "cluster", "data.max_repeats", "parallel.context", *PACK_MODEL_KEYS),
        config=run_config_path,
        pretokenized=folder_of,
        out=lambda wildcards, output: os.path.dirname(output.plan),
        # only what the plan is made of: a learning rate or checkpoint cadence change reruns the gate, not pack
    shell:
        "wattgate pack --config {params.config:q} --pretokenized {params.pretokenized:q} --out {params.out:q}"
        " > {log:q} 2>&1"

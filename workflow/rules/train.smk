# Train: waits on the gate's verdict, so a failed gate means no train job is ever submitted.
# `wattgate launch` builds the torchrun (or srun + torchrun) command; rerunning after a kill
# resumes from the newest complete checkpoint. Only TRAINED is declared: metrics, heartbeats
# and checkpoints of a failed run stay on disk for the watcher and the report.
# On Slurm it is one job of cluster.nodes nodes (see gpu_job in common.smk).
import os


rule train:
    input:
        gate=gate_result(),
        pretokenized="results/pretokenized",
        plan="results/plan/plan.json",
        packs="results/plan/packs.parquet",
    output:
        trained=f"{TRAIN_DIR}/TRAINED",
    params:
        config=RUN_CONFIG,
        out=lambda wildcards, output: os.path.dirname(output.trained),
        settings=[config["train"], config["model"], CLUSTER],
    threads: lambda wildcards: workflow.cores
    resources:
        **gpu_job(config["cluster"]),
    conda:
        WATTGATE_ENV
    log:
        f"{TRAIN_DIR}/train.log",
    shell:
        "wattgate launch --config {params.config:q} --pretokenized {input.pretokenized:q} --plan results/plan"
        " --out {params.out:q} 2>&1 | tee {log:q}"

# Train: waits on the gate's verdict, so a failed gate means no train job is ever submitted, and trains the
# config the gate checked (its copy, gated_config()), never results/config.yaml as it may be by then.
# `wattgate launch` builds the torchrun (or srun + torchrun) command; rerunning after a kill
# resumes from the newest complete checkpoint. Only TRAINED is declared: metrics, heartbeats
# and checkpoints of a failed run stay on disk for the watcher and the report.
# On Slurm it is one job of cluster.nodes nodes (see gpu_job in common.smk).
rule train:
    input:
        gate=rules.invariant_gate.output[0],
        gated_config=rules.invariant_gate.output.config,
        pretokenized=rules.pretokenize.output[0],
        plan=rules.pack_and_balance.output.plan,
        packs=rules.pack_and_balance.output.packs,
    output:
        trained=f"{TRAIN_DIR}/TRAINED",
    log:
        f"{TRAIN_DIR}/launch.log",  # Snakemake's; launch writes train.log and train.attempts.log itself
    # a job stopped at its time limit (exit 75) or killed is submitted again and resumes from the newest verified
    # checkpoint; launch refuses a retry of a failure a rerun would repeat (docs/slurm.md)
    retries: TRAIN_RETRIES
    conda:
        WATTGATE_ENV
    threads: lambda wildcards: workflow.cores
    resources:
        **gpu_job(config["cluster"]),
        attempt=snakemake_attempt,
    params:
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        run=lambda wildcards, output: os.path.dirname(output.trained),
        settings=[config["train"], config["model"], CLUSTER],
    shell:
        stage_shell("launch", config="input.gated_config")

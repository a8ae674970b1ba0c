# Train: waits on the gate's verdict, so a failed gate means no train job is ever submitted, and trains the
# config the gate checked (its copy, gated_config()), never results/config/<run>.yaml as it may be by then.
# `wattgate launch` builds the torchrun (or srun + torchrun) command; rerunning after a kill
# resumes from the newest complete checkpoint. Only TRAINED is declared: metrics, heartbeats
# and checkpoints of a failed run stay on disk for the watcher and the report.
# On Slurm it is one job of cluster.nodes nodes (see gpu_job in common.smk).
rule train:
    input:
        gate=rules.invariant_gate.output[0],
        gated_config=rules.invariant_gate.output.config,
        pretokenized=pretokenized_of,
        plan=rules.pack_and_balance.output.plan,
        packs=rules.pack_and_balance.output.packs,
    output:
        trained=f"{TRAIN_DIR}/TRAINED",
    log:
        # this job's output; each job of the run also keeps its own, logs/train/<run>.job-<n>.log (n = 1, 2, ... over
        # retries and later invocations), so a failed try's log is never overwritten by the next. launch writes the
        # run folder's train.log (this attempt) and train.attempts.log (every attempt)
        log_file("train"),
    # a job stopped at its time limit (exit 75) or killed is submitted again and resumes from the newest verified
    # checkpoint; launch refuses a retry of a failure a rerun would repeat (docs/slurm.md)
    retries: TRAIN_RETRIES
    conda:
        WATTGATE_ENV
    threads: lambda wildcards: workflow.cores
    resources:
        **run_gpu_job(),
    params:
        **settings_of("train", "model", "cluster", "parallel"),
        pretokenized=folder_of,
        plan=lambda wildcards, input: os.path.dirname(input.plan),
        gate=lambda wildcards, input: os.path.dirname(input.gate),
        run=lambda wildcards, output: os.path.dirname(output.trained),
    # The shell and tee ignore the stop signals (inherited: tee has no handler): scancel and preemption signal every
    # process, and a tee killed mid-run would break every rank's stdout; launch turns them into a graceful stop.
    shell:
        'log={log:q}; n=1; while [ -e "${{log%.log}}.job-$n.log" ]; do n=$((n + 1)); done;'
        " trap '' TERM INT USR1; wattgate launch --config {input.gated_config:q} --pretokenized {params.pretokenized:q}"
        " --plan {params.plan:q} --gate {params.gate:q} --run-dir {params.run:q} --attempt {resources.attempt}"
        ' 2>&1 | tee "$log" "${{log%.log}}.job-$n.log"'

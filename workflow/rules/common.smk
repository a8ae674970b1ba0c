# Shared wiring: the config validated (one line naming a bad key) and written, defaults filled, for the CLI
# stages, so a stage run by Snakemake and by hand reads the same settings.
# Every value pasted into a rule's shell is quoted (`{input:q}`, `{params.x:q}`, ...; `:q` quotes
# each item of a list on its own): config paths may hold spaces, and nothing in a config value may
# run as shell code. Strings built here for a shell use shlex.quote.
import functools
import os
import shlex

from wattgate.config import check_config_files, dump_resolved, numbers_as_written, validate_config
from wattgate.errors import InputError
from wattgate.experiments import variant_config, variant_names

# --- paths: the one home of each stage's folder. Rules name their files under these; a rule that reads
# another stage's files takes them from that rule's outputs (`rules.pack_and_balance.output.plan`), and a
# folder passed to a shell is derived from the rule's own inputs/outputs in its params.
RESULTS = "results"
try:
    # the config files read as the CLI reads them, then the CLI's validation (defaults filled in place): one line
    # naming the key, where Snakemake's `validate` printed the whole schema (~360 lines). SystemExit is the one
    # exception Snakemake prints as its message alone.
    check_config_files(workflow.configfiles)
    numbers_as_written(config, workflow.configfiles)  # 1.0e9 is a number, as in the CLI (YAML 1.1 says string)
    validate_config(config, f"config ({', '.join(map(str, workflow.configfiles))})")
except InputError as exc:
    raise SystemExit(f"wattgate: {exc}") from None


@functools.cache
def invocation():
    """Snakemake's own reading of its command line, its profiles applied (None for an API call): Snakemake tells a
    Snakefile neither -n nor the executor while it is read (workflow.dryrun is False then). Read once a parse."""
    import contextlib
    import io
    import sys

    try:
        from snakemake.cli import parse_args

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return parse_args(sys.argv[1:])[1]
    except (Exception, SystemExit):
        return None


def dry_run():
    """Whether this invocation is `snakemake -n`."""
    args = invocation()
    return bool(args is not None and args.dryrun)


def check_slurm_host():
    """`--profile slurm` (the slurm executor) on a host without Slurm's commands: one line now, in -n too, where the
    executor failed after its first status check (45 s) naming sacct."""
    import shutil

    args = invocation()
    if args is None or getattr(args, "executor", None) != "slurm":
        return
    status = getattr(args, "slurm_status_command", None)
    status = status if isinstance(status, str) and status.strip() else "sacct"  # the plugin's default
    missing = [cmd for cmd in ("sbatch", status.split()[0]) if shutil.which(cmd) is None]
    if missing:
        raise SystemExit(
            f"wattgate: the slurm executor (--profile slurm) needs {' and '.join(missing)}, not found on this host's "
            "PATH: run from a Slurm login node, or run locally with plain `snakemake`"
            + ("; without slurmdbd set `slurm-status-command: squeue` in the profile" if "sacct" in missing else "")
        )


check_slurm_host()


# a dry run (`snakemake -n --configfile other.yaml`) leaves it as it is: a queued job reads this file when it starts
RUN_CONFIG = dump_resolved(config, f"{RESULTS}/config.yaml", write=not dry_run())
CORPUS_DIR = f"{RESULTS}/corpus"
TOKENIZER_DIR = f"{RESULTS}/tokenizer"
PRETOKENIZED_DIR = f"{RESULTS}/pretokenized"
PLAN_DIR = f"{RESULTS}/plan"
GATE_DIR = f"{RESULTS}/gate"
TRAIN_DIR = f"{RESULTS}/train/{config['run_name']}"
POWER_DIR = f"{RESULTS}/power/{config['run_name']}"
REPORT_DIR = f"{RESULTS}/report/{config['run_name']}"
CALIBRATION = f"{RESULTS}/calibrate/{config['cluster']['gpu_model'].lower()}.yaml"
# measurement targets (experiments.smk): one folder per experiment, one per variant inside it
EXPERIMENT_DIR = f"{RESULTS}/{{experiment}}"
VARIANT_DIR = f"{EXPERIMENT_DIR}/{{variant}}"

# the cluster settings results depend on, for params-triggered reruns: where jobs queue does not count
CLUSTER = {key: value for key, value in config["cluster"].items() if key != "slurm"}
# the train settings a plan is made of (wattgate.pack): pack reruns on these alone
PACK_TRAIN_KEYS = ("seq_len", "micro_batch_size", "grad_accum", "epochs", "eval_micro_batch_size")


def pack_train_settings():
    return {key: config["train"].get(key) for key in PACK_TRAIN_KEYS}


# Used only with --sw-deployment-method conda; otherwise rules run in the
# current environment (the .venv that `make` creates). Relative to this file.
WATTGATE_ENV = "../envs/wattgate.yaml"


# --- stage commands run both by a main rule (pack_and_balance, invariant_gate, train) and by its experiment_*
# twin, written once, so a flag added to a stage is added here. `{config:q}` is the config file the stage
# reads, filled in by stage_shell(): the main rules pass the resolved run config (params.config), the
# experiment rules their variant's config (input.config, made by experiment_config). Every other value comes
# quoted from the rule's own input, params and log.
STAGE_SHELL = {
    "pack": "wattgate pack --config {config:q} --pretokenized {input.pretokenized:q} --out {params.out:q} > {log:q} 2>&1",
    "gate": (
        "wattgate gate --config {config:q} --pretokenized {input.pretokenized:q} --plan {params.plan:q}"
        " --out {params.out:q} 2>&1 | tee {log:q}"
    ),
    # launch writes the run folder's train.log and train.attempts.log itself (train/run_log.py): Snakemake deletes a
    # rule's log before each job, also the log of a trainer still running when a second launch is refused.
    # The shell and tee ignore the stop signals (inherited: tee has no handler): scancel and preemption signal every
    # process, and a tee killed mid-run would break every rank's stdout; launch turns them into a graceful stop.
    "launch": (
        "trap '' TERM INT USR1; wattgate launch --config {config:q} --pretokenized {input.pretokenized:q}"
        " --plan {params.plan:q} --run-dir {params.run:q} --attempt {resources.attempt} 2>&1 | tee {log:q}"
    ),
}


def stage_shell(stage, config="params.config"):
    """STAGE_SHELL[stage] reading the config file the rule names as `config` (params.config or input.config)."""
    return STAGE_SHELL[stage].replace("{config:q}", "{%s:q}" % config)


def gated_config(gate_dir=GATE_DIR):
    """The gate's own copy of the config it checked: the train job trains exactly this one, so a later
    invocation with another config (even `-n`) never changes what a queued train job trains."""
    return f"{gate_dir}/config.yaml"


def gate_result(gate_dir=GATE_DIR):
    """What downstream rules wait on: a pass, or (gate.enforce: false, on purpose) any verdict."""
    return f"{gate_dir}/PASSED" if config["gate"]["enforce"] else f"{gate_dir}/UNENFORCED"


def variant_runs(experiment):
    """The finished train runs of one measurement target (`scaling` or `dataio`): experiment_train's
    output per variant (called when the DAG is built, after experiments.smk defined that rule)."""
    return expand(
        rules.experiment_train.output.trained,
        experiment=experiment,
        variant=variant_names(config, experiment),
    )


# Slurm job resources (read by `snakemake --profile slurm`, ignored by local runs), all from
# cluster.slurm so a cluster is described in the config. Keys are only set when they have a value,
# so the profile's default-resources fill the rest.
SLURM = config["cluster"]["slurm"]


def _slurm_placement(partition):
    placed = {}
    if partition:
        placed["slurm_partition"] = partition
    if SLURM["account"]:
        placed["slurm_account"] = SLURM["account"]
    return placed


def cpu_job(kind):
    """One-node CPU job: 'cpu' (pretokenize, pack) or 'small' (triage, report)."""
    s = SLURM[kind]
    return dict(
        cpus_per_task=s["cpus"],
        mem_mb=s["mem_mb"],
        runtime=s["runtime_min"],
        **_slurm_placement(SLURM["cpu_partition"] or SLURM["partition"]),
    )


def gpu_job(cluster):
    """The train (or calibrate) job: cluster["nodes"] nodes, one launcher task per node holding the
    node's CPUs and GPUs. Multi-node jobs are `mpi` jobs: the jobstep then runs the rule's shell once,
    on the first node, and `wattgate launch` starts one srun task per node itself; a one-node job
    runs inside the jobstep's own srun step and launches torchrun locally (the plugin refuses mpi
    with a single task)."""
    nodes, gpu = cluster["nodes"], cluster["gpu_model"].lower() != "cpu"
    res = dict(
        nodes=nodes,
        cpus_per_task=cluster["cpus_per_node"] or cluster["gpus_per_node"],
        runtime=SLURM["train"]["runtime_min"],
        mem_mb=SLURM["train"]["mem_mb"],
        **_slurm_placement(SLURM["partition"]),
    )
    if nodes > 1:
        res.update(tasks=nodes, mpi="srun")
    if gpu:
        # per-node GPUs as GRES; tasks_per_gpu=0 keeps the plugin from adding --ntasks-per-gpu
        # (which would start the launcher once per GPU)
        res.update(gres=SLURM["gres"] or f"gpu:{cluster['gpus_per_node']}", tasks_per_gpu=0)
    if SLURM["extra"]:
        res["slurm_extra"] = sbatch_flags(SLURM["extra"])
    return res


def sbatch_flags(extra):
    """cluster.slurm.extra as sbatch words the executor can paste into its `sbatch ...` shell line:
    split like a shell would (quotes group), each word shlex-quoted, so the value stays raw flags
    (`--exclusive --exclude=gpu[01-02]`) but nothing in it expands or runs. The schema pattern
    already rejects shell metacharacters outside single quotes."""
    return " ".join(shlex.quote(word) for word in shlex.split(extra))


def variant_gpu_job():
    """gpu_job() of each measurement variant's own cluster section (its node count differs)."""

    def key(name):
        return lambda wildcards: gpu_job(
            variant_config(config, wildcards.experiment, wildcards.variant).cluster.to_json()
        ).get(name)

    names = [
        "nodes",
        "tasks",
        "mpi",
        "cpus_per_task",
        "runtime",
        "mem_mb",
        "gres",
        "tasks_per_gpu",
        "slurm_partition",
        "slurm_account",
        "slurm_extra",
    ]
    return {name: key(name) for name in names} | {"attempt": snakemake_attempt}


# A train job stopped at its time limit, or killed, is submitted again (cluster.slurm.train.max_jobs jobs in all) and
# resumes from the newest verified checkpoint. Not inside a Slurm job: there Snakemake's jobstep would retry in what
# is left of the same allocation, after the stop that made room for the checkpoint, with no time for another.
TRAIN_RETRIES = 0 if os.environ.get("SLURM_JOB_ID") else config["cluster"]["slurm"]["train"]["max_jobs"] - 1


def snakemake_attempt(wildcards, attempt):
    """The train job's try (1, then 2, 3, ... on retries): `wattgate launch --attempt` ends a retry at once when the
    previous try failed in a way a retry repeats (train/attempts.py). Not a Slurm resource: the executor ignores it."""
    return attempt

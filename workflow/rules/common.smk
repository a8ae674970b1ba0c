# Shared wiring: the config validated (one line naming a bad key) and written, defaults filled, for the CLI
# stages, so a stage run by Snakemake and by hand reads the same settings.
# Every value pasted into a rule's shell is quoted (`{input:q}`, `{params.x:q}`, ...; `:q` quotes
# each item of a list on its own): config paths may hold spaces, and nothing in a config value may
# run as shell code. Strings built here for a shell use shlex.quote.
import functools
import json
import os
import re
import shlex

from wattgate.config import check_config_files, dump_resolved, numbers_as_written, run_config
from wattgate.errors import InputError
from wattgate.experiments import EXPERIMENTS, variant_config, variant_names

# --- paths: the one home of each stage's folder. Rules name their files under these; a rule that reads
# another stage's files takes them from that rule's outputs (`rules.pack_and_balance.output.plan`), and a
# folder passed to a shell is derived from the rule's own inputs/outputs in its params.
RESULTS = "results"
try:
    # the config files read as the CLI reads them, then the CLI's validation (defaults filled in place): one line
    # naming the key, where Snakemake's `validate` printed the whole schema (~360 lines). SystemExit is the one
    # exception Snakemake prints as its message alone. TYPED_CONFIG is the typed tree of the validated mapping:
    # what the wattgate functions called here take (`config` stays the mapping, for settings params and paths).
    check_config_files(workflow.configfiles)
    numbers_as_written(config, workflow.configfiles)  # 1.0e9 is a number, as in the CLI (YAML 1.1 says string)
    TYPED_CONFIG = run_config(config, f"config ({', '.join(map(str, workflow.configfiles))})")
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


# --- runs side by side: every stage's outputs sit under results/<stage>/<run>/ (its logs under logs/<rule>/<run>.log),
# where <run> is the config's run_name, or for a measurement variant (experiments.smk) <run_name>-<target>-<variant>.
# A second config with another run_name leaves the first run's plan, verdict, run and report as they are.
RUN = config["run_name"]


def check_results_layout(results):
    """A results/ folder of the layout before runs were keyed by run (results/plan/plan.json, ...): one line saying
    what to do, where Snakemake would run every stage again beside the old files without a word."""
    old = [
        f
        for f in ("config.yaml", "plan/plan.json", "gate/gate.json", "pretokenized/manifest.json")
        if os.path.exists(f"{results}/{f}")
    ]
    if old:
        raise SystemExit(
            f"wattgate: {results}/ holds outputs of the layout before runs were kept side by side ({results}/{old[0]}): "
            f"stages now write {results}/<stage>/<run_name>/; move the old folder aside (mv {results} {results}-old) "
            "and run again"
        )


check_results_layout(RESULTS)


def config_file(run):
    """The config a run's stages read: the resolved run config, or a variant's (written by variant_config)."""
    return f"{RESULTS}/config/{run}.yaml"


RUN_CONFIG = config_file(RUN)


def write_run_config():
    """results/config/<run>.yaml, defaults filled, rewritten only when it changed (its mtime reruns nothing: each rule's
    settings params do). Called by the Snakefile's onstart, once the jobs are decided and about to run: reading the
    workflow (`-n --configfile other.yaml`, `--list`, a job's own start on a node) writes nothing."""
    dump_resolved(TYPED_CONFIG, RUN_CONFIG)


CORPUS_DIR = f"{RESULTS}/corpus"
TOKENIZER_DIR = f"{RESULTS}/tokenizer/{{run}}"
PRETOKENIZED_DIR = f"{RESULTS}/pretokenized/{{run}}"
# the files that stand for those folders in the DAG (wattgate publishes each folder whole; a directory() output
# would have Snakemake add its own timestamp file inside)
TOKENIZER_FILE = f"{TOKENIZER_DIR}/tokenizer.json"
MANIFEST_FILE = f"{PRETOKENIZED_DIR}/manifest.json"
PLAN_DIR = f"{RESULTS}/plan/{{run}}"
GATE_DIR = f"{RESULTS}/gate/{{run}}"
TRAIN_DIR = f"{RESULTS}/train/{{run}}"
POWER_DIR = f"{RESULTS}/power/{{run}}"
REPORT_DIR = f"{RESULTS}/report/{{run}}"
CALIBRATION = f"{RESULTS}/calibrate/{config['cluster']['gpu_model'].lower()}.yaml"
# measurement targets (experiments.smk): the comparison of a target's variant runs
EXPERIMENT_DIR = f"{RESULTS}/{{experiment}}/{{run}}"


def log_file(rule, suffix="log"):
    """logs/<rule>/<run>.<suffix>: a job's log is its own, whatever else ran."""
    return f"logs/{rule}/{{run}}.{suffix}"


# the measurement variants of this config, each a run of its own: run name -> (target, variant)
VARIANTS = {
    f"{RUN}-{experiment}-{variant}": (experiment, variant)
    for experiment in EXPERIMENTS
    for variant in variant_names(TYPED_CONFIG, experiment)
}


@functools.cache
def run_settings(run):
    """The complete config of a run (JSON types): the run config, or a variant's as `wattgate variant` writes it."""
    if run == RUN:
        return config
    return variant_config(TYPED_CONFIG, *VARIANTS[run]).to_json()


def run_config_path(wildcards):
    return config_file(wildcards.run)


def variant_config_input(wildcards):
    """A variant run's config file, made by variant_config; none for the run itself (written as the jobs start, so
    it never makes a stage older than its inputs)."""
    return [config_file(wildcards.run)] if wildcards.run in VARIANTS else []


def _leaves(value, path):
    """(dotted path, value) of every setting under `path` (lists are single settings); cluster.slurm left out:
    where jobs queue changes no result."""
    if path == "cluster.slurm":
        return []
    if isinstance(value, dict):
        return [leaf for key in sorted(value) for leaf in _leaves(value[key], f"{path}.{key}")]
    return [(path, value)]


def _lookup(settings, path):
    for key in path.split("."):
        settings = settings[key]
    return settings


def settings_of(*paths):
    """A rule's settings params: one per config setting the stage reads (dotted paths: "pack", "train.seq_len",
    "cluster"), valued "train.lr=0.0003" from the run's own config, so Snakemake reruns exactly the stages whose
    settings changed for that run, and its rerun reason names the changed keys with their old and new values."""
    leaves = [leaf for path in paths for leaf, _ in _leaves(_lookup(config, path), path)]

    def value_of(leaf):
        # a rule without a run (the demo corpus) reads the run config
        return lambda wildcards: (
            f"{leaf}={json.dumps(_lookup(run_settings(getattr(wildcards, 'run', RUN)), leaf), sort_keys=True)}"
        )

    return {param_name(leaf): value_of(leaf) for leaf in leaves}


def param_name(leaf):
    """A setting's param name: its dotted path as an identifier (train.lr -> setting_train_lr)."""
    identifier = re.sub(r"\W", "_", leaf)
    return f"setting_{identifier}"


def pretokenized_of(wildcards):
    """A run's corpus (its manifest, the folder's stand-in): a variant trains on the data of the run it derives from
    (variants change nothing in data)."""
    return MANIFEST_FILE.format(run=RUN)


def folder_of(wildcards, input):
    """The folder of the pretokenized manifest this job reads (the CLI's --pretokenized)."""
    return os.path.dirname(input.pretokenized)


# the train settings a plan is made of (wattgate.pack): pack reruns on these alone
PACK_TRAIN_KEYS = tuple(
    f"train.{key}" for key in ("seq_len", "micro_batch_size", "grad_accum", "epochs", "eval_micro_batch_size")
)

# pack.documents_per_row auto asks the model whether its layers carry a recurrent state: pack then reads the model
PACK_MODEL_KEYS = ("model",) if config.get("pack", {}).get("documents_per_row", "auto") == "auto" else ()


# Used only with --sw-deployment-method conda; otherwise rules run in the
# current environment (the .venv that `make` creates). Relative to this file.
WATTGATE_ENV = "../envs/wattgate.yaml"


def gated_config(gate_dir=GATE_DIR):
    """The gate's own copy of the config it checked: the train job trains exactly this one, so a later
    invocation with another config (even `-n`) never changes what a queued train job trains."""
    return f"{gate_dir}/config.yaml"


def gate_result(gate_dir=GATE_DIR):
    """What downstream rules wait on: a pass, or (gate.enforce: false, on purpose) any verdict."""
    return f"{gate_dir}/PASSED" if config["gate"]["enforce"] else f"{gate_dir}/UNENFORCED"


def variant_runs(wildcards):
    """The finished train runs of one measurement target (`scaling` or `dataio`) of this run."""
    return [
        f"{RESULTS}/train/{run}/TRAINED"
        for run, (experiment, _) in VARIANTS.items()
        if experiment == wildcards.experiment
    ]


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


def run_gpu_job():
    """gpu_job() of each run's own cluster section (a scaling variant's node count differs from the run's)."""

    def key(name):
        return lambda wildcards: gpu_job(run_settings(wildcards.run)["cluster"]).get(name)

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

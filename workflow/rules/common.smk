# Shared wiring: the validated config (defaults filled) is written for the CLI
# stages, so a stage run by Snakemake and by hand reads the same settings.
from wattgate.config import dump_resolved
from wattgate.experiments import variant_names

RUN_CONFIG = dump_resolved(config, "results/config.yaml")
TRAIN_DIR = f"results/train/{config['run_name']}"


def tokenizer_dir():
    """A local tokenizer folder from config, else the one the train_tokenizer rule makes."""
    return config["tokenizer"]["path"] or "results/tokenizer"


# Used only with --sw-deployment-method conda; otherwise rules run in the
# current environment (the .venv that `make` creates). Relative to this file.
WATTGATE_ENV = "../envs/wattgate.yaml"


def gate_result(gate_dir="results/gate"):
    """What downstream rules wait on: a pass, or (gate.enforce: false, on purpose) any verdict."""
    return f"{gate_dir}/PASSED" if config["gate"]["enforce"] else f"{gate_dir}/UNENFORCED"


def variant_runs(experiment):
    """The finished train runs of one measurement target (`scaling` or `dataio`)."""
    return expand("results/{experiment}/{variant}/train/TRAINED", experiment=experiment,
                  variant=variant_names(config, experiment))

#!/usr/bin/env bash
# Runs once, inside the new conda environment, from snakemake's working directory
# (the repository root): install this checkout without touching its dependencies.
set -euo pipefail
python -m pip install --no-deps --editable .

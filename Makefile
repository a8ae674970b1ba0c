# Entry points: `make run` (the embedded default, end to end), `make test` and `make lint`
# (.ci/run runs `make lint`, then `make test`).
# Each creates .venv and installs what it needs; the install is redone only when
# pyproject.toml or the constraints change.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
CORES ?= 2
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: run test bench lint clean

$(VENV)/.installed-%: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[$*]'
	touch $@

run: $(VENV)/.installed-test
	$(BIN)/snakemake --cores $(CORES)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-test,bench
	$(BIN)/python bench/pack.py
	$(BIN)/python bench/pretokenize.py
	$(BIN)/python bench/gate.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/sampler.py
	$(BIN)/python bench/triage_accuracy.py
	$(BIN)/python bench/report.py

# Lint only checks (lint-imports: the layer contracts in pyproject.toml, docs/architecture.md "Layers");
# the formatters themselves are `ruff format src tests bench scripts`,
# `snakefmt Snakefile workflow/` (settings in pyproject.toml) and, for the config reference,
# `python scripts/config_docs.py --out docs/configuration.md`.
lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/config_docs.py --check docs/configuration.md
	$(BIN)/snakefmt --check Snakefile workflow/
	$(BIN)/snakemake --lint

clean:
	rm -rf results .snakemake

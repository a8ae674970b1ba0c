# Entry points: `make run` (the embedded default, end to end, then `make demo-power`), `make test` and `make lint`
# (.ci/run runs `make lint`, then `make test`).
# Each creates .venv and installs what it needs; the install is redone only when
# pyproject.toml or the constraints change.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
CORES ?= 2
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: run demo-power test bench lint clean

$(VENV)/.installed-%: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[$*]'
	touch $@

run: $(VENV)/.installed-test
	$(BIN)/snakemake --cores $(CORES)
	$(MAKE) --no-print-directory demo-power

# A real 8-GPU power log (nanoGPT DDP on 8 x H100, MIT: tests/data/nanogpt-8xh100/LICENSE and SOURCE.md),
# imported, triaged and reported: the CPU default has no power data, this has phases, energy and a straggler
NANOGPT := tests/data/nanogpt-8xh100
DEMO_POWER := results/demo-power
NANOGPT_COLUMNS := time=timestamp,gpu=gpu_index,power_w=power_W,util_gpu=utilization_gpu_percent,temp_c=temperature_C
demo-power: $(VENV)/.installed-test
	mkdir -p $(DEMO_POWER)
	$(BIN)/wattgate import-trace --from csv --columns $(NANOGPT_COLUMNS) --host nanogpt-8xh100 \
		$(NANOGPT)/gpu_metrics_first.csv.gz --out $(DEMO_POWER)/nanogpt-8xh100-first.parquet
	$(BIN)/wattgate triage --trace $(DEMO_POWER)/nanogpt-8xh100-first.parquet --gpu-model h100 --out $(DEMO_POWER)/power
	$(BIN)/wattgate report --trace $(DEMO_POWER)/nanogpt-8xh100-first.parquet --power $(DEMO_POWER)/power \
		--gpu-model h100 --out $(DEMO_POWER)/report
	@echo "demo-power: open $(DEMO_POWER)/report/index.html (a real 8 x H100 log: phases, energy, stragglers)"

# Two workers: the suite's end-to-end runs wait on hang limits, Slurm's status polls and each other's processes,
# so two at once finish sooner on two cores (tests/conftest.py orders the longest modules first)
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

bench: $(VENV)/.installed-test,bench
	$(BIN)/python bench/pack.py
	$(BIN)/python bench/pretokenize.py
	$(BIN)/python bench/gate.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/sampler.py
	$(BIN)/python bench/triage_accuracy.py
	$(BIN)/python bench/report.py

# Lint only checks (lint-imports: the layer contracts in pyproject.toml, docs/architecture.md "Layers";
# pyrefly: the types of src/, settings in pyproject.toml);
# the formatters themselves are `ruff format src tests bench scripts`,
# `snakefmt Snakefile workflow/` (settings in pyproject.toml) and, for the config reference,
# `python scripts/config_docs.py --out docs/configuration.md`; for the tested architectures,
# `python scripts/architectures_table.py --out docs/architectures.md`.
lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/lint-imports --no-cache
	$(BIN)/pyrefly check --python-interpreter-path $(BIN)/python
	$(BIN)/python scripts/config_docs.py --check docs/configuration.md
	$(BIN)/python scripts/architectures_table.py --check docs/architectures.md
	$(BIN)/python scripts/config_types.py --check src/wattgate/records/run_config.py
	$(BIN)/snakefmt --check Snakefile workflow/
	$(BIN)/snakemake --lint

clean:
	rm -rf results .snakemake

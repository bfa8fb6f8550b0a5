# `make run` and `make test` are the only commands a fresh machine needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.run-installed
DEV_STAMP := $(VENV)/.dev-installed

.PHONY: run ui test lint docs bench soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@ $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/python -m sparkpoint.demo

# The Dagster UI (webserver + daemon) on the embedded defaults; Ctrl-C stops it, and the warm
# local Spark its runs attached to.
DAGSTER_HOME ?= $(CURDIR)/.sparkpoint/dagster
UI_PORT ?= 3000
ui: $(RUN_STAMP)
	@home=$$($(BIN)/python -c 'import sys; from sparkpoint.ops.instance import prepare_dagster_home; print(prepare_dagster_home(sys.argv[1]))' "$(DAGSTER_HOME)") && \
	  echo "Dagster UI: http://127.0.0.1:$(UI_PORT)  (DAGSTER_HOME=$$home; Ctrl-C stops it)" && \
	  trap '$(BIN)/python -m sparkpoint.spark.warm --stop' EXIT && trap 'exit 130' INT TERM && \
	  DAGSTER_HOME=$$home VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dg dev -w workspace.yaml -h 127.0.0.1 -p $(UI_PORT)

# Four pytest workers, each taking whole files: most of the suite's time is spent waiting for
# servers, daemons and new processes (a whole run keeps the two cores 30-40% busy), so workers
# overlap well even on two cores: one worker 29 min, two 20-23 min (2026-11-28); on the suite of
# 2026-11-29, four 24 min against two's 28.5 min (that one partly beside other builds). xdist hands out the files with the most tests first;
# putting the longest first measured slower with two workers (23:27 against 20:24).
TEST_WORKERS ?= 4
test: $(DEV_STAMP)
	@sh tools/ensure-test-tools
	$(BIN)/ruff check sparkpoint tests benchmarks docs
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(MAKE) --no-print-directory docs
	@home=$$(mktemp -d) && printf 'telemetry:\n  enabled: false\nconcurrency:\n  pools:\n    granularity: run\n    default_limit: 1\n' > $$home/dagster.yaml && \
	  DAGSTER_HOME=$$home $(BIN)/dagster definitions validate -w workspace.yaml && \
	  DAGSTER_HOME=$$home VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dg check defs; \
	  status=$$?; rm -rf $$home; exit $$status
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15

# The documentation site (docs/, mkdocs.yml) into build/site, strictly: a broken link, a public name
# without a complete docstring or a setting without a description fails it. Offline, a few seconds.
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

# Long reliability variants (crash points x seeds, storage faults over hundreds of checkpoints, load).
soak: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m soak -s
	@$(BIN)/python -m tests.support.soak_summary build/soak

lint: $(DEV_STAMP)
	$(BIN)/ruff check sparkpoint tests benchmarks docs
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

bench: $(DEV_STAMP)
	$(BIN)/python -m benchmarks.bench_rmw
	$(BIN)/python -m benchmarks.bench_list_append
	$(BIN)/python -m benchmarks.bench_record_codec
	$(BIN)/python -m benchmarks.bench_state_backend
	$(BIN)/python -m benchmarks.bench_bookkeeping
	$(BIN)/python -m benchmarks.bench_changelog
	$(BIN)/python -m benchmarks.bench_damage
	$(BIN)/python -m benchmarks.bench_diff
	$(BIN)/python -m benchmarks.bench_startup
	$(BIN)/python -m benchmarks.bench_scale --large
	$(BIN)/python -m benchmarks.bench_vs_spark --ours-setting ours-files:state.backend.changelog.enabled=false
	$(BIN)/python -m benchmarks.bench_ttl_bounded
	$(BIN)/python -m benchmarks.bench_timers_vs_spark
	$(BIN)/python -m benchmarks.bench_routing
	$(BIN)/python -m benchmarks.bench_table_commit

clean:
	rm -rf $(VENV) .sparkpoint

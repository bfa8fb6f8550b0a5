# `make run` and `make test` are the only commands a fresh machine needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.run-installed
DEV_STAMP := $(VENV)/.dev-installed

.PHONY: run ui test checks test-profile lint docs bench soak clean

# Installs go through uv (from PyPI, into the venv): on a fresh machine it installs the dev
# dependencies in about a quarter of pip's time (151 s against 530 s here, the same versions);
# pip takes over if uv cannot.
INSTALL = $(BIN)/uv pip install --quiet --python $(BIN)/python
PIP_INSTALL = $(BIN)/pip install --quiet

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip uv

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(INSTALL) -e . || $(PIP_INSTALL) -e .
	touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(INSTALL) -e ".[dev]" || $(PIP_INSTALL) -e ".[dev]"
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

# Four pytest workers, each taking whole files, the longest first (tests/support/schedule.py; xdist's
# own order, the files with the most tests first, left the longest for last). The suite is
# CPU-bound: sampled per process (make test-profile), the two cores are about 95% busy, mostly in
# the JVMs, Spark's Python workers and the Dagster and Airflow processes tests start; `time make
# test` shows a third of that, since it counts only the processes it waited for.
# Four workers took 24 min against two's 28.5 on 2026-11-29; the shorter suite comes from less work.
TEST_WORKERS ?= 4
# Through a variable: a recipe line that names $(MAKE) itself runs even under `make -n`.
CHECKS = $(MAKE) --no-print-directory checks
test: $(DEV_STAMP)
	@sh tools/ensure-test-tools
	@mkdir -p build && (nice -n 19 $(CHECKS) > build/checks.log 2>&1; echo $$? > build/checks.status) & \
	  $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15; \
	  status=$$?; wait; echo "--- make checks (run beside the tests):"; cat build/checks.log; \
	  checks=$$(cat build/checks.status); [ $$status -eq 0 ] && [ "$$checks" -eq 0 ]

# The static checks and `dg check defs` of this project. make test runs them beside pytest at the
# lowest priority: about 35 CPU seconds, mostly a cold mypy, that fit in the moments the tests leave
# a core idle instead of taking a minute before the first test starts. (The strict docs build and
# `dagster definitions validate` of workspace.yaml are tests: tests/test_docs.py and
# tests/test_pipeline_runs_in_flight.py.)
checks: $(DEV_STAMP)
	$(BIN)/ruff check sparkpoint tests benchmarks docs
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	@home=$$(mktemp -d) && printf 'telemetry:\n  enabled: false\nconcurrency:\n  pools:\n    granularity: run\n    default_limit: 1\n' > $$home/dagster.yaml && \
	  DAGSTER_HOME=$$home VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dg check defs; \
	  status=$$?; rm -rf $$home; exit $$status

# make test with its CPU by test file (tools/cpu_by_test_file.py): the suite is CPU-bound on two
# cores (about 95% busy: the JVMs and daemons tests start are not in `time make test`'s figure).
test-profile: $(DEV_STAMP)
	@$(BIN)/python tools/cpu_by_test_file.py --out build/cpu-by-file.json & sampler=$$!; \
	  $(MAKE) --no-print-directory test; status=$$?; kill $$sampler; \
	  $(BIN)/python tools/cpu_by_test_file.py --report build/cpu-by-file.json; exit $$status

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
	$(BIN)/python -m benchmarks.bench_observability
	$(BIN)/python -m benchmarks.bench_observers

clean:
	rm -rf $(VENV) .sparkpoint

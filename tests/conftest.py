"""Shared by every test: converted weights are cached inside the checkout, so
that the default model is converted from GGUF once per machine, not per test."""

# ruff: noqa: E402 (gc is turned off before the other imports)
import gc

# No cyclic garbage collection while the suite is collected: importing torch, transformers and the clients
# and building 3,000 tests made Python walk its growing heap again and again, 6-12 s of each worker's 30-34
# s of collection (2-core AVX2 EPYC). pytest_collection_finish turns it back on (pytest_sessionstart in
# xdist's controller, which collects nothing).
gc.disable()

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_fixture import RunningServer, running_server

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("INFERENCE_CACHE_DIR", str(ROOT / ".cache"))

# The files that take longest, longest first (each over 40 s of a worker's time in `make test` on a 2-core
# AVX2 EPYC, 2026-12-05, its junit report's times). `make test` hands whole files to its two workers in
# the collection's order (--no-loadscope-reorder), so these go first and the short ones fill in at the end.
# xdist's own order (most tests first) left the files of one to five tests, 45 to 80 s each, for last: one
# worker still on them while the other had nothing left, 90 s of a 928 s run.
SLOWEST_FILES = (
    "tests/backend/test_exactness.py",
    "tests/test_benchmark_script.py",
    "tests/openai/test_structured_outputs.py",
    "tests/frontend/test_real_model_e2e.py",
    "tests/openai/test_logprobs.py",
    "tests/test_gpu_check.py",
    "tests/compat/test_anthropic_tools.py",
    "tests/openai/test_reasoning.py",
    "tests/frontend/test_lora_e2e.py",
    "tests/openai/test_harmony.py",
    "tests/frontend/test_embedding_beside_streams_e2e.py",
    "tests/frontend/test_model_families_e2e.py",
    "tests/backend/test_real_text.py",
    "tests/proxy/test_forwarding.py",
    "tests/compat/test_ollama_api.py",
    "tests/openai/test_tool_calls.py",
    "tests/frontend/test_quantized_checkpoints_e2e.py",
    "tests/backend/test_loading.py",
    "tests/compat/test_responses_tools.py",
    "tests/frontend/test_speculative_e2e.py",
    "tests/backend/test_grammar.py",
    "tests/deploy/test_compose_and_image.py",
    "tests/browser/test_chat_page.py",
    "tests/openai/test_openai_client.py",
    "tests/frontend/test_operations_e2e.py",
    "tests/openai/test_xml_tool_calls.py",
    "tests/backend/test_decode_graphs.py",
    "tests/backend/test_process.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOWEST_FILES first, in that order; every other file after them, in the collection's order."""
    gone = [name for name in SLOWEST_FILES if not (ROOT / name).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py's SLOWEST_FILES names files that are not there: {gone}")
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.pluginmanager.has_plugin("dsession"):  # xdist's controller: its workers collect
        gc.enable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (torch's, transformers' and the clients' modules, 3,000 tests: over half a
    million objects) lives to the end: frozen, the garbage collector no longer walks it. A full collection
    took 0.5-1 s of a worker's time before (2-core AVX2 EPYC), at every server's stop (server_fixture.py
    collects, so that a dropped client lets go of its connection) and whenever Python's own thresholds
    came round in a test."""
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.fixture(scope="session")
def default_mode_server() -> Iterator[RunningServer]:
    """The default model as a person runs it (`make run`: the GGUF file's own 4-bit weights, speculative
    decoding on), 4 rows: one server for every module that needs only that, started once (a start is
    half a minute of the suite)."""
    with running_server("--rows", "4", ready_timeout=300) as server:
        yield server


@pytest.fixture(scope="session")
def exact_mode_server() -> Iterator[RunningServer]:
    """The default model in the exact mode, 8 rows: the OpenAI API tests' server and the other APIs'
    (tests/compat), one start for both. Exact: seeded choices must come out the same whatever the batch
    (SPEC §5), which the default mode's bfloat16 and 4-bit products, whose rounding depends on the batch's
    shape, do not promise."""
    options = "--rows 8 --max-seq-len 1024 --dtype float32 --quantize none"
    with running_server(*options.split(), ready_timeout=300) as server:
        yield server


@pytest.fixture(scope="session")
def default_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer, read from its GGUF file and saved as the backend saves it
    (transformers' save_pretrained): reading it from the GGUF file takes 7 s, so once a session."""
    from transformers import AutoTokenizer  # inside: the frontend's tests import no torch

    from backend.model.source import resolve_model

    source = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    directory = tmp_path_factory.mktemp("default-tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def whole_default_model_copy() -> Path:
    """The default model's converted copy (safetensors, config and tokenizer.json) with every float weight,
    what transformers loads as a checkpoint: made or completed now (`backend.prepare --full-copy`) where
    no start has, or only a default-mode one, which leaves out the layers the blocks serve."""
    from backend.model.gguf_conversion import omitted_weights  # inside: the frontend's tests import no torch
    from backend.model.loader import converted_dir
    from backend.model.source import resolve_model

    converted = converted_dir(resolve_model(None), Path(os.environ["INFERENCE_CACHE_DIR"]))
    if not (converted / "config.json").is_file() or omitted_weights(converted):
        subprocess.run([sys.executable, "-m", "backend.prepare", "--full-copy"], check=True, cwd=ROOT)
    return converted

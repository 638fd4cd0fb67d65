"""Shared by every test: converted weights are cached inside the checkout, so
that the default model is converted from GGUF once per machine, not per test."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_fixture import RunningServer, running_server

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("INFERENCE_CACHE_DIR", str(ROOT / ".cache"))


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

    from backend.model.loader import resolve_model

    source = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    directory = tmp_path_factory.mktemp("default-tokenizer")
    tokenizer.save_pretrained(directory)
    return directory

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

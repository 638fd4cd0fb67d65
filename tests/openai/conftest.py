"""One real server on the default model for the OpenAI API tests, and clients for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from backend.model.loader import converted_dir, resolve_model
from tests.server_fixture import RunningServer, running_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="package")
def server() -> Iterator[RunningServer]:
    # The exact mode: seeded choices must come out the same whatever the batch (SPEC §5), which the
    # default mode's bfloat16 and 4-bit products, whose rounding depends on the batch's shape, do not promise.
    options = "--rows 8 --max-seq-len 1024 --dtype float32 --quantize none"
    with running_server(*options.split(), ready_timeout=300) as running:
        yield running


@pytest.fixture(scope="package")
def client(server: RunningServer) -> openai.OpenAI:
    """The official client, unchanged, pointed at the server."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def tokenizer(server: RunningServer):
    """The model's tokenizer as transformers loads it (from the server's converted copy), to count tokens."""
    cache = Path(os.environ["INFERENCE_CACHE_DIR"])
    return AutoTokenizer.from_pretrained(converted_dir(resolve_model(None), cache))


@pytest.fixture(scope="package")
def reference_model(server: RunningServer):
    """The served model in float32 as transformers runs it, to check scores against."""
    from backend.messages import BackendConfig
    from backend.model.loader import load_model

    return load_model(BackendConfig(dtype="float32", quantize="none", rows=1, max_seq_len=64)).model

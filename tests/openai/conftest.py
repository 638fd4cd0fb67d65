"""The OpenAI API tests' real server on the default model (the exact mode, tests/conftest.py, shared with
tests/compat), and clients for it."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from backend.model.loader import converted_dir, resolve_model
from tests.server_fixture import RunningServer

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="package")
def server(exact_mode_server: RunningServer) -> RunningServer:
    return exact_mode_server


@pytest.fixture(scope="package")
def client(server: RunningServer) -> openai.OpenAI:
    """The official client, unchanged, pointed at the server."""
    return server.openai_client()


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

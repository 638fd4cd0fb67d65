"""The OpenAI API tests' real server on the default model (the exact mode, tests/conftest.py, shared with
tests/compat), and clients for it."""

from __future__ import annotations

import json
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


def assert_streamed_call_is_the_whole_ones(client: openai.OpenAI, request: dict) -> None:
    """`request` (its answer a call), streamed: its deltas add up to the call the whole answer made."""
    whole = client.chat.completions.create(**request)
    [expected] = whole.choices[0].message.tool_calls
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            name += delta.function.name or ""
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(arguments), finish) == (
        expected.function.name,
        json.loads(expected.function.arguments),
        "tool_calls",
    )

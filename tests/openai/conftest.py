"""The OpenAI API tests' real server on the default model (the exact mode, tests/conftest.py, shared with
tests/compat), and clients for it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import openai
import pytest
import requests
from openai.types.chat import ChatCompletionMessageToolCall
from transformers import AutoTokenizer

from backend.model.loader import converted_dir
from backend.model.source import resolve_model
from tests.backend.models import write_tiny_byte_model
from tests.server_fixture import RunningServer, running_server

MODEL = "SmolLM2-135M-Instruct"
# A tool whose values the grammar bounds (a count of days, a choice of strings), for the formats' tests on a
# tiny random model: a bias that opens calls cannot run a value on.
BOUNDED_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in Paris.",
        "parameters": {
            "type": "object",
            "properties": {
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "units": {"enum": ["metric", "imperial"]},
            },
            "required": ["days", "units"],
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris this week?"}]


def format_fixtures(
    special_tokens: tuple[str, ...],
    template: str,
    name: str,
    opening_tag: str,
    max_seq_len: int = 512,
    text_tags: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
):
    """A format test module's fixtures, for it to take as `server, client, opening = format_fixtures(...)`:
    its `format_server`, the official client pointed at it, and `opening`, the id of the tag that opens a
    call (a logit_bias key)."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
        directory = tmp_path_factory.mktemp(name)
        with format_server(
            directory, special_tokens, template, name, max_seq_len, text_tags, options
        ) as running:
            yield running

    @pytest.fixture(scope="module")
    def client(server: RunningServer) -> openai.OpenAI:
        return server.openai_client()

    @pytest.fixture(scope="module")
    def opening(server: RunningServer) -> str:
        [token] = token_ids(server, opening_tag)
        return token

    return server, client, opening


@contextmanager
def format_server(
    directory: Path,
    special_tokens: tuple[str, ...],
    template: str,
    name: str,
    max_seq_len: int = 512,
    text_tags: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
) -> Iterator[RunningServer]:
    """A tiny random model whose byte-level tokenizer has a format's tags as special tokens (the last the
    EOS; those in `text_tags` tokens not marked special), behind a chat template in that format, served
    as `name` in the exact mode (rows of `max_seq_len` positions), with the server's `options`: the server
    reads the format from the template and the tokenizer as it would the real model's."""
    write_tiny_byte_model(directory, special_tokens, max_seq_len, text_tags)
    (directory / "chat_template.jinja").write_text(template)
    model = ["--model", str(directory), "--chat-template", str(directory / "chat_template.jinja")]
    exact = ["--dtype", "float32", "--quantize", "none", "--rows", "4", "--max-seq-len", str(max_seq_len)]
    with running_server(*model, "--served-model-name", name, *exact, *options, ready_timeout=300) as running:
        yield running


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


def token_ids(server: RunningServer, tags: str) -> list[str]:
    """The ids of the tokens `tags` is made of (a format's tags, each a token of its own), as logit_bias
    keys."""
    response = requests.post(f"{server.url}/tokenize", json={"content": tags}, timeout=30)
    return [str(token) for token in response.json()["tokens"]]


def forced_weather_call(
    client: openai.OpenAI, model: str, opening: str, max_tokens: int = 100, **request
) -> tuple[str, ChatCompletionMessageToolCall]:
    """BOUNDED_WEATHER's call by a format_server's model made to open one (`opening`: the id of the tag
    that opens a call, biased): what it wrote, its tags kept, and the one call read back, which must be
    valid (written in `max_tokens`, of a byte-level tokenizer's)."""
    completion = client.chat.completions.create(
        model=model,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        max_tokens=max_tokens,
        logit_bias={opening: 100},
        parallel_tool_calls=False,
        logprobs=True,  # the answer's tokens: the call as the model wrote it
        **request,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), BOUNDED_WEATHER["function"]["parameters"])
    return "".join(token.token for token in choice.logprobs.content), call


def assert_forced_call_streams_as_the_whole_one(
    client: openai.OpenAI, model: str, opening: str, max_tokens: int = 100
) -> None:
    """`forced_weather_call`, greedy, streamed: deltas of the call the whole answer made."""
    request = dict(model=model, messages=WEATHER_QUESTION, tools=[BOUNDED_WEATHER], temperature=0)
    forced = {"max_tokens": max_tokens, "logit_bias": {opening: 100}, "parallel_tool_calls": False}
    assert_streamed_call_is_the_whole_ones(client, {**request, **forced})


def answer_without_a_call(client: openai.OpenAI, model: str, opening: str) -> str:
    """A format_server's greedy answer to WEATHER_QUESTION, BOUNDED_WEATHER offered, made not to open a
    call (`opening`, the id of its tag, biased away): text, which must not be read as calls."""
    completion = client.chat.completions.create(
        model=model,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        temperature=0,
        max_tokens=20,
        logit_bias={opening: -100},
    )
    message = completion.choices[0].message
    assert message.tool_calls is None and message.content
    return message.content


def prompt_after_a_call(server: RunningServer, model: str) -> str:
    """The prompt a format_server's model answers after BOUNDED_WEATHER's call (days 2, units metric) and
    its result, as text: what its template made of the call. The request is answered, too."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"days": 2, "units": "metric"}'}
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    request = dict(model=model, messages=history, tools=[BOUNDED_WEATHER])
    assert server.openai_client().chat.completions.create(**request, max_tokens=8).choices[0].finish_reason
    body = {**request, "return_token_strs": True}
    return "".join(requests.post(f"{server.url}/tokenize", json=body, timeout=30).json()["token_strs"])

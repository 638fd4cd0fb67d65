"""Granite 3's tool calls with the official openai client (inference_api/mistral_tool_calls.py, the
`granite` format): a JSON list of calls after its `<|tool_call|>` token. A tiny random model whose
byte-level tokenizer has Granite's tags as special tokens serves behind a chat template written here in
Granite 3's layout (the model's own is not on this machine), so that the server reads the format from
the template and the tokenizer as it would a Granite 3's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
import requests

from tests.openai.conftest import (
    BOUNDED_WEATHER,
    WEATHER_QUESTION,
    assert_streamed_call_is_the_whole_ones,
    format_server,
)
from tests.server_fixture import RunningServer

# Granite's tags as special tokens; the EOS last, under the name the tiny Qwen2's tokenizer class gives its
# own (it would add one more)
SPECIAL_TOKENS = ("<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>", "<|endoftext|>")
# Granite 3's layout: the tools in a turn of their own, an assistant's calls as one JSON list after
# <|tool_call|>, a result in a tool_response turn.
TEMPLATE = r"""{%- if tools %}
{{- '<|start_of_role|>available_tools<|end_of_role|>' + tools | tojson + '<|endoftext|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' }}
{{- message.tool_calls | map(attribute='function') | list | tojson + '<|endoftext|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|start_of_role|>tool_response<|end_of_role|>' + message.content + '<|endoftext|>\n' }}
{%- else %}
{{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + message.content + '<|endoftext|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"""
MODEL = "granite-format"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with format_server(tmp_path_factory.mktemp(MODEL), SPECIAL_TOKENS, TEMPLATE, MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def opening(server: RunningServer) -> str:
    """The id of the `<|tool_call|>` token, which opens the calls."""
    tokens = requests.post(f"{server.url}/tokenize", json={"content": "<|tool_call|>"}, timeout=30).json()
    [token] = tokens["tokens"]
    return str(token)


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        temperature=0,
        max_tokens=100,
        logit_bias={opening: 100},
        parallel_tool_calls=False,
        logprobs=True,  # the answer's tokens: the calls as the model wrote them
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    written = "".join(token.token for token in choice.logprobs.content)
    assert written.startswith('<|tool_call|>[{"name": "get_weather", "arguments": {"days": ')
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), BOUNDED_WEATHER["function"]["parameters"])


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    request = dict(
        model=MODEL, messages=WEATHER_QUESTION, tools=[BOUNDED_WEATHER], temperature=0, max_tokens=100
    )
    bias = {"logit_bias": {opening: 100}, "parallel_tool_calls": False}
    assert_streamed_call_is_the_whole_ones(client, {**request, **bias})

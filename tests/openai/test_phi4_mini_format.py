"""Phi-4-mini's tool calls with the official openai client (inference_api/listed_tool_calls.py, the
`phi4_mini` format): its chat template takes the tools as a JSON string in the system message's `tools`
field and writes no calls; the model answers with a JSON list of calls between its `<|tool_call|>` and
`<|/tool_call|>` tokens. A tiny random model whose byte-level tokenizer has Phi-4-mini's tags as special
tokens serves behind the model's own template: the tools reach the prompt where the template puts them,
an `auto` call the model opens with its tag comes back as OpenAI's tool call, whole and streamed, and a
call in the history goes back into the assistant's turn in the format."""

from __future__ import annotations

import json
import re

import requests

from tests.openai.conftest import (
    BOUNDED_WEATHER,
    WEATHER_QUESTION,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    prompt_after_a_call,
)

SPECIAL_TOKENS = (
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|/tool|>",
    "<|tool_call|>",
    "<|/tool_call|>",
    "<|end|>",
    "<|endoftext|>",
)
# microsoft/Phi-4-mini-instruct's chat template (its tokenizer_config.json, as the Berkeley
# function-calling leaderboard's handler of the model quotes it).
TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
MODEL = "phi4-mini-format"
LISTED_TOOL = json.dumps([BOUNDED_WEATHER["function"]])

server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<|tool_call|>", 1024)


def prompt(server, messages: list[dict]) -> str:
    body = {"model": MODEL, "messages": messages, "tools": [BOUNDED_WEATHER], "return_token_strs": True}
    return "".join(requests.post(f"{server.url}/tokenize", json=body, timeout=30).json()["token_strs"])


def test_the_tools_reach_the_prompt_in_the_system_message_as_the_template_takes_them(server):
    """Passed as the `tools` argument, this template would drop them: the model would see no tools."""
    system = "<|system|>You are a helpful assistant with some tools.<|tool|>"
    assert prompt(server, WEATHER_QUESTION).startswith(f"{system}{LISTED_TOOL}<|/tool|><|end|><|user|>")
    own = [{"role": "system", "content": "Be brief."}, *WEATHER_QUESTION]
    assert prompt(server, own).startswith(f"<|system|>Be brief.<|tool|>{LISTED_TOOL}<|/tool|><|end|>")


def test_an_auto_call_the_model_opens_with_its_tag_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        call = r'\[\{"name": "get_weather", "arguments": \{"days": \d, "units": "(metric|imperial)"\}\}\]'
        assert re.fullmatch(rf"<\|tool_call\|>\n?{call}\n?<\|/tool_call\|>", written)


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_a_call_in_the_history_goes_back_into_the_assistants_turn_in_the_format(server):
    called = '[{"name": "get_weather", "arguments": {"days": 2, "units": "metric"}}]'
    written = prompt_after_a_call(server, MODEL)
    assert f"<|assistant|><|tool_call|>{called}<|/tool_call|><|end|><|tool|>Sunny, 21 C.<|end|>" in written

"""Qwen3-Coder's and Qwen3.5's tool calls (inference_api/xml_tool_calls.py) with the official openai
client: the default model behind a chat template that teaches and writes calls in their XML format (a
template written here in that format, the models' own not being on this machine), so that the server
reads its format from the template as it would a Qwen3.5's. An `auto` call the model starts is decoded
under the calls' grammar and comes back as OpenAI's tool call; a call in the history goes back into the
prompt as XML."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
import requests

from tests.openai.conftest import MODEL, assert_streamed_call_is_the_whole_ones
from tests.server_fixture import RunningServer, running_server

# Qwen3-Coder's format, in a template of its own: the tools in the system turn with the format's
# instructions, an assistant's calls as <tool_call><function=...><parameter=...> blocks, tool results
# as <tool_response> blocks in a user turn.
TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nTo call a function, reply in this format:\n\n<tool_call>\n'
    + '<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>\n'
    + '</function>\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set call = call.function if call.function is defined else call %}
{{- '\n<tool_call>\n<function=' + call.name + '>\n' }}
{%- for name, value in call.arguments | items %}
{%- set structured = value is mapping or (value is sequence and value is not string) %}
{{- '<parameter=' + name + '>\n' + (value | tojson if structured else value | string) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""
# Values the grammar bounds (an hour, a choice): a bias that opens calls cannot run a value on.
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm.",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 1, "maximum": 12},
                "period": {"enum": ["am", "pm"]},
            },
            "required": ["hour", "period"],
        },
    },
}
ASK = [{"role": "user", "content": "Wake me up at seven tomorrow morning."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    template = tmp_path_factory.mktemp("template") / "qwen3-coder-format.jinja"
    template.write_text(TEMPLATE)
    exact = ["--dtype", "float32", "--quantize", "none", "--rows", "4", "--max-seq-len", "1024"]
    with running_server("--chat-template", str(template), *exact, ready_timeout=300) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def opening_bias(server: RunningServer) -> dict[str, int]:
    """A bias for the tokens of `<tool_call>`, which makes the model open a call."""
    tokens = requests.post(f"{server.url}/tokenize", json={"content": "<tool_call>"}, timeout=30).json()
    return {str(token): 100 for token in tokens["tokens"]}


def test_an_auto_call_the_model_starts_is_whole_xml_read_back_as_a_valid_call(client, opening_bias):
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[ALARM],
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            logit_bias=opening_bias,
            parallel_tool_calls=False,
            logprobs=True,  # the answer's tokens: the call as the model wrote it
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        written = "".join(token.token for token in choice.logprobs.content)
        assert written.startswith("<tool_call>") and "<function=set_alarm>" in written
        [call] = choice.message.tool_calls
        assert call.function.name == "set_alarm"
        jsonschema.validate(json.loads(call.function.arguments), ALARM["function"]["parameters"])


def test_a_streamed_xml_call_comes_as_deltas_of_the_same_call(client, opening_bias):
    request = dict(model=MODEL, messages=ASK, tools=[ALARM], temperature=0, max_tokens=120)
    assert_streamed_call_is_the_whole_ones(
        client, {**request, "logit_bias": opening_bias, "parallel_tool_calls": False}
    )


def test_a_call_in_the_history_goes_back_into_the_prompt_as_xml(server, client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "set_alarm", "arguments": '{"hour": 7, "period": "am"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Alarm set for 7 am."},
    ]
    body = {"messages": history, "tools": [ALARM], "add_generation_prompt": True}
    tokens = requests.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
    prompt = requests.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    call = "<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n<parameter=period>\nam\n"
    assert call in prompt and "<tool_response>\nAlarm set for 7 am.\n</tool_response>" in prompt
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[ALARM], max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")

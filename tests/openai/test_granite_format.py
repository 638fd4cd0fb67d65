"""Granite 3's tool calls with the official openai client (inference_api/mistral_tool_calls.py, the
`granite` format): a JSON list of calls after its `<|tool_call|>` token. A tiny random model whose
byte-level tokenizer has Granite's tags as special tokens serves behind a chat template written here in
Granite 3's layout (the model's own is not on this machine), so that the server reads the format from
the template and the tokenizer as it would a Granite 3's."""

from __future__ import annotations

from tests.openai.conftest import (
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
)

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


server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<|tool_call|>")


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    written, _ = forced_weather_call(client, MODEL, opening, temperature=0)
    assert written.startswith('<|tool_call|>[{"name": "get_weather", "arguments": {"days": ')


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)

"""Jamba's tool calls with the official openai client (inference_api/listed_tool_calls.py, the `jamba`
format): a JSON list of calls between its `<tool_calls>` and `</tool_calls>` tokens. A tiny random model
whose byte-level tokenizer has them as special tokens serves behind a chat template written here in
Jamba's layout (the model's own is not on this machine): an `auto` call the model opens with its tag
comes back as OpenAI's tool call, whole and streamed, and a call in the history goes back into the
prompt as the template writes it."""

from __future__ import annotations

import re

from tests.openai.conftest import (
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    prompt_after_a_call,
)

SPECIAL_TOKENS = ("<|bom|>", "<|eom|>", "<tool_calls>", "</tool_calls>", "<|endoftext|>")
# Jamba's layout: turns between <|bom|><|ROLE|> and <|eom|>, the tools in the system turn, an assistant's
# calls as one JSON list of {"name", "arguments"} between the tags.
TEMPLATE = r"""{%- if tools %}
{{- '<|bom|><|system|> You may call these functions: ' + tools | tojson
    + '. Call them as <tool_calls>[{"name": ..., "arguments": {...}}]</tool_calls><|eom|>' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}
{{- '<|bom|><|assistant|> <tool_calls>' + m.tool_calls | map(attribute='function') | list | tojson }}
{{- '</tool_calls><|eom|>' }}
{%- else %}{{ '<|bom|><|' + m.role + '|> ' + m.content + '<|eom|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|bom|><|assistant|> ' }}{% endif %}"""
MODEL = "jamba-format"

server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<tool_calls>", 1024)


def test_an_auto_call_the_model_opens_with_its_tag_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        call = r'\[\{"name": "get_weather", "arguments": \{"days": \d, "units": "(metric|imperial)"\}\}\]'
        assert re.fullmatch(rf"<tool_calls>\n?{call}\n?</tool_calls>", written)


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_a_call_in_the_history_goes_back_into_the_prompt_as_the_template_writes_it(server):
    called = '[{"name": "get_weather", "arguments": {"days": 2, "units": "metric"}}]'
    assert f"<tool_calls>{called}</tool_calls>" in prompt_after_a_call(server, MODEL)

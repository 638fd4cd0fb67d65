"""GLM-4.5's XML calls where its tags are tokens of their own, as in its tokenizer, which does not mark
them special: llguidance takes them as special all the same (tokenizer.are_grammar_tokens), so the calls'
grammar names them as tokens. A tiny random model whose byte-level tokenizer has them so serves behind a
chat template written here in GLM-4.5's layout (the model's own is not on this machine): an `auto` call
the model opens with the `<tool_call>` token is decoded under the calls' grammar and comes back as
OpenAI's tool call, whole and streamed."""

from __future__ import annotations

import re

from tests.openai.conftest import (
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
)

TAG_TOKENS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
SPECIAL_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", *TAG_TOKENS, "<|endoftext|>")
# GLM-4.5's layout: the tools in the system turn with the format's instructions, each call as
# <tool_call>NAME, then <arg_key>KEY</arg_key> and <arg_value>VALUE</arg_value> lines, </tool_call>.
TEMPLATE = r"""{%- if tools %}
{{- '<|system|>\n# Tools\n\n<tools>\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}
{{- '</tools>\n\nFor each function call, output the function name and arguments in this format:\n'
    + '<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n'
    + '</tool_call>' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}{{ '<|user|>\n' + m.content }}
{%- elif m.role == 'assistant' %}{{ '<|assistant|>\n' + m.content }}
{%- for tc in m.tool_calls or [] %}{{ '\n<tool_call>' + tc.function.name }}
{%- for k, v in tc.function.arguments.items() %}{{ '\n<arg_key>' + k + '</arg_key>\n<arg_value>' }}
{{- v | tojson if v is not string else v }}{{ '</arg_value>' }}{% endfor %}{{ '\n</tool_call>' }}
{%- endfor %}
{%- elif m.role == 'tool' %}{{ '<|observation|>\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"""
MODEL = "glm45-tag-tokens"

server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<tool_call>", 1024, TAG_TOKENS)


def test_an_auto_call_opened_by_the_tag_token_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        assert re.match(r"<tool_call>\s*get_weather\s*<arg_key>days</arg_key>\s*<arg_value>\s*\d", written)


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)

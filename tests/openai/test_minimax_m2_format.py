"""MiniMax-M2's tool calls with the official openai client (inference_api/xml_tool_calls.py, the
`minimax_m2` format): `<invoke name=...>` with a `<parameter name=...>` each, between its
`<minimax:tool_call>` tags, which its tokenizer has as tokens of their own, not marked special (so
llguidance takes them as special, and the grammar names them as tokens). A tiny random model whose
byte-level tokenizer has them so serves behind a chat template written here in MiniMax-M2's layout (the
model's own is not on this machine): an `auto` call the model opens with its tag comes back as OpenAI's
tool call, whole and streamed, and a call in the history goes back into the prompt in the format."""

from __future__ import annotations

import re

from tests.openai.conftest import (
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    prompt_after_a_call,
)

TAG_TOKENS = ("<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>")
SPECIAL_TOKENS = ("]~b]", "[e~[", *TAG_TOKENS, "<|endoftext|>")
# MiniMax-M2's layout: turns between ]~b]ROLE and [e~[, the tools in the system turn with the format's
# instructions, each call an <invoke> in a <minimax:tool_call> block, its values as text or JSON.
TEMPLATE = r"""{%- if tools %}
{{- ']~b]system\n# Tools\n<tools>\n' }}
{%- for tool in tools %}{{ tool.function | tojson }}{{ '\n' }}{% endfor %}
{{- '</tools>\nTo call tools, reply in this format:\n<minimax:tool_call>\n<invoke name="tool-name">\n'
    + '<parameter name="param-key">param-value</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{{ ']~b]ai\n' + m.content }}
{%- if m.tool_calls %}{{ '\n<minimax:tool_call>\n' }}
{%- for tc in m.tool_calls %}{{ '<invoke name="' + tc.function.name + '">\n' }}
{%- for k, v in tc.function.arguments.items() %}{{ '<parameter name="' + k + '">' }}
{{- v if v is string else v | tojson }}{{ '</parameter>\n' }}{% endfor %}{{ '</invoke>\n' }}
{%- endfor %}{{ '</minimax:tool_call>' }}{% endif %}{{ '[e~[\n' }}
{%- elif m.role == 'tool' %}{{ ']~b]tool\n<response>' + m.content + '</response>[e~[\n' }}
{%- else %}{{ ']~b]' + m.role + '\n' + m.content + '[e~[\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ ']~b]ai\n' }}{% endif %}"""
MODEL = "minimax-m2-format"
CALL_TOKENS = 200  # the call's XML in byte-level tokens, with the whitespace a random model puts in it

server, client, opening = format_fixtures(
    SPECIAL_TOKENS, TEMPLATE, MODEL, "<minimax:tool_call>", 1024, TAG_TOKENS
)


def test_an_auto_call_opened_by_the_tag_token_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, CALL_TOKENS, temperature=1.0, seed=seed)
        invoke = r'\s*<invoke name="get_weather">\s*<parameter name="days">\s*\d'
        assert re.match("<minimax:tool_call>" + invoke, written)


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening, CALL_TOKENS)


def test_a_call_in_the_history_goes_back_into_the_prompt_in_the_format(server):
    invoke = '<invoke name="get_weather">\n<parameter name="days">2</parameter>\n'
    assert invoke + '<parameter name="units">metric</parameter>\n</invoke>' in prompt_after_a_call(
        server, MODEL
    )

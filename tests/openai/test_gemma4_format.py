"""Gemma 4's own format with the official openai client: its tool calls (inference_api/notation_tool_calls.py)
and its thought channel (inference_api/reasoning.py). A tiny random model whose byte-level tokenizer has
Gemma 4's tags as special tokens serves behind a chat template written here in Gemma 4's format (the
model's own is not on this machine), so that the server reads the format from the template and the
tokenizer as it would a Gemma 4's.

An `auto` call the model starts is decoded under the calls' grammar, the tags kept in its text, and
comes back as OpenAI's tool call; streamed, as deltas of the same call; and an answer that opens no call
is text. Thoughts in `<|channel>thought\n...<channel|>` come back as `reasoning_content`, whole and
streamed, and a JSON format holds the answer after them."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from openai.types.chat import ChatCompletion

from tests.openai.conftest import (
    BOUNDED_WEATHER,
    WEATHER_QUESTION,
    answer_without_a_call,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
)
from tests.server_fixture import RunningServer

# Gemma 4's tags as special tokens; the EOS last, under the name the tiny Qwen2's tokenizer class gives its
# own (it would add one more)
SPECIAL_TOKENS = (
    "<|turn>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    '<|"|>',
    "<|tool_response>",
    "<turn|>",
    "<|endoftext|>",
)
# Gemma 4's format, in a template of its own: the tools declared in the system turn, an assistant's calls
# as <|tool_call>call:NAME{...}<tool_call|>, tool results after <|tool_response>; with thinking on,
# `<|think|>` in the system turn, and with it off an empty thought block closed in the prompt (as
# DiffusionGemma's template closes one).
TEMPLATE = r"""{%- if enable_thinking %}{{- '<|turn>system\n<|think|><turn|>\n' }}{%- endif %}
{%- if tools %}
{{- '<|turn>system\nYou can call these tools:\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}
{{- 'To call one, write <|tool_call>call:NAME{key:value}<tool_call|><turn|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|turn>model\n' }}
{%- for call in message.tool_calls %}
{{- '<|tool_call>call:' + call.function.name + '{' }}
{%- for name, value in call.function.arguments | items %}
{{- name + ':' + ('<|"|>' + value + '<|"|>' if value is string else value | tojson) }}
{%- if not loop.last %}{{- ',' }}{%- endif %}
{%- endfor %}
{{- '}<tool_call|>' }}
{%- endfor %}
{{- '<turn|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|tool_response>' + message.content + '<turn|>\n' }}
{%- else %}
{{- '<|turn>' + message.role + '\n' + message.content + '<turn|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|turn>model\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<|channel>thought\n<channel|>' }}{%- endif %}
{%- endif %}"""
MODEL = "gemma4-format"


server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<|tool_call>")


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        assert written.startswith("<|tool_call>call:get_weather{days:") and '<|"|>' in written
        # the call, then the tag results follow (the model may write it: its answer ends there), or the EOS
        ending = written.rpartition("<tool_call|>")[2]
        assert ending in ("", "<|tool_response>", "<|endoftext|>"), written


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_an_answer_that_opens_no_call_is_text(client, opening):
    assert "<|tool_call>" not in answer_without_a_call(client, MODEL, opening)


THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True}}
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
# The tags spelled in a raw grammar (llguidance's names for the special tokens), to write known thoughts.
KNOWN_THOUGHTS = 'start: <|channel> "thought\\nClear sky.\\n\\nNo rain." <channel|> "Sunny."'


def test_thoughts_in_the_thought_channel_come_apart_whole_and_streamed(client):
    """With thinking off the prompt closes an empty block, and a model that writes one anyway (as Gemma
    4's do) still has it read apart."""
    request = dict(model=MODEL, messages=WEATHER_QUESTION, temperature=0, max_tokens=60)
    forced = {**THINKING_OFF, "guided_grammar": KNOWN_THOUGHTS}
    message = client.chat.completions.create(**request, extra_body=forced).choices[0].message
    assert (message.reasoning_content, message.content) == ("Clear sky.\n\nNo rain.", "Sunny.")
    thoughts, answer, kinds = "", "", []
    for chunk in client.chat.completions.create(**request, extra_body=forced, stream=True):
        delta = chunk.choices[0].delta
        thoughts += getattr(delta, "reasoning_content", None) or ""
        answer += delta.content or ""
        kinds += [kind for kind in ("reasoning_content", "content") if getattr(delta, kind, None)]
    assert (thoughts, answer) == ("Clear sky.\n\nNo rain.", "Sunny.")
    assert kinds == sorted(kinds, key=lambda kind: kind == "content") and len(kinds) > 2


@pytest.fixture(scope="module")
def channel_bias(server: RunningServer) -> dict[str, int]:
    """A bias that makes the model open the thought channel, and close it as soon as it may."""
    tokens = requests.post(f"{server.url}/tokenize", json={"content": "<|channel><channel|>"}, timeout=30)
    opening, closing = tokens.json()["tokens"]
    return {str(opening): 100, str(closing): 100}


def thought_first(client: openai.OpenAI, channel_bias: dict[str, int], **request) -> ChatCompletion:
    """A greedy chat answer with thinking on, the model made to open the channel and close it at once;
    what it wrote begins with the channel's tags, which grammars name as tokens."""
    forced = dict(logit_bias=channel_bias, logprobs=True, extra_body=THINKING_ON)
    completion = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, temperature=0, **forced, **request
    )
    choice = completion.choices[0]
    written = "".join(token.token for token in choice.logprobs.content)
    assert written.startswith("<|channel>thought<channel|>")
    assert "<" not in (choice.message.content or "") and not getattr(
        choice.message, "reasoning_content", None
    )
    return completion


def test_a_json_format_holds_the_answer_after_the_thoughts(client, channel_bias):
    schema = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}
    json_format = {"type": "json_schema", "json_schema": {"name": "days", "schema": schema}}
    completion = thought_first(client, channel_bias, max_tokens=40, response_format=json_format)
    assert isinstance(json.loads(completion.choices[0].message.content)["days"], int)


def test_with_tools_offered_the_model_may_think_before_it_answers(client, channel_bias):
    """The `auto` calls' grammar waits for the thoughts too: without that, their special tags would be
    out of the grammar and a model with tools offered could not think."""
    completion = thought_first(client, channel_bias, max_tokens=30, tools=[BOUNDED_WEATHER])
    choice = completion.choices[0]
    assert choice.message.content or choice.message.tool_calls

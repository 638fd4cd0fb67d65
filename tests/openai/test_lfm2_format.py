"""LFM2's tool calls with the official openai client (inference_api/pythonic_tool_calls.py, the `lfm2`
format): a Python list of calls between its `<|tool_call_start|>` and `<|tool_call_end|>` tokens. A tiny
random model whose byte-level tokenizer has LFM2's tags as special tokens serves behind LFM2.5's own chat
template (tests/frontend/chat_templates): the server reads the format from the template and the tokenizer
as it would an LFM2.5's.

An `auto` call the model starts is decoded under the calls' grammar, its tags kept in its text, and comes
back as OpenAI's tool call; streamed, as deltas of the same call; an answer that opens no call is text;
and a call in the history goes back into the prompt as the template writes it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.openai.conftest import (
    answer_without_a_call,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    prompt_after_a_call,
)

THOUGHT_TAGS = ("<think>", "</think>")  # tokens of their own, not marked special
SPECIAL_TOKENS = (
    "<|startoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    *THOUGHT_TAGS,
    "<|endoftext|>",
)
TEMPLATE = (Path(__file__).parents[1] / "frontend/chat_templates/LFM2.5-8B-A1B.jinja").read_text()
MODEL = "lfm2-format"

server, client, opening = format_fixtures(
    SPECIAL_TOKENS, TEMPLATE, MODEL, "<|tool_call_start|>", 1024, THOUGHT_TAGS
)


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        units = "('metric'|'imperial'|\"metric\"|\"imperial\")"
        assert re.fullmatch(
            rf"<\|tool_call_start\|>\[get_weather\(days=\d, units={units}\)\]<\|tool_call_end\|>", written
        )


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_an_answer_that_opens_no_call_is_text(client, opening):
    assert "<|tool_call_start|>" not in answer_without_a_call(client, MODEL, opening)


def test_a_call_in_the_history_goes_back_into_the_prompt_as_the_template_writes_it(server):
    called = "<|tool_call_start|>[get_weather(days=2, units='metric')]<|tool_call_end|>"
    assert called in prompt_after_a_call(server, MODEL)

"""Hermes calls where `<tool_call>` and `</tool_call>` are tokens of their own, as in Qwen2.5's and Qwen3's
tokenizers, which do not mark them special: llguidance takes every such `<...>` token as special, so no
text or string of a grammar holds it (tokenizer.are_grammar_tokens). A tiny random model whose
byte-level tokenizer has them so serves behind Qwen2.5's own chat template (tests/frontend/
chat_templates): an `auto` call the model opens with the `<tool_call>` token is decoded under the calls'
grammar, which names the tags as tokens, and comes back as OpenAI's tool call, whole and streamed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.openai.conftest import (
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
)

SPECIAL_TOKENS = ("<|im_start|>", "<tool_call>", "</tool_call>", "<|endoftext|>")
TAG_TOKENS = ("<tool_call>", "</tool_call>")  # tokens of their own, not marked special, as Qwen's are
TEMPLATE = (Path(__file__).parents[1] / "frontend/chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
MODEL = "qwen-tag-tokens"

server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<tool_call>", 1024, TAG_TOKENS)


def test_an_auto_call_opened_by_the_tag_token_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        assert re.fullmatch(r'<tool_call>\s{0,2}\{"name": "get_weather", .*\}\}\s{0,2}</tool_call>', written)


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)

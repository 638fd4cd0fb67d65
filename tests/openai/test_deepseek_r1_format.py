"""DeepSeek-V3's and R1's tool calls with the official openai client (inference_api/deepseek_tool_calls.py,
the `deepseek_v3` format): `function<｜tool▁sep｜>NAME` and the arguments fenced as JSON, between its tags.
The tiny random model of test_deepseek_format.py serves behind R1's own chat template
(tests/frontend/chat_templates, DeepSeek-R1-Distill-Qwen-32B's, V3's layout), which writes calls fenced
and takes no `tools`: the server reads the format from it, lists the tools in the system prompt in that
layout, and reads a call the model writes, also after thoughts."""

from __future__ import annotations

from pathlib import Path

from tests.openai.conftest import (
    BOUNDED_WEATHER,
    WEATHER_QUESTION,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    token_ids,
)
from tests.openai.test_deepseek_format import SPECIAL_TOKENS, THOUGHT_TAGS, prompt_text

TEMPLATES = Path(__file__).parents[1] / "frontend/chat_templates"
TEMPLATE = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
MODEL = "deepseek-r1-format"

OPENING = "<｜tool▁calls▁begin｜>"
server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, OPENING, 1024, THOUGHT_TAGS)


def test_an_auto_call_the_model_starts_is_fenced_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        start = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
        assert written.startswith(start + '\n```json\n{"days": ')
        assert written.endswith("}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_the_tools_are_listed_in_the_system_prompt_in_the_fenced_layout(server):
    system = prompt_text(server, WEATHER_QUESTION, [BOUNDED_WEATHER], MODEL).split("<｜User｜>")[0]
    assert "### get_weather\nDescription: The weather in Paris.\n\nParameters: {" in system
    fenced = "function<｜tool▁sep｜>tool_call_name\n```json\ntool_call_arguments\n```<｜tool▁call▁end｜>"
    assert fenced in system


def test_the_model_may_think_before_it_calls(server, client, opening):
    """R1 may think first. Its `<think>` is a token llguidance takes as special though the tokenizer does
    not mark it, which no text of the calls' grammar holds: the grammar waits for the thoughts, naming the
    tags as tokens. Made to open a block, close it at once and call."""
    think, close = token_ids(server, "<think></think>")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        temperature=0,
        max_tokens=100,
        logit_bias={think: 100, close: 100, opening: 50},
        parallel_tool_calls=False,
        logprobs=True,
    )
    choice = completion.choices[0]
    written = "".join(token.token for token in choice.logprobs.content)
    assert written.startswith("<think></think><｜tool▁calls▁begin｜>")
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"

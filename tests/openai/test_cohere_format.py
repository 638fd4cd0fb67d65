"""Command R7B's and Command A's answers with the official openai client (inference_api/
cohere_tool_calls.py, the `cohere_command4` format, and reasoning.COHERE_TAGS): a plan between
`<|START_THINKING|>` and `<|END_THINKING|>`, then actions, a JSON list of calls between `<|START_ACTION|>`
and `<|END_ACTION|>`, or a response between `<|START_RESPONSE|>` and `<|END_RESPONSE|>`. A tiny random model
whose byte-level tokenizer has Cohere's tags as special tokens serves behind Command R7B's own tool-use
template: the plan comes back as `reasoning_content`, the response as content without its tags, an `auto`
call the model opens with its tag as OpenAI's tool call, whole and streamed, and a call in the history goes
back into the prompt as the template writes it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.openai.conftest import (
    BOUNDED_WEATHER,
    WEATHER_QUESTION,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    prompt_after_a_call,
    token_ids,
)

SPECIAL_TOKENS = (
    "<|START_OF_TURN_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_ACTION|>",
    "<|END_ACTION|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
    "<|START_TOOL_RESULT|>",
    "<|END_TOOL_RESULT|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|endoftext|>",
)
TEMPLATE = (
    Path(__file__).parents[1] / "frontend/chat_templates/CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"
).read_text()
MODEL = "cohere-format"
# Known answers after the plan, spelled in raw grammars (llguidance names special tokens between angle
# brackets by their text).
RESPONSE = 'start: <|START_RESPONSE|> "Sunny." <|END_RESPONSE|>'
ACTION = (
    'start: <|START_ACTION|> "[\\n    {\\"tool_call_id\\": \\"0\\", \\"tool_name\\": \\"get_weather\\", '
    '\\"parameters\\": {\\"days\\": 3, \\"units\\": \\"metric\\"}}\\n]" <|END_ACTION|>'
)

server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<|START_ACTION|>", 6144)


@pytest.fixture(scope="module")
def empty_plan(server) -> dict[str, int]:
    """A bias that makes the model open a plan, close it at once, then open a response or actions (every
    grammar lets a plan come first: reasoning.thoughts_first), in that order of strength."""
    tags = "<|START_THINKING|><|END_THINKING|><|START_RESPONSE|><|START_ACTION|>"
    return dict(zip(token_ids(server, tags), (100, 90, 80, 80), strict=True))


def planned(client, empty_plan: dict[str, int], grammar: str, **request):
    """A greedy answer to WEATHER_QUESTION, an empty plan first, then what `grammar` spells; and what the
    model wrote, its tags kept."""
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_tokens=200,
        logit_bias=empty_plan,
        logprobs=True,
        extra_body={"guided_grammar": grammar},
        **request,
    )
    choice = completion.choices[0]
    return choice, "".join(token.token for token in choice.logprobs.content)


def test_the_response_is_the_content_without_its_tags_whole_and_streamed(client, empty_plan):
    choice, written = planned(client, empty_plan, RESPONSE)
    assert written == "<|START_THINKING|><|END_THINKING|><|START_RESPONSE|>Sunny.<|END_RESPONSE|>"
    assert (choice.message.content, getattr(choice.message, "reasoning_content", None)) == ("Sunny.", None)
    request = dict(
        model=MODEL, messages=WEATHER_QUESTION, temperature=0, max_tokens=80, logit_bias=empty_plan
    )
    streamed = client.chat.completions.create(**request, extra_body={"guided_grammar": RESPONSE}, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == "Sunny."


def test_a_plan_then_an_action_is_the_call(client, empty_plan):
    choice, written = planned(client, empty_plan, ACTION, tools=[BOUNDED_WEATHER])
    assert written.startswith("<|START_THINKING|><|END_THINKING|><|START_ACTION|>[")
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"days": 3, "units": "metric"}')


def test_an_auto_call_the_model_opens_with_its_tag_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, _ = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        parameters = r'\{"days": \d, "units": "(metric|imperial)"\}'
        call = rf'\{{"tool_call_id": "\d+", "tool_name": "get_weather", "parameters": {parameters}\}}'
        assert re.fullmatch(rf"<\|START_ACTION\|>\s*\[\s*{call}\s*\]\s*<\|END_ACTION\|>", written)


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_an_answer_that_does_not_call_is_a_response_whose_tags_stay_out_of_the_content(server, client):
    """tool_choice none: a response, the model's own tag opening it (a grammar of text alone would refuse
    the tag), read without its tags."""
    [response_open] = token_ids(server, "<|START_RESPONSE|>")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        tool_choice="none",
        max_tokens=20,
        temperature=0,
        logit_bias={response_open: 100},
        logprobs=True,
    )
    choice = completion.choices[0]
    written = b"".join(bytes(token.bytes) for token in choice.logprobs.content).decode(errors="ignore")
    assert written.startswith("<|START_RESPONSE|>") and not choice.message.tool_calls
    assert choice.message.content == written.replace("<|START_RESPONSE|>", "").replace("<|END_RESPONSE|>", "")


def test_a_call_in_the_history_goes_back_into_the_prompt_as_the_template_writes_it(server):
    written = prompt_after_a_call(server, MODEL)
    called = '{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"days": 2, "units": "metric"}}'
    assert re.search(rf"<\|START_ACTION\|>\[\s*{re.escape(called)}\s*\]<\|END_ACTION\|>", written)
    assert '"results": {\n            "0": "Sunny, 21 C."' in written

"""DeepSeek-V3.1's tool calls with the official openai client (inference_api/deepseek_tool_calls.py, the
`deepseek_v31` format): `name<｜tool▁sep｜>{...}` between its tags. A tiny random model whose byte-level
tokenizer has DeepSeek's tags as special tokens serves behind DeepSeek-V3.1's own chat template
(tests/frontend/chat_templates), which takes no `tools` and adds a call's arguments to text: the server
reads the format from the template and the tokenizer as it would DeepSeek-V3.1's, and lists the tools in
the system prompt as V3.1's model card does.

An `auto` call the model starts is decoded under the calls' grammar, its tags kept in its text, and comes
back as OpenAI's tool call; streamed, as deltas of the same call; an answer that opens no call is text;
a conversation goes on after a call, which reaches the template with its arguments as JSON text; and
thoughts the prompt opens end at the closing tag, a token, before a JSON answer."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import requests

from tests.openai.conftest import (
    BOUNDED_WEATHER,
    WEATHER_QUESTION,
    answer_without_a_call,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    prompt_after_a_call,
    token_ids,
)

# DeepSeek's turn, thought and tool tags as tokens of their own; the EOS last, under the name the tiny Qwen2's
# tokenizer class gives its own (it would add one more)
SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<|endoftext|>",
)
THOUGHT_TAGS = ("<think>", "</think>")  # tokens of their own, not marked special, as DeepSeek's are
TEMPLATE = (Path(__file__).parents[1] / "frontend/chat_templates/deepseek-ai-DeepSeek-V3.1.jinja").read_text()
MODEL = "deepseek-v31-format"

# The system prompt that lists the tools takes some 500 of the byte-level tokens.
OPENING = "<｜tool▁calls▁begin｜>"
server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, OPENING, 1024, THOUGHT_TAGS)


def prompt_text(server, messages: list[dict], tools: list[dict], model: str = MODEL) -> str:
    """The prompt a chat request of these messages and tools is answered from, as text."""
    body = {"model": model, "messages": messages, "tools": tools, "return_token_strs": True}
    return "".join(requests.post(f"{server.url}/tokenize", json=body, timeout=30).json()["token_strs"])


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, call = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        start = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        assert written.startswith(start + '{"days": ')
        assert written.endswith("<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_an_answer_that_opens_no_call_is_text(client, opening):
    assert "tool" not in answer_without_a_call(client, MODEL, opening)


def test_the_tools_are_listed_in_the_system_prompt_as_the_model_card_lists_them(server):
    prompt = prompt_text(server, WEATHER_QUESTION, [BOUNDED_WEATHER])
    parameters = json.dumps(BOUNDED_WEATHER["function"]["parameters"])
    listing = f"### get_weather\nDescription: The weather in Paris.\n\nParameters: {parameters}\n"
    system, user = prompt.split("<｜User｜>")
    assert system.startswith("## Tools\nYou have access to the following tools:\n\n")  # (no BOS here)
    assert listing in system and "<tool_call>" not in system
    assert "<｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>" in prompt


def test_a_conversation_goes_on_after_a_call_its_arguments_in_the_template_as_json(server):
    """The template adds the arguments to text: a JSON object there, not a 400 for adding a dict."""
    called = '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"days": 2, "units": "metric"}<｜tool▁call▁end｜>'
    assert called + "<｜tool▁calls▁end｜>" in prompt_after_a_call(server, MODEL)


def test_thoughts_the_prompt_opened_end_at_the_closing_token_then_the_json_answer(server, client):
    """V3.1's template opens the thoughts where thinking is on. Its `</think>` is a token llguidance
    takes as special though the tokenizer does not mark it: the JSON grammar waits for it by name (a text
    lexeme could never hold it, and the thoughts would never end)."""
    [close] = token_ids(server, "</think>")
    schema = BOUNDED_WEATHER["function"]["parameters"]
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}},
        logit_bias={close: 100},
        logprobs=True,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    choice = completion.choices[0]
    assert choice.logprobs.content[0].token == "</think>"
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_the_anthropic_client_goes_on_after_a_tool_use_with_its_result(server):
    """A tool_use's input reaches V3.1's template, which adds it to text, as JSON, as chat's calls do."""
    anthropic = server.anthropic_client()
    tool = {"name": "get_weather", "input_schema": BOUNDED_WEATHER["function"]["parameters"]}
    request = dict(model=MODEL, max_tokens=60, tools=[tool], extra_body={"temperature": 0})
    first = anthropic.messages.create(**request, messages=WEATHER_QUESTION, tool_choice={"type": "any"})
    [use] = [block for block in first.content if block.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = anthropic.messages.create(**{**request, "max_tokens": 8}, messages=history)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")

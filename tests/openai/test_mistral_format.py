"""Mistral's tool calls and thoughts with the official openai and anthropic clients
(inference_api/mistral_tool_calls.py, inference_api/reasoning.py). A tiny random model whose byte-level
tokenizer has Mistral's tags as special tokens (v11's, with `[ARGS]`, and `[THINK]`) serves behind a chat
template written here in Mistral's layout, which, as Mistral's own, refuses a call id that is not 9
letters and digits, and tells the model to think between `[THINK]` tags, as Magistral's system prompt does
(the models' own templates are not on this machine): the server reads the formats from the template and
the tokenizer as it would a Magistral's.

An `auto` call the model starts is decoded under the calls' grammar, its tags kept in its text, and comes
back as OpenAI's tool call with an id Mistral's template takes; streamed, as deltas of the same call; an
answer that opens no call is text; and a conversation that goes on after a call, with another server's
ids, reaches the template with ids it takes, the same for the call and its result. Thoughts in
`[THINK]...[/THINK]` come back as `reasoning_content`, whole and streamed, and a model offered tools may
think before it calls."""

from __future__ import annotations

import re

import requests

from tests.openai.conftest import (
    BOUNDED_WEATHER,
    WEATHER_QUESTION,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    token_ids,
)

# Mistral's tags as special tokens; the EOS last, under the name the tiny Qwen2's tokenizer class gives its
# own (it would add one more)
SPECIAL_TOKENS = (
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[THINK]",
    "[/THINK]",
    "<|endoftext|>",
)
# Mistral's layout since its v11 tokenizers, as its templates write it: the system prompt (Magistral's
# names the thought tags), the tools before the last user turn, each call as
# [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}, and a result after the id of its call; with thinking off, an
# empty thought block closed in the prompt.
TEMPLATE = r"""{{- '[SYSTEM_PROMPT]Draft your thoughts between [THINK] and [/THINK] first.[/SYSTEM_PROMPT]' }}
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and message == user_messages[-1] %}
{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}
{%- if call.id is not string or call.id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}
{{- '[TOOL_CALLS]' + call.function.name + '[CALL_ID]' + call.id }}
{{- '[ARGS]' + call.function.arguments | tojson }}
{%- endfor %}
{{- '<|endoftext|>' }}
{%- elif message.role == 'assistant' %}{{- message.content + '<|endoftext|>' }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]' + message.tool_call_id + ':' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
{%- if enable_thinking is defined and not enable_thinking %}{{- '[THINK][/THINK]' }}{%- endif %}"""
MODEL = "mistral-format"


server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "[TOOL_CALLS]")


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, call = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        assert written.startswith('[TOOL_CALLS]get_weather[ARGS]{"days": ')
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id)  # as Mistral's templates take it back


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_an_answer_that_opens_no_call_is_text(server, client, opening):
    [think] = token_ids(server, "[THINK]")
    bias = {opening: -100, think: -100}  # neither a call nor thoughts
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        temperature=0,
        max_tokens=20,
        logit_bias=bias,
    )
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert "[TOOL_CALLS]" not in choice.message.content


def test_a_conversation_goes_on_after_a_call_with_another_servers_ids(server, client, opening):
    """An OpenAI-style id, which Mistral's template refuses, reaches it as 9 letters and digits, the same
    in the call and in its result."""
    call = {"id": "call_9f8e7d6c5b4a39281706f5e4", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"days": 2, "units": "metric"}'}
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C."},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[BOUNDED_WEATHER], max_tokens=8
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {"model": MODEL, "messages": history, "tools": [BOUNDED_WEATHER], "return_token_strs": True}
    prompt = "".join(requests.post(f"{server.url}/tokenize", json=body, timeout=30).json()["token_strs"])
    [(called, answered)] = re.findall(r"\[CALL_ID\](\w+)\[ARGS\].*\[TOOL_RESULTS\](\w+):Sunny", prompt)
    assert called == answered and re.fullmatch("[A-Za-z0-9]{9}", called)


def test_the_anthropic_client_goes_on_after_a_tool_use_with_its_result(server):
    """Anthropic's tool_use ids (`toolu_...`) reach Mistral's template as ids it takes."""
    anthropic = server.anthropic_client()
    tool = {"name": "get_weather", "input_schema": BOUNDED_WEATHER["function"]["parameters"]}
    off = {"type": "disabled"}  # a random model asked to think first writes whitespace until max_tokens
    request = dict(model=MODEL, max_tokens=60, tools=[tool], thinking=off, extra_body={"temperature": 0})
    first = anthropic.messages.create(**request, messages=WEATHER_QUESTION, tool_choice={"type": "any"})
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and not re.fullmatch("[A-Za-z0-9]{9}", use.id)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = anthropic.messages.create(**{**request, "max_tokens": 8}, messages=history)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")


THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def test_thoughts_between_the_think_tags_come_apart_whole_and_streamed(server, client):
    """With thinking off the prompt closes an empty block, and a model that writes one anyway still has
    it read apart."""
    think, close = token_ids(server, "[THINK][/THINK]")
    known = (
        f'start: <[{think}]> "Clear sky." <[{close}]> "Sunny."'  # the tags by id, as the server names them
    )
    forced = {**THINKING_OFF, "guided_grammar": known}
    request = dict(model=MODEL, messages=WEATHER_QUESTION, temperature=0, max_tokens=40, extra_body=forced)
    message = client.chat.completions.create(**request).choices[0].message
    assert (message.reasoning_content, message.content) == ("Clear sky.", "Sunny.")
    thoughts, answer = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        thoughts += getattr(delta, "reasoning_content", None) or ""
        answer += delta.content or ""
    assert (thoughts, answer) == ("Clear sky.", "Sunny.")


def test_with_tools_offered_the_model_may_think_before_it_answers(server, client):
    """The `auto` calls' grammar waits for the thoughts: without that, their special tags would be out of
    the grammar, and a model offered tools could not think. Made to open the block and close it at once."""
    think, close = token_ids(server, "[THINK][/THINK]")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        temperature=0,
        max_tokens=30,
        logit_bias={think: 100, close: 100},
        logprobs=True,
    )
    choice = completion.choices[0]
    assert "".join(token.token for token in choice.logprobs.content).startswith("[THINK][/THINK]")
    assert "[" not in (choice.message.content or "") and not getattr(
        choice.message, "reasoning_content", None
    )
    assert choice.message.content or choice.message.tool_calls

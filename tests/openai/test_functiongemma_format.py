"""FunctionGemma's tool calls with the official openai client (inference_api/notation_tool_calls.py, the
`functiongemma` format): Gemma 4's notation under FunctionGemma's own tags,

    <start_function_call>call:get_weather{days:2,units:<escape>metric<escape>}<end_function_call>

A tiny random model whose byte-level tokenizer has FunctionGemma's tags as special tokens serves behind a
chat template written here in its format (the model's own is not on this machine; its documented turns:
the tools declared in a developer turn, calls in the model's turn, results after
`<start_function_response>`), so that the server finds the format from the template and the tokenizer as
it would FunctionGemma's (google/functiongemma-270m-it, a Gemma 3 270M, which the server serves).

An `auto` call the model starts is decoded under the calls' grammar, the tags kept in its text, and comes
back as OpenAI's tool call; streamed, as deltas of the same call; an answer that opens no call is text;
and a call in the history goes back to the template as its arguments, which it writes in the notation,
its result by the function's name."""

from __future__ import annotations

import json

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

# FunctionGemma's tags as special tokens; the EOS last, under the name the tiny Qwen2's tokenizer class
# gives its own (it would add one more)
SPECIAL_TOKENS = (
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_function_declaration>",
    "<end_function_declaration>",
    "<start_function_call>",
    "<end_function_call>",
    "<start_function_response>",
    "<end_function_response>",
    "<escape>",
    "<|endoftext|>",
)
# FunctionGemma's format, in a template of its own: each tool declared in the developer turn, an
# assistant's calls in the notation, each string between <escape> tokens, a result after
# <start_function_response> by its function's name (which OpenAI's tool messages do not carry: the
# server gives it).
TEMPLATE = r"""{%- if tools %}
{{- '<start_of_turn>developer\nYou are a model that can do function calling with the following functions' }}
{%- for tool in tools %}
{{- '<start_function_declaration>declaration:' + tool.function.name + (tool.function | tojson) }}
{{- '<end_function_declaration>' }}
{%- endfor %}
{{- '<end_of_turn>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<start_of_turn>model\n' }}
{%- for call in message.tool_calls %}
{{- '<start_function_call>call:' + call.function.name + '{' }}
{%- for name, value in call.function.arguments | items %}
{{- name + ':' + ('<escape>' + value + '<escape>' if value is string else value | tojson) }}
{%- if not loop.last %}{{- ',' }}{%- endif %}
{%- endfor %}
{{- '}<end_function_call>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{{- '<start_function_response>response:' + message.name + '{value:<escape>' + message.content + '<escape>}' }}
{{- '<end_function_response><end_of_turn>\n' }}
{%- else %}
{{- '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' }}
{{- message.content + '<end_of_turn>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"""
MODEL = "functiongemma-format"


server, client, opening = format_fixtures(SPECIAL_TOKENS, TEMPLATE, MODEL, "<start_function_call>")


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, call = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        assert written.startswith("<start_function_call>call:get_weather{days:")
        # the call, then the tag results follow (the model may write it: its answer ends there), or the EOS
        ending = written.rpartition("<end_function_call>")[2]
        assert "units:<escape>" in written and ending in ("", "<start_function_response>", "<|endoftext|>")
        assert json.loads(call.function.arguments)["units"] in ("metric", "imperial")


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_an_answer_that_opens_no_call_is_text(client, opening):
    assert "<start_function_call>" not in answer_without_a_call(client, MODEL, opening)


def test_a_call_in_the_history_is_written_back_in_the_notation(server):
    written = prompt_after_a_call(server, MODEL)
    call = "<start_function_call>call:get_weather{days:2,units:<escape>metric<escape>}<end_function_call>"
    result = "<start_function_response>response:get_weather{value:<escape>Sunny, 21 C.<escape>}"
    assert call in written and result in written


def test_the_tag_results_follow_ends_the_answer_after_its_calls(server, client, opening):
    """FunctionGemma writes <start_function_response> after its calls (its template puts the results
    there), which vLLM's users add as a stop: the `auto` grammar takes it after the calls, and it ends the
    answer there."""
    [response] = token_ids(server, "<start_function_response>")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[BOUNDED_WEATHER],
        max_tokens=100,
        logit_bias={opening: 100, response: 100},
        parallel_tool_calls=False,  # else the biased opening tag would go on with more calls
        logprobs=True,
    )
    choice = completion.choices[0]
    written = "".join(token.token for token in choice.logprobs.content)
    assert written.endswith("<end_function_call><start_function_response>"), written
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert not choice.message.content

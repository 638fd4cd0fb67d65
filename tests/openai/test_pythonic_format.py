"""vLLM's `pythonic` tool calls with the official openai client (inference_api/pythonic_tool_calls.py):
the answer is a Python list of calls and nothing else,

    [get_weather(days=2, units='metric')]

as Llama 3.2's lightweight models and ToolACE write it behind a template that asks for it. A tiny random
model with a byte-level tokenizer serves behind a chat template written here in that manner, the format
named on the command line (`--tool-call-parser pythonic`, as vLLM has it named: nothing in a template
marks it).

An `auto` call the model starts (its answer opening with `[`) is decoded under the calls' grammar and
comes back as OpenAI's tool call; streamed, as deltas of the same call; an answer that does not open
with `[` is text; and a call in the history goes back to the template, which writes it as Python."""

from __future__ import annotations

from tests.openai.conftest import (
    answer_without_a_call,
    assert_forced_call_streams_as_the_whole_one,
    forced_weather_call,
    format_fixtures,
    prompt_after_a_call,
)

# A Llama 3.2-like pythonic template: the tools as JSON in the system turn, with how to call them; an
# assistant's calls as the Python list it would write; a result in an `ipython` turn.
TEMPLATE = r"""{%- if tools %}
{{- '<|system|>\nTo call functions, answer [func_name1(param=value), func_name2(param=value)] and nothing '
    'else. The functions:\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|assistant|>\n[' }}
{%- for call in message.tool_calls %}
{{- call.function.name + '(' }}
{%- for name, value in call.function.arguments | items %}
{{- name + '=' + (value | tojson) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']\n' }}
{%- elif message.role == 'tool' %}
{{- '<|ipython|>\n' + message.content + '\n' }}
{%- else %}
{{- '<|' + message.role + '|>\n' + message.content + '\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"""
MODEL = "pythonic-format"


server, client, opening = format_fixtures(
    ("<|endoftext|>",), TEMPLATE, MODEL, "[", options=("--tool-call-parser", "pythonic")
)


def test_an_auto_call_the_model_starts_is_whole_and_read_back_as_a_valid_call(client, opening):
    for seed in range(3):
        written, call = forced_weather_call(client, MODEL, opening, temperature=1.0, seed=seed)
        assert written.startswith("[get_weather(days=") and written.endswith(")]")
        assert call.id.startswith("call_")


def test_a_streamed_call_comes_as_deltas_of_the_same_call(client, opening):
    assert_forced_call_streams_as_the_whole_one(client, MODEL, opening)


def test_an_answer_that_does_not_open_a_list_is_text(client, opening):
    assert not answer_without_a_call(client, MODEL, opening).lstrip().startswith("[")


def test_a_call_in_the_history_is_written_back_as_python(server):
    written = prompt_after_a_call(server, MODEL)
    assert '<|assistant|>\n[get_weather(days=2, units="metric")]\n<|ipython|>\nSunny, 21 C.' in written

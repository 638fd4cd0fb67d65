"""gpt-oss's harmony messages (inference_api/harmony.py, answers.HarmonyReader) read apart on every chat
API: the analysis channel as thoughts, the final channel as the answer, a message to `functions.NAME`
as a tool call; and the grammars that put a forced call or a JSON answer in its message.

The server (tests/harmony_server.py) serves the default model with harmony's markers as its special
tokens and gpt-oss's real chat template. Where a test needs messages the model would not write, a
`guided_grammar` that names the markers writes them; the official `openai` and `anthropic` clients
read the answers, as a user's code would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import llguidance
import llguidance.hf
import openai
import pytest
import requests
from transformers import AutoTokenizer

from inference_api.answers import HarmonyReader
from inference_api.harmony import call_grammar, final_answer
from inference_api.reasoning import HARMONY, reasoning_format
from inference_api.structured_output import json_schema_grammar
from inference_api.tokenizer import load_tokenizer
from inference_api.tool_calls import ToolRequest
from tests.conftest import whole_default_model_copy
from tests.frontend.test_openapi_e2e import documented
from tests.harmony_server import TEMPLATE, harmony_server
from tests.server_fixture import RunningServer

MODEL = "harmony-smollm2"
GREETING = [{"role": "user", "content": "Hi! Who are you?"}]
THOUGHTS = "The user greets me. I greet them back."
ANSWER = "Hello there! I am a small model."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_HEADER = "commentary to=functions.get_weather "


def lark_string(text: str) -> str:
    return json.dumps(text)


def thinks_then(*rest: str) -> str:
    """A grammar that writes THOUGHTS on the analysis channel, then the message `rest` spells out."""
    analysis = f'<|channel|> "analysis" <|message|> {lark_string(THOUGHTS)} <|end|> <|start|> "assistant"'
    return f"start: {analysis} " + " ".join(rest)


def answers(text: str) -> str:
    return thinks_then('<|channel|> "final" <|message|>', lark_string(text))


def calls(arguments: str) -> str:
    return thinks_then(
        f"<|channel|> {lark_string(CALL_HEADER)} <|constrain|> {lark_string('json')} <|message|>",
        lark_string(arguments),
    )


@pytest.fixture(scope="module")
def model_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("harmony")


@pytest.fixture(scope="module")
def server(model_directory: Path) -> Iterator[RunningServer]:
    with harmony_server(model_directory) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return server.anthropic_client()


@pytest.fixture(scope="module")
def tokenizer(server: RunningServer, model_directory: Path):
    """The served model's tokenizer, harmony's markers its special tokens."""
    return AutoTokenizer.from_pretrained(model_directory / MODEL)


@pytest.fixture(scope="module")
def grammar_tokens(tokenizer) -> llguidance.LLTokenizer:
    """The tokenizer as the backend's grammars see it (0.4 s to build: once)."""
    return llguidance.hf.from_tokenizer(tokenizer)


def test_the_analysis_is_the_thoughts_and_the_final_message_the_answer_whole_and_streamed(client, tokenizer):
    request = dict(
        model=MODEL,
        messages=GREETING,
        max_tokens=96,
        temperature=0,
        extra_body={"guided_grammar": answers(ANSWER)},
    )
    completion = client.chat.completions.create(**request)
    message = completion.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER)
    assert completion.choices[0].finish_reason == "stop"
    thought_tokens = len(tokenizer.encode(THOUGHTS, add_special_tokens=False))
    assert completion.usage.completion_tokens_details.reasoning_tokens == thought_tokens

    kinds, thoughts, answer = [], "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        kinds += [kind for kind in ("reasoning_content", "content") if getattr(delta, kind, None)]
        thoughts += getattr(delta, "reasoning_content", None) or ""
        answer += delta.content or ""
    assert (thoughts, answer) == (THOUGHTS, ANSWER)
    assert kinds.count("reasoning_content") > 3 and kinds.count("content") > 3  # as they come
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")


def test_answers_are_as_the_openapi_document_says(server):
    for stream in (False, True):
        body = {
            "model": MODEL,
            "messages": GREETING,
            "max_tokens": 96,
            "temperature": 0,
            "stream": stream,
            "guided_grammar": answers(ANSWER),
        }
        response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        documented(response, "post", "/v1/chat/completions")
        assert "reasoning_content" in response.text and "<|" not in response.text


def test_a_message_to_a_function_is_a_tool_call_whole_and_streamed(client):
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        max_tokens=96,
        temperature=0,
        extra_body={"guided_grammar": calls('{"city": "Paris"}')},
    )
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content, choice.message.reasoning_content) == (None, THOUGHTS)
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(client.chat.completions.create(**request, stream=True))
    [streamed] = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_ends_the_answer_though_the_model_does_not_call_its_marker_an_end_token(client):
    """The model writes on, as if the call had been answered: the answer ends at `<|call|>` all the same
    (harmony.harmony_params), and the result it made up is not read as its thoughts."""
    made_up = '<|start|> "functions.get_weather to=assistant" <|channel|> "commentary" <|message|> "Sunny."'
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        max_tokens=96,
        temperature=0,
        extra_body={"guided_grammar": calls('{"city": "Paris"}') + " <|call|> " + made_up},
    )
    message = completion.choices[0].message
    assert (message.reasoning_content, len(message.tool_calls)) == (THOUGHTS, 1)
    assert completion.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_is_a_call_message_with_valid_arguments(client, tool_choice):
    """The call's grammar puts the model's own arguments in a message to the function (SmolLM2 goes
    there at once, thinking nothing)."""
    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, {"type": "function", "function": {"name": "get_time", "description": "The time."}}],
        tool_choice=tool_choice,
        max_tokens=64,
        temperature=0,
    ).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_tool_choice_none_and_a_json_schema_answer_in_the_final_message(client):
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = dict(model=MODEL, messages=weather, max_tokens=24, temperature=0)
    choice = client.chat.completions.create(**request, tools=[WEATHER], tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    mood = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}
    schema = {"type": "json_schema", "json_schema": {"name": "mood", "schema": mood}}
    message = client.chat.completions.create(**request, response_format=schema).choices[0].message
    assert json.loads(message.content)["mood"] in ("happy", "sad")


def test_the_thoughts_and_calls_go_back_to_the_template_as_harmony_messages(client, tokenizer):
    """An agent's loop sends back the thoughts (reasoning_content, gpt-oss's `thinking`), the call and
    its result: the prompt is the one transformers renders from them."""
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    sent = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
    ]
    usage = client.chat.completions.create(
        model=MODEL, messages=sent, tools=[WEATHER], max_tokens=1, temperature=0
    ).usage
    as_template_takes = [
        sent[0],
        {
            "role": "assistant",
            "thinking": "I look it up.",
            "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        sent[2],
    ]
    prompt = tokenizer.apply_chat_template(
        as_template_takes, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert "<|channel|>analysis<|message|>I look it up.<|end|>" in prompt
    assert usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_anthropic_messages_give_a_forced_tool_use_whole_and_streamed(claude):
    """The Messages API takes no grammar of the request's own: a named tool's forces the call (its
    thinking blocks come from the reader the Responses API's test below holds to its thoughts)."""
    asked = dict(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[
            {
                "name": "get_weather",
                "description": "The weather.",
                "input_schema": WEATHER["function"]["parameters"],
            }
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    used = claude.messages.create(**asked)
    [block] = used.content
    assert (block.type, block.name, used.stop_reason) == ("tool_use", "get_weather", "tool_use")
    assert isinstance(block.input["city"], str)
    with claude.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    assert [(block.name, block.input) for block in streamed.content] == [(block.name, block.input)]


def test_a_prefill_goes_on_in_the_final_message_through_anthropic_and_chat(claude, client, tokenizer):
    """A last assistant message is a prefill (Anthropic's, chat's continue_final_message): in the final
    message, which the prompt opens (right after `<|start|>assistant` it would be the header), and the
    answer goes on in it as content."""
    prefill = "Hello! I am"
    asked = [*GREETING, {"role": "assistant", "content": prefill}]
    answer = claude.messages.create(model=MODEL, max_tokens=12, messages=asked, extra_body={"temperature": 0})
    opened = tokenizer.apply_chat_template(GREETING, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(opened + "<|channel|>final<|message|>" + prefill, add_special_tokens=False)
    assert answer.usage.input_tokens == len(prompt)
    # What the model writes after that prompt, markers and all, read as the rest of the final message.
    raw = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"skip_special_tokens": False}
    )
    reader = HarmonyReader(None, prefilled=True)
    reasoning, content = reader.read(raw.choices[0].text, True)
    assert content and [(block.type, block.text) for block in answer.content] == [("text", content)]
    continued = client.chat.completions.create(
        model=MODEL,
        messages=asked,
        max_tokens=12,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert (continued.choices[0].message.content, continued.usage.prompt_tokens) == (content, len(prompt))
    with pytest.raises(openai.BadRequestError) as refused:  # a JSON answer has a message of its own
        client.chat.completions.create(
            model=MODEL,
            messages=asked,
            max_tokens=12,
            response_format={"type": "json_object"},
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
    assert refused.value.body["param"] == "response_format"
    # A forced tool_use cannot come in the final message: a 400 naming tool_choice.
    weather = {
        "name": "get_weather",
        "description": "The weather.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=MODEL, max_tokens=12, messages=asked, tools=[weather], tool_choice={"type": "any"}
        )
    assert refused.value.body["error"]["message"].startswith("tool_choice any or tool forces a tool_use")
    # tool_choice none keeps no grammar: one that opens the final message would write its markers into it.
    unforced = claude.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=asked,
        tools=[weather],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    [block] = unforced.content
    assert block.type == "text" and block.text and "<|" not in block.text


def test_the_responses_api_gives_a_forced_call_or_a_json_answer(client):
    """The Responses API takes no grammar of the request's own either: a forced call, and a JSON answer
    in the final message (text.format), show that its answers are read as harmony."""
    asked = dict(model=MODEL, input="What is the weather in Paris?", max_output_tokens=64, temperature=0)
    tool = {"type": "function", **WEATHER["function"]}
    called = client.responses.create(**asked, tools=[tool], tool_choice="required")
    [call] = called.output
    assert (call.type, call.name) == ("function_call", "get_weather")
    assert isinstance(json.loads(call.arguments)["city"], str)
    mood = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}
    answered = client.responses.create(
        **asked, text={"format": {"type": "json_schema", "name": "mood", "schema": mood}}
    )
    [message] = answered.output
    assert json.loads(message.content[0].text)["mood"] in ("happy", "sad")


ROLE_HEADER_CALL = (
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}'
)


@pytest.mark.parametrize(
    ("text", "thoughts", "content", "called"),
    [
        (
            "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
            "Hm.",
            "Hi!",
            [],
        ),
        # Two messages of one kind are set apart; a preamble on commentary is content.
        (
            "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Let me see.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.",
            "A.\n\nB.",
            "Let me see.\n\nDone.",
            [],
        ),
        # A call, its recipient in the channel's header or in the role's.
        (
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
            "",
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            "<|channel|>analysis<|message|>Rome.<|end|>" + ROLE_HEADER_CALL,
            "Rome.",
            "",
            [("get_weather", '{"city": "Rome"}')],
        ),
        # A message to a tool of the model's own, not the request's, is thoughts.
        ('<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|end|>', '{"q": "x"}', "", []),
        # A model that writes no harmony: its text is the content; a header cut short is nothing.
        ("Just <b>text</b>.", "", "Just <b>text</b>.", []),
        ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|chan", "Hm.", "", []),
        ("<|channel|>final<|message|>a <| b", "", "a <| b", []),
    ],
)
def test_the_harmony_reader_reads_the_same_however_the_text_is_cut(text, thoughts, content, called):
    tools = ToolRequest([WEATHER], "auto", parser="harmony")
    for size in range(1, len(text) + 1):
        reader = HarmonyReader(tools)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        said = [reader.read(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert ("".join(r for r, _ in said), "".join(c for _, c in said)) == (thoughts, content), size
        assert [
            (call["function"]["name"], call["function"]["arguments"]) for call in reader.tool_calls
        ] == called


def test_a_call_with_no_tools_offered_is_thoughts_and_a_long_header_is_no_harmony():
    reader = HarmonyReader(None)
    assert reader.read(ROLE_HEADER_CALL, True) == ('{"city": "Rome"}', "") and reader.tool_calls == []
    text = "x" * 300
    assert HarmonyReader(None).read(text, False) == ("", text)  # past 256 characters, no header


def test_a_prefilled_answer_is_read_as_the_final_messages_text_from_its_first_character():
    text = "sunny.<|end|><|start|>assistant<|channel|>final<|message|>Yes."
    assert HarmonyReader(None, prefilled=True).read(text, True) == ("", "sunny.\n\nYes.")
    assert HarmonyReader(None).read(text, True) == ("", "Yes.")  # without: its text would be a header


def test_auto_reads_harmony_where_the_markers_are_tokens_and_the_template_writes_channels(
    model_directory, server
):
    harmony = load_tokenizer(str(model_directory / MODEL))
    plain = load_tokenizer(str(whole_default_model_copy()))
    template = TEMPLATE.read_text()
    chatml = (TEMPLATE.parent / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert reasoning_format("auto", harmony, template) == HARMONY
    assert reasoning_format("auto", plain, template) is None  # the markers are text, not tokens
    assert reasoning_format("auto", harmony, chatml) is None
    assert reasoning_format("none", harmony, template) is None
    assert reasoning_format("openai_gptoss", plain, chatml) == HARMONY


@pytest.mark.parametrize(
    ("grammar", "text", "takes"),
    [
        ("json", '<|channel|>final<|message|>{"city": "Oslo"}', True),
        (
            "json",
            "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
            '<|channel|>final<|message|>{"city": "Oslo"}',
            True,
        ),
        ("json", '<|channel|>analysis<|message|>{"city": "Oslo"}', False),  # thoughts are not the answer
        ("json", "<|channel|>final<|message|>Oslo", False),
        (
            "call",
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
            True,
        ),
        ("call", "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}", False),
        (
            "call",
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": "Oslo"}',
            False,
        ),
        ("call", "<|channel|>final<|message|>Oslo", False),
    ],
)
def test_the_grammars_put_the_answer_or_the_call_in_its_message(
    tokenizer, grammar_tokens, grammar, text, takes
):
    parameters = WEATHER["function"]["parameters"]
    grammars = {
        "json": final_answer(json_schema_grammar(parameters, "schema")),
        "call": call_grammar({"get_weather": parameters}),
    }
    assert llguidance.LLMatcher.validate_grammar(grammars[grammar]) == ""
    matcher = llguidance.LLMatcher(grammar_tokens, grammars[grammar], log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    took = all(matcher.consume_token(token) for token in ids) and matcher.is_accepting()
    assert took == takes

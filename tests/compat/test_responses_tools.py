"""Tool use on OpenAI's Responses API with the official openai client, unchanged: forced calls whose
arguments always fit the tool's parameters, the round trip (function_call, then function_call_output, then
a text answer) read as chat reads the same conversation, streamed calls as OpenAI's events in order (each
checked against the OpenAPI document), text before a call, parallel_tool_calls, allowed_tools, a call cut
by max_output_tokens and text.format, on the real default model; the 400s for bad tools and items on the
mock, since the frontend refuses them before the backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import requests
from jsonschema import Draft202012Validator

from backend.messages import SamplingParams
from inference_api.apis.responses.items import input_messages
from inference_api.apis.responses.request import ResponsesRequest
from inference_api.apis.responses.routes import ModelResponse
from inference_api.tokenizer import ByteTokenizer
from tests.compat.conftest import MODEL
from tests.compat.test_responses_api import client_of
from tests.frontend.test_openapi_e2e import SPEC, documented, server_sent_events
from tests.openai import test_tool_calls as chat_tools

# The chat tests' tools, in this API's shape.
WEATHER = {"type": "function", **chat_tools.WEATHER["function"], "strict": True}
TIME = {"type": "function", **chat_tools.TIME["function"], "strict": True}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "name": "get_weather"}
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    with client_of(server.url) as client:
        yield client


@pytest.fixture(scope="module")
def mock_client(mock_server) -> Iterator[openai.OpenAI]:
    with client_of(mock_server.url) as client:
        yield client


def schema_of(name: str) -> dict:
    return next(tool["parameters"] for tool in TOOLS if tool["name"] == name)


def posted(server, stream: bool = False, **asked) -> Any:
    """The raw answer, checked against the OpenAPI document: the response object, or the events' data."""
    response = requests.post(f"{server.url}/v1/responses", json={**asked, "stream": stream}, timeout=600)
    assert response.status_code == 200, response.text
    return documented(response, "post", "/v1/responses")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}], ids=str)
def test_a_forced_call_has_arguments_that_fit_the_tools_parameters(client, tool_choice):
    def create(_: int) -> Any:
        return client.responses.create(
            model=MODEL,
            input=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            temperature=1.0,
            max_output_tokens=200,  # room for a long sampled string (test_anthropic_tools.py's forced call)
        )

    with ThreadPoolExecutor(
        3
    ) as pool:  # sampled at temperature 1: each answer a different draw, side by side
        responses = list(pool.map(create, range(3)))
    for response in responses:
        assert response.status == "completed"
        [call] = response.output  # only the call: no empty message item before it
        assert call.type == "function_call" and call.status == "completed"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert call.name in ({"get_time"} if isinstance(tool_choice, dict) else {"get_weather", "get_time"})
        jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
    assert response.tool_choice == tool_choice or response.tool_choice.model_dump() == tool_choice
    echoed = [tool.model_dump(exclude_none=True) for tool in response.tools]
    assert echoed == [WEATHER, {**TIME, "strict": True}]  # strict: OpenAI's default


def test_the_round_trip_reads_as_chat_reads_the_same_conversation(client):
    first = client.responses.create(input=ASK, tools=TOOLS, tool_choice=NAMED, max_output_tokens=60, **GREEDY)
    [call] = first.output
    result = "18 degrees, cloudy"
    answered = [  # the output sent back as it came, as openai-agents does, and the call's output
        *ASK,
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    answer = client.responses.create(input=answered, tools=TOOLS, max_output_tokens=20, **GREEDY)
    assert [item.type for item in answer.output] == ["message"], answer.output
    assert answer.output_text.strip() and "<tool_call>" not in answer.output_text

    chat = client.chat.completions.create(
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
        tools=[
            {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")}}
            for tool in TOOLS
        ],
        max_tokens=1,
        **GREEDY,
    )
    assert answer.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens + 20


@pytest.fixture(scope="module")
def named_call(server) -> dict:
    """The greedy answer to a named call, whole."""
    return posted(server, input=ASK, tools=TOOLS, tool_choice=NAMED, max_output_tokens=60, **GREEDY)


def test_a_streamed_call_comes_as_openai_events_in_order(server, client, named_call):
    events = posted(
        server, stream=True, input=ASK, tools=TOOLS, tool_choice=NAMED, max_output_tokens=60, **GREEDY
    )
    [call] = named_call["output"]
    assert named_call["status"] == "completed" and call["type"] == "function_call"
    jsonschema.validate(json.loads(call["arguments"]), schema_of("get_weather"))

    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    added, delta, done, item_done = events[2:6]
    item_id = added["item"]["id"]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert {event["output_index"] for event in events[2:6]} == {0}
    assert delta["item_id"] == done["item_id"] == item_done["item"]["id"] == item_id
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"] == call["arguments"]
    assert done["name"] == "get_weather" and item_done["item"]["status"] == "completed"
    assert events[-1]["response"]["output"] == [item_done["item"]]

    # The client's stream helper puts the same call together.
    with client.responses.stream(
        input=ASK, tools=TOOLS, tool_choice=NAMED, max_output_tokens=60, **GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == [event["type"] for event in events]
    [streamed] = final.output
    assert (streamed.name, streamed.arguments) == ("get_weather", call["arguments"])


def test_a_call_cut_by_max_output_tokens_stays_an_incomplete_call(server, named_call):
    whole = named_call["output"][0]["arguments"]
    asked = {"input": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_output_tokens": 5, **GREEDY}
    cut = posted(server, **asked)
    events = posted(server, stream=True, **asked)
    for response in (cut, events[-1]["response"]):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        [call] = response["output"]
        assert call["type"] == "function_call" and call["status"] == "incomplete"
        assert (
            call["name"] == "get_weather"
            and whole.startswith(call["arguments"])
            and call["arguments"] != whole
        )
    assert events[-1]["type"] == "response.incomplete"


# An earlier turn where the assistant wrote a sentence before its call: greedy, the model does it again.
TEXT_THEN_CALL = [
    *ASK,
    {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look that up.\n"}]},
    {
        "type": "function_call",
        "call_id": "call_a",
        "name": "get_weather",
        "arguments": '{"city": "Paris", "unit": "celsius"}',
    },
    {"type": "function_call_output", "call_id": "call_a", "output": "18 degrees, cloudy"},
    {"role": "assistant", "content": "It is 18 degrees and cloudy in Paris."},
    {"role": "user", "content": "What is the weather in Rome? Look it up."},
]


def test_text_before_a_call_is_the_first_item_and_the_events_number_the_items(server):
    asked = {"input": TEXT_THEN_CALL, "tools": TOOLS, "max_output_tokens": 60, **GREEDY}
    whole = posted(server, **asked)
    events = posted(server, stream=True, **asked)
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"], whole["output"]
    text = whole["output"][0]["content"][0]["text"]
    assert text.strip() and "<tool_call>" not in text
    jsonschema.validate(json.loads(whole["output"][1]["arguments"]), schema_of(whole["output"][1]["name"]))

    placed = [(event["type"], event.get("output_index")) for event in events[2:-1]]
    deltas = [("response.output_text.delta", 0)] * (len(placed) - 9)
    assert deltas and placed == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        *deltas,
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
    ]
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call"]
    assert final[0]["content"][0]["text"] == text and final[1]["arguments"] == whole["output"][1]["arguments"]


# An earlier turn with two calls at once: greedy, the model makes two again, unless told not to.
TWO_CALLS = [
    {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"},
    {
        "type": "function_call",
        "call_id": "call_a",
        "name": "get_weather",
        "arguments": '{"city": "Paris", "unit": "celsius"}',
    },
    {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'},
    {"type": "function_call_output", "call_id": "call_a", "output": "18 degrees, cloudy"},
    {
        "type": "function_call_output",
        "call_id": "call_b",
        "output": [{"type": "input_text", "text": "21:04"}],
    },
    {"role": "assistant", "content": "It is 18 degrees and cloudy in Paris, and 21:04 in Tokyo."},
    {"role": "user", "content": "What is the weather in Rome and the time in New York?"},
]


def test_parallel_tool_calls_false_gives_one_call_where_the_model_would_make_two(client):
    asked = {"input": TWO_CALLS, "tools": TOOLS, "max_output_tokens": 60, **GREEDY}
    parallel = client.responses.create(**asked)
    single = client.responses.create(**asked, parallel_tool_calls=False)
    assert [item.type for item in parallel.output] == ["function_call", "function_call"], parallel.output
    assert [item.type for item in single.output] == ["function_call"], single.output
    assert parallel.parallel_tool_calls is True and single.parallel_tool_calls is False
    assert (single.output[0].name, single.output[0].arguments) == (
        parallel.output[0].name,
        parallel.output[0].arguments,
    )


def test_allowed_tools_offers_only_those_tools(client):
    allowed = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    for _ in range(2):
        response = client.responses.create(
            model=MODEL, input=ASK, tools=TOOLS, tool_choice=allowed, temperature=1.0, max_output_tokens=60
        )
        [call] = response.output  # asked for the weather, yet only get_time may be called
        assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), schema_of("get_time"))
    assert response.tool_choice.model_dump() == allowed and len(response.tools) == 2
    # auto: the prompt is the one with only the allowed tools in it.
    auto = {**allowed, "mode": "auto"}
    narrowed = client.responses.create(
        input=ASK, tools=TOOLS, tool_choice=auto, max_output_tokens=1, **GREEDY
    )
    only = client.responses.create(input=ASK, tools=[TIME], max_output_tokens=1, **GREEDY)
    everything = client.responses.create(input=ASK, tools=TOOLS, max_output_tokens=1, **GREEDY)
    assert narrowed.usage.input_tokens == only.usage.input_tokens < everything.usage.input_tokens


def test_a_json_schema_text_format_is_followed_and_repeated(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
    }
    text = {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}
    response = client.responses.create(input="Name a city.", text=text, max_output_tokens=40, **GREEDY)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), {**schema, "additionalProperties": False})
    assert response.text.format.type == "json_schema" and response.text.format.name == "place"
    with pytest.raises(openai.BadRequestError) as forced:  # a forced call cannot also be that JSON
        client.responses.create(input=ASK, tools=TOOLS, tool_choice="required", text=text, **GREEDY)
    assert forced.value.param == "tool_choice"


def test_input_items_become_chat_messages_with_calls_joined_to_their_turn():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Looking."}],
            "id": "m",
        },
        {
            "type": "function_call",
            "call_id": "a",
            "name": "f",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": '{"city": "Rome"}', "id": "fc_b"},
        {"type": "function_call_output", "call_id": "a", "output": "18 C"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "25 C"}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "f", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "a"},
        {"role": "tool", "content": "25 C", "tool_call_id": "b"},
    ]


class CutGeneration:
    """A Generation's outside: text, then two calls, the last one cut by max_output_tokens."""

    finish_reason = "length"
    prompt_tokens, completion_tokens, cached_tokens = 10, 30, 0
    reasoning = ""  # no thoughts
    tool_calls = [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"b": "x'}},
    ]

    def parts(self, marked: bool = False) -> Iterator[tuple[str, str]]:
        yield from (("text", "Let me "), ("text", "see."))

    def text(self) -> str:
        return "Let me see."


def test_only_the_cut_call_is_incomplete_and_each_event_is_as_documented():
    echoed = {
        "instructions": None,
        "max_output_tokens": 30,
        "temperature": 1.0,
        "top_p": 1.0,
        "parallel_tool_calls": True,
        "metadata": {},
        "user": None,
        "tools": [
            {"type": "function", "name": name, "description": None, "parameters": None, "strict": True}
            for name in "fg"
        ],
        "tool_choice": "auto",
        "text": {"format": {"type": "text"}},
        "reasoning": None,
    }
    asked = ResponsesRequest([], SamplingParams(), True, echoed)
    events = b"".join(ModelResponse(CutGeneration(), "m", asked, ByteTokenizer()).events()).decode()
    data = [json.loads(data) for _, data in server_sent_events(events)]
    for event in data:
        Draft202012Validator(SPEC["components"]["schemas"]["ResponseStreamEvent"]).validate(event)
    final = data[-1]["response"]
    whole = ModelResponse(CutGeneration(), "m", asked, ByteTokenizer()).whole()
    for response in (final, whole):
        assert response["status"] == "incomplete"
        assert [(item["type"], item["status"]) for item in response["output"]] == [
            ("message", "completed"),
            ("function_call", "completed"),
            ("function_call", "incomplete"),
        ]
    assert [
        (event["type"], event.get("output_index")) for event in data if "output_item" in event["type"]
    ] == [
        ("response.output_item.added", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.output_item.done", 2),
    ]


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}
REFUSED = {
    **{
        f"tools[1].type-{kind}": ("tools[1].type", {"tools": [FUNCTION, {"type": kind}]})
        for kind in (
            "web_search",
            "file_search",
            "computer_use_preview",
            "mcp",
            "code_interpreter",
            "image_generation",
            "local_shell",
            "custom",
        )
    },
    "name-with-a-space": ("tools[0].name", {"tools": [{"type": "function", "name": "get weather"}]}),
    "name-too-long": ("tools[0].name", {"tools": [{"type": "function", "name": "f" * 65}]}),
    "name-missing": ("tools[0].name", {"tools": [{"type": "function", "parameters": {}}]}),
    "parameters-not-enforceable": (
        "tools[0].parameters",
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]},
    ),
    "129-tools": ("tools", {"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}),
    "same-name-twice": ("tools", {"tools": [FUNCTION, FUNCTION]}),
    "named-tool-not-offered": (
        "tool_choice",
        {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "g"}},
    ),
    "hosted-tool-choice": (
        "tool_choice",
        {"tools": [FUNCTION], "tool_choice": {"type": "web_search_preview"}},
    ),
    "required-without-tools": ("tool_choice", {"tool_choice": "required"}),
    "allowed-tool-not-offered": (
        "tool_choice.tools[0].name",
        {
            "tools": [FUNCTION],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "g"}],
            },
        },
    ),
    "allowed-tools-mode": (
        "tool_choice.mode",
        {"tools": [FUNCTION], "tool_choice": {"type": "allowed_tools", "mode": "none", "tools": [FUNCTION]}},
    ),
    "output-for-no-call": (
        "input[1].call_id",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "c", "output": "4"},
            ]
        },
    ),
    "arguments-not-json": (
        "input[1].arguments",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
            ]
        },
    ),
    "output-image": (
        "input[2].output[0]",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": "x"}],
                },
            ]
        },
    ),
    "item-reference": ("input[0].type", {"input": [{"type": "item_reference", "id": "rs_0123"}]}),
    "reasoning-item-parts": ("input[0].content", {"input": [{"type": "reasoning", "content": "Hm."}]}),
    "tool-role-message": ("input[0].role", {"input": [{"role": "tool", "content": "4"}]}),
}


@pytest.mark.parametrize("param, asked", list(REFUSED.values()), ids=list(REFUSED))
def test_bad_tools_and_items_are_a_400_naming_the_responses_field(mock_client, param, asked):
    with pytest.raises(openai.BadRequestError) as refused:
        mock_client.responses.create(**{"model": "mock", "input": "hi", "max_output_tokens": 4, **asked})
    error = refused.value
    assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
    assert set(error.body) == {"message", "type", "param", "code"}  # OpenAI's error shape

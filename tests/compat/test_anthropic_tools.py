"""Tool use on Anthropic's Messages API with the official anthropic client, unchanged: the tool-use loop
(tool_use, then a tool_result, then a text answer), streamed and not, forced calls whose input always fits
the tool's input_schema, disable_parallel_tool_use, a call cut by max_tokens, and count_tokens, on the real
default model (once through the proxy); the 400s for bad tools and blocks on the mock, since the frontend
refuses them before the backend."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import jsonschema
import pytest
import requests

from tests.compat.conftest import MODEL, template_tokens
from tests.frontend.test_openapi_e2e import documented
from tests.openai import test_tool_calls as chat_tools
from tests.proxy.conftest import token

GREEDY = {"extra_body": {"temperature": 0}}
SAMPLED = {"extra_body": {"temperature": 1.0}}


def anthropic_tool(chat_tool: dict) -> dict:
    """One of the chat tests' tools in Anthropic's shape."""
    function = chat_tool["function"]
    return {
        "name": function["name"],
        "description": function["description"],
        "input_schema": function["parameters"],
    }


WEATHER = anthropic_tool(chat_tools.WEATHER)
TIME = anthropic_tool(chat_tools.TIME)
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client_of(url: str, api_key: str = "not-needed") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(server) -> Iterator[anthropic.Anthropic]:
    with client_of(server.url) as client:
        yield client


@pytest.fixture(scope="module")
def mock_client(mock_server) -> Iterator[anthropic.Anthropic]:
    with client_of(mock_server.url) as client:
        yield client


def schema_of(name: str) -> dict:
    return next(tool["input_schema"] for tool in TOOLS if tool["name"] == name)


def streamed(client: anthropic.Anthropic, **asked) -> tuple[list, anthropic.types.Message]:
    """The stream's events as the client hands them on, and the message it puts together."""
    with client.messages.stream(**asked) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def blocks_of(message) -> list[tuple]:
    """The content without the tool_use ids (each answer draws its own)."""
    return [
        (block.type, block.text) if block.type == "text" else (block.type, block.name, block.input)
        for block in message.content
    ]


def test_the_tool_use_loop_streamed_and_not(client):
    asked = {"model": MODEL, "max_tokens": 60, "tools": TOOLS, "tool_choice": {"type": "any"}, **GREEDY}
    message = client.messages.create(messages=ASK, **asked)
    events, final = streamed(client, messages=ASK, **asked)

    assert message.stop_reason == final.stop_reason == "tool_use"
    [call] = message.content  # only the call: no empty text block before it
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, schema_of(call.name))
    assert blocks_of(final) == blocks_of(message)
    starts = [event for event in events if event.type == "content_block_start"]
    assert [(event.index, event.content_block.type) for event in starts] == [(0, "tool_use")]
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert [delta.type for delta in deltas] == ["input_json_delta"]
    counted = client.messages.count_tokens(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}
    )
    assert counted.input_tokens == message.usage.input_tokens == final.usage.input_tokens

    # The client runs the tool and sends its result; the model answers in text.
    answered = [
        *ASK,
        {"role": "assistant", "content": message.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 °C, sunny"}],
        },
    ]
    asked = {"model": MODEL, "max_tokens": 30, "tools": TOOLS, **GREEDY}
    answer = client.messages.create(messages=answered, **asked)
    events, final = streamed(client, messages=answered, **asked)
    assert answer.stop_reason == final.stop_reason == "end_turn"
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text.strip()
    assert blocks_of(final) == blocks_of(answer)
    # The call and its result are in the prompt, and count_tokens counts them as create does.
    assert answer.usage.input_tokens > message.usage.input_tokens + 20
    counted = client.messages.count_tokens(model=MODEL, messages=answered, tools=TOOLS)
    assert counted.input_tokens == answer.usage.input_tokens


# An earlier turn where the assistant wrote a sentence before its call: greedy, the model does it again.
TEXT_THEN_CALL = [
    *ASK,
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look that up.\n"},
            {
                "type": "tool_use",
                "id": "toolu_a",
                "name": "get_weather",
                "input": {"city": "Paris", "unit": "celsius"},
            },
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "18 degrees, cloudy"}],
    },
    {"role": "assistant", "content": "It is 18 degrees and cloudy in Paris."},
    {"role": "user", "content": "What is the weather in Rome? Look it up."},
]


def test_text_before_a_call_is_the_first_block_and_the_stream_numbers_the_blocks(client):
    asked = {"model": MODEL, "max_tokens": 60, "messages": TEXT_THEN_CALL, "tools": TOOLS, **GREEDY}
    message = client.messages.create(**asked)
    events, final = streamed(client, **asked)
    assert [block.type for block in message.content] == ["text", "tool_use"], message.content
    assert message.stop_reason == final.stop_reason == "tool_use"
    assert message.content[0].text.strip() and "<tool_call>" not in message.content[0].text
    jsonschema.validate(message.content[1].input, schema_of(message.content[1].name))
    assert blocks_of(final) == blocks_of(message)
    numbered = [(event.type, event.index) for event in events if event.type.startswith("content_block")]
    texts = [("content_block_delta", 0)] * (len(numbered) - 5)
    assert numbered == [
        ("content_block_start", 0),
        *texts,
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
    ]
    assert texts


@pytest.mark.parametrize(
    "tool_choice", [{"type": "tool", "name": "get_time"}, {"type": "any"}], ids=["tool", "any"]
)
def test_a_forced_call_always_has_input_its_schema_takes(client, tool_choice):
    names = set()
    for _ in range(3):  # sampled: each draw differs
        # Room for a long sampled string: at 60 tokens a draw ran out before closing its call (once).
        message = client.messages.create(
            model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, tool_choice=tool_choice, **SAMPLED
        )
        assert message.stop_reason == "tool_use"
        [call] = message.content
        assert call.type == "tool_use"
        jsonschema.validate(call.input, schema_of(call.name))
        names.add(call.name)
    assert names <= ({tool_choice["name"]} if tool_choice["type"] == "tool" else {"get_weather", "get_time"})


# An earlier turn with two calls at once: greedy, the model makes two again, unless told not to.
TWO_CALLS = [
    {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"},
    {
        "role": "assistant",
        "content": [
            {
                "type": "tool_use",
                "id": "toolu_a",
                "name": "get_weather",
                "input": {"city": "Paris", "unit": "celsius"},
            },
            {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {"zone": "Asia/Tokyo"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "18 degrees, cloudy"},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": "21:04"},
        ],
    },
    {"role": "assistant", "content": "It is 18 degrees and cloudy in Paris, and 21:04 in Tokyo."},
    {"role": "user", "content": "What is the weather in Rome and the time in New York?"},
]


def test_disable_parallel_tool_use_gives_one_call_where_the_model_would_make_two(client):
    asked = {"model": MODEL, "max_tokens": 80, "messages": TWO_CALLS, "tools": TOOLS, **GREEDY}
    parallel = client.messages.create(**asked)
    single = client.messages.create(**asked, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [block.type for block in parallel.content] == ["tool_use", "tool_use"], parallel.content
    assert [block.type for block in single.content] == ["tool_use"], single.content
    assert parallel.stop_reason == single.stop_reason == "tool_use"
    assert blocks_of(single) == blocks_of(parallel)[:1]


def test_a_call_max_tokens_cut_is_a_tool_use_with_the_members_written_whole(client):
    named = {"type": "tool", "name": "get_weather"}
    asked = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": named, **GREEDY}
    whole = client.messages.create(max_tokens=60, **asked).content[0].input
    cut = client.messages.create(max_tokens=7, **asked)  # {"city": "Paris", "unit": " and no further
    _, final = streamed(client, max_tokens=7, **asked)
    assert cut.stop_reason == final.stop_reason == "max_tokens"
    assert blocks_of(cut) == blocks_of(final) == [("tool_use", "get_weather", {"city": whole["city"]})]


def test_count_tokens_counts_the_system_prompt_and_a_prefill_as_create_does(client, tokenizer):
    system, prefill = "You answer briefly.", "The weather in Paris is"
    conversation = {
        "system": [{"type": "text", "text": system}],
        "messages": [*ASK, {"role": "assistant", "content": prefill}],
    }
    message = client.messages.create(model=MODEL, max_tokens=1, **conversation)
    counted = client.messages.count_tokens(model=MODEL, **conversation)
    assert counted.input_tokens == message.usage.input_tokens
    assert counted.input_tokens == template_tokens(
        tokenizer, [{"role": "system", "content": system}, *ASK], prefill
    )


def test_through_the_proxy(client, proxy):
    through = client_of(proxy.url, api_key=token())
    asked = {"model": MODEL, "max_tokens": 60, "messages": ASK, "tools": [WEATHER], **GREEDY}
    named = {"type": "tool", "name": "get_weather"}
    _, final = streamed(through, tool_choice=named, **asked)
    assert final.stop_reason == "tool_use"
    assert blocks_of(final) == blocks_of(client.messages.create(tool_choice=named, **asked))
    counted = through.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    assert counted.input_tokens == final.usage.input_tokens
    with pytest.raises(anthropic.AuthenticationError):
        client_of(proxy.url, api_key="not-a-token").messages.count_tokens(model=MODEL, messages=ASK)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_answers_and_count_tokens_are_as_the_openapi_document_says(server, stream):
    asked = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    body = {**asked, "max_tokens": 60, "temperature": 0, "stream": stream}
    response = requests.post(f"{server.url}/v1/messages", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = documented(response, "post", "/v1/messages")
    if stream:
        kinds = [
            (event["type"], event.get("delta", event.get("content_block", {})).get("type"))
            for event in answer
        ]
        assert ("content_block_start", "tool_use") in kinds and (
            "content_block_delta",
            "input_json_delta",
        ) in kinds
        input_tokens = answer[0]["message"]["usage"]["input_tokens"]
    else:
        assert [block["type"] for block in answer["content"]] == ["tool_use"]
        input_tokens = answer["usage"]["input_tokens"]
    counted = requests.post(f"{server.url}/v1/messages/count_tokens", json=asked, timeout=60)
    assert counted.status_code == 200, counted.text
    assert documented(counted, "post", "/v1/messages/count_tokens") == {"input_tokens": input_tokens}


HI = [{"role": "user", "content": "hi"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}
CALLED = [
    *HI,
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
]
IMAGE = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
# (the field the 400 names, the request's fields), by what is wrong.
REFUSED = {
    "server-tool": ("tools[0].type", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    "second-server-tool": ("tools[1].type", {"tools": [TOOL, {"type": "bash_20250124", "name": "bash"}]}),
    "name-with-a-space": ("tools[0].name", {"tools": [{**TOOL, "name": "get weather"}]}),
    "name-of-65": ("tools[0].name", {"tools": [{**TOOL, "name": "x" * 65}]}),
    "name-not-ascii": ("tools[0].name", {"tools": [{**TOOL, "name": "météo"}]}),
    "schema-of-a-string": (
        "tools[0].input_schema",
        {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
    ),
    "no-schema": ("tools[0].input_schema", {"tools": [{"name": "f"}]}),
    "schema-unusable": (
        "tools[0].input_schema",
        {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "nope"}}}}]},
    ),
    "129-tools": ("tools", {"tools": [{**TOOL, "name": f"f{i}"} for i in range(129)]}),
    "two-of-a-name": ("tools", {"tools": [TOOL, TOOL]}),
    "choice-of-no-tool": ("tool_choice", {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}}),
    "choice-unknown": ("tool_choice", {"tools": [TOOL], "tool_choice": {"type": "sometimes"}}),
    "choice-without-tools": ("tool_choice", {"tool_choice": {"type": "any"}}),
    "parallel-not-a-boolean": (
        "tool_choice.disable_parallel_tool_use",
        {"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
    ),
    "result-of-no-call": (
        "messages[0].content[0].tool_use_id",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]},
    ),
    "result-of-another-call": (
        "messages[2].content[0].tool_use_id",
        {
            "messages": [
                *CALLED,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]},
            ]
        },
    ),
    "image-in-a-result": (
        "messages[2].content[0].content[0]",
        {
            "messages": [
                *CALLED,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}],
                },
            ]
        },
    ),
    "call-in-the-prefill": ("messages[1].content[0]", {"messages": CALLED}),  # nothing could answer it
    "hosted-tool-call": (
        "messages[1].content[0]",
        {"messages": [*HI, {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}, *HI]},
    ),
    "thinking-not-text": (
        "messages[1].content[0].thinking",
        {"messages": [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": 3}]}, *HI]},
    ),
    "call-in-a-user-turn": (
        "messages[0].content[0]",
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ]
        },
    ),
    "call-without-input": (
        "messages[1].content[0].input",
        {
            "messages": [
                *HI,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]},
                *HI,
            ]
        },
    ),
}


@pytest.mark.parametrize("field, fields", list(REFUSED.values()), ids=list(REFUSED))
@pytest.mark.parametrize("endpoint", ["create", "count_tokens"])
def test_bad_tools_and_blocks_are_a_400_naming_the_field(mock_client, endpoint, field, fields):
    asked = {"model": "mock", "messages": HI, **fields}
    if endpoint == "create":
        call = mock_client.messages.create
        asked["max_tokens"] = 4
    else:
        call = mock_client.messages.count_tokens
    with pytest.raises(anthropic.BadRequestError) as refused:
        call(**asked)
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(f"{field} "), body["error"]["message"]


def test_count_tokens_of_another_model_is_a_404(mock_client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        mock_client.messages.count_tokens(model="claude", messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"

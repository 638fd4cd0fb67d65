"""Tool calling with the official openai client on the default model: named and required calls decoded
under the tools' schemas, the round trip through the chat template, streamed calls, and bad tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.openai.conftest import MODEL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == name)


def test_a_named_tool_choice_returns_valid_arguments(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=100,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather"))


def test_required_makes_one_valid_call_to_one_of_the_tools(client):
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        )
        [call] = completion.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client):
    fields = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=100,
    )
    whole = client.chat.completions.create(**fields).choices[0].message.tool_calls[0]
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **fields):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            name += delta_call.function.name or ""
            arguments += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, arguments, finish) == (whole.function.name, whole.function.arguments, "tool_calls")


def test_a_round_trip_through_the_chat_template(client):
    call = (
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=100
        )
        .choices[0]
        .message.tool_calls[0]
    )
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # The call and its result reached the prompt: more prompt tokens than the question alone.
    alone = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_auto_lets_the_model_answer_in_text(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=20,
    )
    choice = completion.choices[0]
    assert choice.message.content and "<tool_call>" not in choice.message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **fields)
    assert raised.value.body["param"] == param


def test_a_loose_schema_forced_call_has_only_the_listed_keys_and_a_cut_one_stays_a_call(client):
    """langchain's bind_tools(..., tool_choice=name) sends parameters without additionalProperties: a
    small model then invented keys until max_tokens cut the object, returned as content (issue 39)."""
    loose = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}},
        },
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[loose],
            tool_choice=named,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        [call] = completion.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) <= {"city"}
    cut = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[loose], tool_choice=named, temperature=0, max_tokens=3
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")


def test_an_auto_call_the_model_starts_is_always_whole_and_valid(client, tokenizer):
    """With `auto` the answer is decoded under "text, or calls of the tools": once the model opens a
    `<tool_call>` (pushed to here by a bias for the tag's tokens, which it would go on repeating), what
    follows is one of the tools with arguments its schema takes, never a broken call left as text; and
    with parallel_tool_calls false, the answer ends after it."""
    tag = {str(token): 100 for token in tokenizer.encode("<tool_call>", add_special_tokens=False)}
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            logit_bias=tag,
            parallel_tool_calls=False,  # else the bias opens call after call until max_tokens
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_a_pydantic_tool_with_a_nested_model_gets_arguments_the_model_validates(client):
    """`openai.pydantic_function_tool` of a model with a nested one: its schema refers to `#/$defs/...`,
    which `required`'s grammar (every tool in one schema) and `auto`'s both take."""

    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    class ShipOrder(pydantic.BaseModel):
        order_id: int = pydantic.Field(ge=1, le=9999)
        address: Address

    tool = openai.pydantic_function_tool(ShipOrder)
    assert "$defs" in tool["function"]["parameters"]
    ask = [{"role": "user", "content": "Ship order 42 to Paris, France."}]

    def create(choice: str):
        return client.chat.completions.create(
            model=MODEL, messages=ask, tools=[tool, TIME], tool_choice=choice, temperature=0, max_tokens=120
        )

    assert create("auto").choices[0].finish_reason in ("tool_calls", "stop", "length")  # not a 400
    [call] = create("required").choices[0].message.tool_calls
    assert call.function.name == "ShipOrder"
    ShipOrder.model_validate_json(call.function.arguments)

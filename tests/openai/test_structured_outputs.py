"""Structured outputs with the official openai client on the default model: JSON that always parses and
follows its schema, vLLM's guided_* fields, and a 400 for what cannot be enforced."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel

from tests.openai.conftest import MODEL


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    favourite_colour: Colour
    address: Address
    hobbies: list[str]


MESSAGES = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "address", "hobbies"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, temperature=0, max_tokens=200
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert message.parsed == Person.model_validate_json(message.content)


def test_streamed_json_follows_the_schema(client):
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=json_schema_format(PERSON_SCHEMA),
        temperature=0.8,
        seed=5,
        max_tokens=200,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_twenty_seeded_samples_at_temperature_one_all_validate(client):
    def sample(seed: int) -> list:  # choice i of a request samples with seed + i: seeds 1 to 20
        return client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=json_schema_format(PERSON_SCHEMA),
            temperature=1.0,
            seed=seed,
            n=10,
            max_tokens=200,
        ).choices

    with ThreadPoolExecutor(2) as pool:  # side by side, in 20 of the rows
        choices = [choice for choices in pool.map(sample, (1, 11)) for choice in choices]
    assert len({choice.message.content for choice in choices}) > 10  # samples, not one answer 20 times
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_a_big_schema_is_followed_and_a_stream_beside_it_is_not_cut(client):
    # A 50,000-value enum compiles for about 0.3 s, on a thread beside the engine's
    # (backend/engine/grammar_builds.py), while the stream's row goes on stepping.
    values = [f"value-{i}" for i in range(50_000)]
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a value."}],
        response_format=json_schema_format({"enum": values}),
        temperature=1.0,
        seed=3,
        max_tokens=20,
    )
    assert json.loads(answer.choices[0].message.content) in values
    finishes = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
    assert finishes[-1] == "length" and first.choices[0].delta.content


def test_json_object_mode_gives_an_object(client):
    messages = [{"role": "user", "content": "Give the name and age of a person as a JSON object."}]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=200
    )
    assert completion.choices[0].finish_reason == "stop", completion.choices[0].message.content
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_a_cut_answer_ends_with_length(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=json_schema_format(PERSON_SCHEMA), max_tokens=5
    )
    assert completion.choices[0].finish_reason == "length"


def test_guided_choice_and_regex_on_completions(client):
    choice = client.completions.create(
        model=MODEL,
        prompt="The sky on a clear day is",
        max_tokens=10,
        extra_body={"guided_choice": [" blue", " green", " purple"]},
    )
    assert choice.choices[0].text in (" blue", " green", " purple")
    date = client.completions.create(
        model=MODEL,
        prompt="The first moon landing was on (YYYY-MM-DD): ",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )
    assert len(date.choices[0].text) == 10 and date.choices[0].text[4] == "-"


def test_the_native_api_takes_a_json_schema(server):
    body = {"text": "A person as JSON:", "json_schema": PERSON_SCHEMA, "stream": False, "max_tokens": 200}
    answer = requests.post(f"{server.url}/predictions/{MODEL}", json=body, timeout=120).json()
    jsonschema.validate(json.loads(answer["text"]), PERSON_SCHEMA)
    body["json_schema"] = {"type": "array", "uniqueItems": True}
    refused = requests.post(f"{server.url}/predictions/{MODEL}", json=body, timeout=120)
    assert refused.status_code == 400 and "uniqueItems" in refused.text and "json_schema" in refused.text


@pytest.mark.parametrize(
    ("response_format", "named", "saying"),
    [
        (json_schema_format({"type": "array", "uniqueItems": True}), "response_format", "uniqueItems"),
        (json_schema_format({"type": "object", "properties": 5}), "response_format", "schema"),
        ({"type": "json_schema"}, "response_format", "json_schema"),
        ({"type": "xml"}, "response_format", "json_object"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_it(client, response_format, named, saying):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=response_format)
    error = raised.value.body
    assert error["param"].startswith(named) and saying in error["message"]


def test_two_ways_of_constraining_at_once_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"},
        )
    assert raised.value.body["param"] == "guided_regex"


def test_vllms_structured_outputs_constrain_as_the_guided_fields_they_replaced(client):
    """vLLM 0.12 takes only `structured_outputs` ({"json": ...}, {"regex": ...}, ...): each kind decodes
    under the same grammar as the guided_* field of that kind, which a greedy answer shows token for
    token, on completions and on chat."""
    prompt = "The first moon landing was on (YYYY-MM-DD): "
    pairs = [
        ({"choice": [" purple", " green"]}, {"guided_choice": [" purple", " green"]}),
        ({"regex": r"\d{4}-\d{2}-\d{2}"}, {"guided_regex": r"\d{4}-\d{2}-\d{2}"}),
        (
            {"grammar": 'start: "19" DIGIT DIGIT\nDIGIT: /[0-9]/'},
            {"guided_grammar": 'start: "19" /[0-9]{2}/'},
        ),
    ]
    for new, old in pairs:
        ask = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        answer = client.completions.create(**ask, extra_body={"structured_outputs": new}).choices[0].text
        assert answer == client.completions.create(**ask, extra_body=old).choices[0].text
    assert answer.startswith("19") and len(answer) == 4  # the constraint, not the model's free text
    ask = dict(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0)
    person = client.chat.completions.create(**ask, extra_body={"structured_outputs": {"json": PERSON_SCHEMA}})
    jsonschema.validate(json.loads(person.choices[0].message.content), PERSON_SCHEMA)
    guided = client.chat.completions.create(**ask, extra_body={"guided_json": PERSON_SCHEMA})
    assert person.choices[0].message.content == guided.choices[0].message.content
    ask["messages"] = [{"role": "user", "content": "Give the name and age of a person as a JSON object."}]
    anything = client.chat.completions.create(**ask, extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    formatted = client.chat.completions.create(**ask, response_format={"type": "json_object"})
    assert anything.choices[0].message.content == formatted.choices[0].message.content


@pytest.mark.parametrize(
    ("structured_outputs", "named"),
    [
        ({}, "structured_outputs"),
        ([{"regex": "a+"}], "structured_outputs"),
        ({"regex": "a+", "choice": ["a"]}, "structured_outputs.choice"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "structured_outputs.structural_tag"),
        ({"regex": "a+", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
        ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
    ],
)
def test_structured_outputs_that_cannot_be_followed_is_a_400_naming_it(client, structured_outputs, named):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"structured_outputs": structured_outputs}
        )
    assert raised.value.body["param"] == named

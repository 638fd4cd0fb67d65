"""Parsing and validating the native API's body, without a server."""

from __future__ import annotations

import json

import pytest

from backend.messages import InvalidParams
from inference_api.apis.native.request import check_context, parse_native_request


def parse(**fields: object):
    return parse_native_request(json.dumps(fields).encode())


def test_defaults_are_the_native_apis() -> None:
    request = parse(text="hi")
    assert request.text == "hi"
    assert request.stream is True
    assert request.return_prompt is False
    p = request.params
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.stop, p.seed) == (1.0, 40, 0.9, 128, (), None)


def test_speculative_decoding_is_on_unless_the_request_turns_it_off() -> None:
    assert parse(text="hi").params.speculative is True
    assert parse(text="hi", speculative=False).params.speculative is False


def test_numeric_strings_and_whole_floats_are_numbers() -> None:
    p = parse(text="hi", temperature="0", top_k="40", top_p="1", max_tokens=12.0, seed="3").params
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.seed) == (0.0, 40, 1.0, 12, 3)
    assert p.greedy


def test_bounds_are_inclusive_where_the_spec_says() -> None:
    p = parse(text="hi", temperature=10, top_k=1000, top_p=1, max_tokens=2048, seed=2**64 - 1).params
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (10.0, 1000, 1.0, 2048)
    assert parse(text="hi", top_k=1, max_tokens=1, seed=0).params.top_k == 1


def test_a_single_stop_string_becomes_a_tuple() -> None:
    assert parse(text="hi", stop_sequence="\n").params.stop == ("\n",)
    assert parse(text="hi", stop_sequence=["a", "b", "c", "d"]).params.stop == ("a", "b", "c", "d")
    assert parse(text="hi", stop_sequence=[]).params.stop == ()


def test_null_fields_take_their_defaults() -> None:
    request = parse(text="hi", temperature=None, top_k=None, stream=None, seed=None)
    assert request.params.temperature == 1.0 and request.params.top_k == 40 and request.stream


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"text": True}, "text"),
        ({"text": "a", "temperature": False}, "temperature"),
        ({"text": "a", "top_k": True}, "top_k"),
        ({"text": "a", "max_tokens": "1.5"}, "max_tokens"),
        ({"text": "a", "max_tokens": 1e400}, "max_tokens"),
        ({"text": "a", "top_p": "nan"}, "top_p"),
        ({"text": "a", "seed": 2**64}, "seed"),
        ({"text": "a", "stream": "false"}, "stream"),
        ({"text": "a", "stop_sequence": {"a": 1}}, "stop_sequence"),
        ({"text": "a", "speculative": "no"}, "speculative"),
    ],
)
def test_wrong_types_name_the_field(fields: dict, field: str) -> None:
    with pytest.raises(InvalidParams) as error:
        parse(**fields)
    assert error.value.param == field
    assert field in str(error.value)


def test_context_check_gives_token_counts() -> None:
    check_context(10, 6, 16)
    with pytest.raises(InvalidParams) as error:
        check_context(10, 7, 16)
    assert error.value.param == "text"
    assert "10" in str(error.value) and "7" in str(error.value) and "17" in str(error.value)
    with pytest.raises(InvalidParams):
        check_context(0, 1, 16)

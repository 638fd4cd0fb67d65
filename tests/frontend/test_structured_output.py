"""Schemas as the grammar reads them (inference_api/structured_output.py): an object that lists its
properties allows no others unless it says so, as vLLM's default engine (xgrammar, strict) reads them."""

from __future__ import annotations

import functools

import llguidance
import llguidance.hf

from backend.messages import BackendConfig
from backend.model.loader import load_tokenizer
from inference_api.structured_output import closed_objects, json_schema_grammar

LOOSE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@functools.cache
def tokenizers():
    tokenizer = load_tokenizer(BackendConfig())  # the default model's, from its package
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def follows(grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole, token by token as decoding would."""
    tokenizer, ll_tokenizer = tokenizers()
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_an_object_that_lists_its_properties_takes_no_other_key_unless_it_says_so():
    closed = json_schema_grammar(LOOSE, "json_schema")
    assert follows(closed, '{"city": "Paris"}')
    assert not follows(closed, '{"city": "Paris", "type": "city"}')  # the key a small model invented
    open_schema = {**LOOSE, "additionalProperties": True}
    assert follows(json_schema_grammar(open_schema, "json_schema"), '{"city": "Paris", "type": "city"}')
    typed = {**LOOSE, "additionalProperties": {"type": "integer"}}
    assert follows(json_schema_grammar(typed, "json_schema"), '{"city": "Paris", "rank": 3}')
    assert follows(json_schema_grammar({"type": "object"}, "json_object"), '{"any": "key"}')


def test_objects_are_closed_wherever_schemas_nest_and_data_is_left_as_it_is():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},  # a key named so
            "list": {"type": "array", "items": {"properties": {"b": {"type": "number"}}}},
            "either": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
            "free": {"properties": {"c": {}}, "patternProperties": {"^x-": {}}},
            "fixed": {"const": {"properties": {"d": 1}}, "default": {"properties": {}}},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    inner = closed["properties"]
    assert set(inner) == {"properties", "list", "either", "free", "fixed"}  # no key added among them
    assert inner["properties"]["additionalProperties"] is False
    assert inner["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert "additionalProperties" not in inner["free"]  # patternProperties says which others it takes
    assert inner["fixed"] == schema["properties"]["fixed"]  # a const and a default are data
    assert "additionalProperties" not in schema  # the request's own schema is not changed

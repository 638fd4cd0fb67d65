"""The Responses API's `text.format`: what the answer's text follows, as the grammar it is decoded under.

`{"type": "text"}` (the default) is free text; `{"type": "json_object"}` any JSON object;
`{"type": "json_schema", "name", "schema", "strict"}` JSON that fits the schema, whatever `strict` says
(it is enforced by constrained decoding, structured_output.py, as chat's `response_format`). A schema
that cannot be enforced is a 400 naming `text.format.schema`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import InvalidParams
from inference_api.structured_output import json_schema_grammar

FORMATS = '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name": ..., "schema": {...}}'


@dataclass(frozen=True)
class TextFormat:
    grammar: str | None  # None: free text
    param: str | None  # the field the grammar came from, for the backend's 400s
    echoed: dict[str, Any]  # the response's `text`


def read_text_format(value: Any) -> TextFormat:
    """The request's `text` (an object with a `format`, or null)."""
    if value is not None and not isinstance(value, dict):
        raise InvalidParams("text", 'text must be an object, {"format": {...}}')
    text_format = None if value is None else value.get("format")
    if text_format is None:
        return TextFormat(None, None, {"format": {"type": "text"}})
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind == "text":
        return TextFormat(None, None, {"format": {"type": "text"}})
    if kind == "json_object":
        grammar = json_schema_grammar({"type": "object"}, "text.format")
        return TextFormat(grammar, "text.format", {"format": {"type": "json_object"}})
    if kind == "json_schema":
        return _json_schema(text_format)
    raise InvalidParams("text.format.type", f"text.format must be {FORMATS}")


def _json_schema(text_format: dict[str, Any]) -> TextFormat:
    schema = text_format.get("schema")
    if not isinstance(schema, dict):
        raise InvalidParams("text.format.schema", "text.format.schema must be a JSON schema (an object)")
    grammar = json_schema_grammar(schema, "text.format.schema")
    echoed = {
        "type": "json_schema",
        "name": text_format.get("name"),
        "schema": schema,
        "description": text_format.get("description"),
        "strict": text_format.get("strict"),
    }
    return TextFormat(grammar, "text.format.schema", {"format": echoed})

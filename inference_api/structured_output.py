"""What a request asks its output to follow: a JSON schema, any JSON object, a regex, a choice or a Lark
grammar, as the llguidance grammar the backend decodes under (backend/layers/grammar.py).

OpenAI's `response_format` (`json_object`, `json_schema`); vLLM's `structured_outputs` (`json`,
`json_object`, `regex`, `choice`, `grammar`) and the `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar` fields it replaced (vLLM 0.12 takes only the former); the native API's `json_schema`;
llama.cpp server's `grammar` (GBNF), `json_schema` and `response_format` of a `json_object` with a
`schema`, which its OpenAI-compatible endpoints take too; Text Generation Inference's grammars (`json`,
`regex` and `json_schema`, in `value`), as its `grammar` parameter and as a chat's `response_format`,
which its clients send.
A grammar llguidance cannot enforce (a schema keyword it does not implement, a regex it cannot parse) is
a 400 naming the field and what is wrong, never an answer that silently follows less than was asked.

An object schema that lists `properties` and says nothing of other keys allows none (`closed_objects`),
as vLLM's default grammar engine (xgrammar, strict) reads schemas: read as JSON Schema says, the model
may add keys of its own, and a small one did, until max_tokens cut the object (a forced tool call
`{"city": "Paris", "type": "city", "description": ..., "population_per_`). A schema that wants other
keys says so: `"additionalProperties": true` (or a schema for them) is honoured as written.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from backend.messages import InvalidParams
from inference_api import json_text

# One spacing only, as `json.dumps` writes it: a model free to add whitespace anywhere may spend its
# whole budget on it (small models at temperature 1 do).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GUIDED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# llama.cpp server's fields of its OpenAI-compatible endpoints too: a GBNF grammar, a JSON schema
LLAMACPP_FIELDS = ("grammar", "json_schema")
# vLLM's `structured_outputs` constraints, each read as the guided_* field of the same kind.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Text Generation Inference's kinds of grammar (tgi_grammar), as its `grammar` and chat `response_format`.
TGI_GRAMMARS = ("json", "json_object", "regex", "json_schema")
# Its options that ask for what this server does anyway (no fallback, compact JSON, closed objects):
# taken, with no effect.
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


def grammar_field(data: dict[str, Any], fields: tuple[str, ...]) -> str | None:
    """Which of `fields` the request constrains its output with (None: none), `structured_outputs.KIND`
    for vLLM's object of constraints; a 400 if more than one is given."""
    given = [name for name in fields if _given(data.get(name), name)]
    if len(given) > 1:
        raise InvalidParams(given[1], f"{given[0]} and {given[1]} cannot be combined: give one")
    if given == ["structured_outputs"]:
        return f"structured_outputs.{_structured_kind(data['structured_outputs'])}"
    return given[0] if given else None


def _given(value: Any, name: str) -> bool:
    """Whether a request gives this field: not null, and for llama.cpp's `grammar` not "" (its none)."""
    return value is not None and not (name == "grammar" and value == "")


def read_grammar(data: dict[str, Any], fields: tuple[str, ...]) -> str | None:
    """The grammar asked for by the one of `fields` present (None: free text); a 400 if more than one
    is, or if the one given cannot be enforced."""
    name = grammar_field(data, fields)
    if name is None:
        return None
    field, _, kind = name.partition(".")  # structured_outputs.KIND: that key of the object
    value = data[field][kind] if field == "structured_outputs" else data[name]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs.json_object":
        if value is not True:
            raise InvalidParams(name, f"{name} must be true (or left out)")
        return json_schema_grammar({"type": "object"}, name)
    if name in ("guided_json", "json_schema", "structured_outputs.json"):
        return schema_grammar(value, name)
    if name in ("guided_regex", "structured_outputs.regex"):
        return regex_grammar(value, name)
    if name in ("guided_choice", "structured_outputs.choice"):
        return choice_grammar(value, name)
    if name == "grammar":
        return gbnf_grammar(value, name)
    return lark_grammar(_text(value, name), name)  # guided_grammar, structured_outputs.grammar


def _structured_kind(value: Any) -> str:
    """The one constraint vLLM's `structured_outputs` object gives (a 400 for none, two, or one this
    server does not build: `structural_tag`, `whitespace_pattern`, or an option unknown to vLLM)."""
    if not isinstance(value, dict):
        raise InvalidParams("structured_outputs", 'structured_outputs must be an object, as {"json": {...}}')
    for key in value:
        if key not in (*STRUCTURED_KINDS, *STRUCTURED_OPTIONS) and value[key] is not None:
            raise InvalidParams(
                f"structured_outputs.{key}", f"structured_outputs.{key} is not supported by this server"
            )
    given = [kind for kind in STRUCTURED_KINDS if value.get(kind) not in (None, False)]
    if not given:
        kinds = ", ".join(STRUCTURED_KINDS[:-1])
        raise InvalidParams("structured_outputs", f"structured_outputs must give one of {kinds}")
    if len(given) > 1:
        name = f"structured_outputs.{given[1]}"
        raise InvalidParams(
            name, f"structured_outputs.{given[0]} and {given[1]} cannot be combined: give one"
        )
    if given == ["structural_tag"]:
        raise InvalidParams(
            "structured_outputs.structural_tag",
            "structured_outputs.structural_tag is not supported by this server",
        )
    return given[0]


# Where a schema holds other schemas: one (`not`), a list of them (`anyOf`), or a map of them by name
# (`properties`). Only these are walked: a `const`, `enum` or `default` value is data, whatever it holds.
ONE_SCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which each object schema that lists `properties` and says nothing else of
    other keys (no `additionalProperties`, `patternProperties` or `unevaluatedProperties`) allows none."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in ONE_SCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    for key in SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(item) for item in closed[key]]
    for key in SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(item) for name, item in closed[key].items()}
    if isinstance(closed.get("properties"), dict) and not any(key in closed for key in OPEN_KEYWORDS):
        closed["additionalProperties"] = False
    return closed


DEFINITIONS = ("$defs", "definitions")  # where a schema keeps the subschemas its `$ref`s point to


def definitions_under(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """`schema` to be placed inside another one (a tool's parameters in a call's schema), and the
    definitions its `$ref`s point to, for that one's root `$defs`: renamed with `prefix` (two tools may
    define one name each their own way), its references to them rewritten. Pydantic's schemas of nested
    models refer to `#/$defs/Model`, which inside another schema would point at that one's root."""
    if not isinstance(schema, dict):
        return schema, {}
    pointers = {
        f"#/{where}/{name}": f"#/$defs/{prefix}{name}"
        for where in DEFINITIONS
        for name in schema.get(where) or {}
    }

    def rewritten(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                key: pointers.get(value, value)
                if key == "$ref" and isinstance(value, str)
                else rewritten(value)
                for key, value in node.items()
            }
        if isinstance(node, list):
            return [rewritten(item) for item in node]
        return node

    body = {key: value for key, value in schema.items() if key not in DEFINITIONS}
    moved = {
        f"{prefix}{name}": rewritten(definition)
        for where in DEFINITIONS
        for name, definition in (schema.get(where) or {}).items()
    }
    return rewritten(body), moved


def schema_grammar(value: Any, param: str) -> str:
    """JSON following a schema sent as an object or as a JSON string (`param`: where, for the 400s)."""
    return json_schema_grammar(_schema(value, param), param)


def regex_grammar(value: Any, param: str) -> str:
    """Text matching a regex (`param`: where it was sent, for the 400s)."""
    return _checked(llguidance.LLMatcher.grammar_from_regex(_text(value, param)), param)


def json_schema_grammar(schema: dict[str, Any], param: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=JSON_LAYOUT)
    except ValueError as error:
        raise InvalidParams(param, f"{param} is not a usable JSON schema: {error}") from None
    return _checked(grammar, param)


def json_lark(schema: dict[str, Any]) -> str:
    """A schema as the body of a Lark rule (`%json {...}`): in JSON_LAYOUT's spacing, its objects closed,
    for a grammar with JSON in one part of it (a tool call inside free text)."""
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def grammar_around(grammar: str, lark: str, name: str) -> str:
    """`grammar` as a part of a Lark grammar of its own (`name`, the new start), which refers to it as
    `@ANSWER`: a grammar that constrains an answer, after text the outer grammar allows before it. The
    grammar is llguidance's JSON or Lark's text (lark_grammar's, which no JSON grammar starts as)."""
    parsed = json.loads(grammar) if grammar.startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    answer = parsed["grammars"][0]
    answer["name"] = answer.get("name") or "answer"  # what the outer grammar hands over to
    outer = {"name": name, "lark_grammar": lark.replace("ANSWER", answer["name"])}
    parsed["grammars"] = [outer, *parsed["grammars"]]
    return json.dumps(parsed)


def gbnf_grammar(gbnf: Any, param: str) -> str:
    """A GBNF grammar (llama.cpp's format), read by llguidance's converter; else a 400 naming `param`."""
    if not isinstance(gbnf, str):
        raise InvalidParams(param, f"{param} must be a GBNF grammar (a string)")
    try:
        lark = gbnf_to_lark(gbnf)
    except Exception as error:  # the converter raises a bare Exception too (a rule never defined)
        raise InvalidParams(param, f"{param} is not a GBNF grammar this server reads: {error}") from None
    return lark_grammar(lark, param)


def lark_grammar(lark: str, param: str) -> str:
    """A Lark grammar, if llguidance can enforce it; else a 400 naming `param`."""
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), param)


def choice_grammar(choices: Any, param: str) -> str:
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise InvalidParams(param, f"{param} must be a non-empty list of non-empty strings")
    # One terminal, not a rule of alternatives: llguidance's parser holds a rule's alternatives in one row
    # of at most 2,000 items (LLParserLimits.max_items_in_row), so a longer list failed at its first token,
    # where a terminal's alternatives are one lexeme, which its lexer takes in any number (tried to 100,000).
    # Not a JSON schema's enum, which would quote each choice.
    lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice) for choice in choices)
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), param)


def tgi_grammar(value: Any, param: str) -> str:
    """Text Generation Inference's grammar (`param`: its `grammar` parameter, or its chat's
    `response_format`): `{"type": "json", "value": schema}` ("json_object" too, as TGI takes it),
    `{"type": "regex", "value": pattern}` or `{"type": "json_schema", "value": {"schema": ...}}`."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in TGI_GRAMMARS or value.get("value") is None:
        raise InvalidParams(param, f'{param} must be {{"type": "json" or "regex", "value": ...}}')
    given, where = value["value"], f"{param}.value"
    if kind == "regex":
        return regex_grammar(given, where)
    if kind == "json_schema":
        if not isinstance(given, dict):
            raise InvalidParams(where, f'{where} must be an object with a schema: {{"schema": {{...}}}}')
        return schema_grammar(given.get("schema"), f"{where}.schema")
    return schema_grammar(given, where)


def _response_format(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    # TGI's form of a format, the grammar in `value`: its clients send it (huggingface_hub's InferenceClient
    # sends a json_schema format as {"type": "json_object", "value": schema}), and read as OpenAI's
    # json_object it would constrain the answer to any object, its schema silently dropped.
    if kind in ("json", "regex") or (kind in TGI_GRAMMARS and value.get("value") is not None):
        return tgi_grammar(value, "response_format")
    if kind == "text":
        return None
    if kind == "json_object" and value.get("schema") is not None:
        # llama.cpp server's form of a schema (LangChain's ChatHuggingFace sends it): not any object
        return schema_grammar(value["schema"], "response_format.schema")
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidParams(
                "response_format.json_schema", "response_format.json_schema must be an object with a schema"
            )
        param = "response_format.json_schema.schema"
        return json_schema_grammar(_schema(spec.get("schema"), param), param)
    raise InvalidParams(
        "response_format",
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} '
        '(or TGI\'s {"type": "json" or "regex", "value": ...}, or llama.cpp\'s {"type": "json_object", '
        '"schema": {...}})',
    )


def _schema(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):  # vLLM takes guided_json as a JSON string too
        try:
            value = json_text.loads(value)
        except ValueError:
            raise InvalidParams(param, f"{param} is not valid JSON") from None
    if not isinstance(value, dict):
        raise InvalidParams(param, f"{param} must be a JSON schema (an object)")
    return value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidParams(param, f"{param} must be a non-empty string")
    return value


def _checked(grammar: str, param: str) -> str:
    """The grammar, if llguidance can enforce all of it; else a 400 saying what it cannot."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidParams(param, f"{param} cannot be enforced: {error}")
    return grammar

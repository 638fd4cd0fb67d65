"""Qwen3-Coder's and Qwen3.5's tool calls: XML, not JSON (tool_calls.py's `qwen3_coder` format).

Their chat templates teach calls as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

a parameter's value as plain text when its schema says it is a string, else as JSON (a number, a
boolean, an object or an array), as vLLM's `qwen3_coder` parser reads them. `call_lark` is a call in
that format as a Lark rule, so that `auto` decodes a started call as one of the tools with each of its
required parameters, in its schema's order, every value its schema's kind (the Hermes format's grammar
does the same in JSON); `read_calls` reads the calls back into OpenAI's shape (arguments a JSON string).
"""

from __future__ import annotations

import json
import re
from typing import Any

from inference_api.structured_output import json_lark

# A string value: everything up to its closing tag, which is part of the lexeme. llguidance's lexer is
# greedy: a text lexeme before a literal "</parameter>" would end before the tag's last byte and refuse
# it (as tool_calls.AUTO_HERMES's OPEN).
TEXT_VALUE = r"/(?s:.*)<\/parameter>/ & ~/(?s:.*)<\/parameter>(?s:.+)/"
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|\Z)", re.S)


def template_writes_xml_calls(template_source: str) -> bool:
    """Whether a chat template teaches (and writes) calls in this format."""
    return "<function=" in template_source and "<parameter=" in template_source


def call_lark(tools: list[dict[str, Any]]) -> str:
    """Rules of a Lark grammar whose `call` is one call of any of the tools in this format (without its
    `<tool_call>` tags: the caller's grammar puts them around it)."""
    rules = ["call: " + " | ".join(f"function_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") or {}
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = []
        for j, (name, property_schema) in enumerate(properties.items()):
            parts.append(f"parameter_{i}_{j}" + ("" if name in required else "?"))
            rules.append(_parameter_rule(f"{i}_{j}", name, property_schema))
        body = " ".join([json.dumps(f"<function={function['name']}>"), "WS?", *parts, '"</function>"'])
        rules.append(f"function_{i}: {body}")
    return "\n".join(rules)


def _parameter_rule(index: str, name: str, schema: dict[str, Any]) -> str:
    opening = json.dumps(f"<parameter={name}>")
    closing = '"</parameter>" WS?'
    if _choices(schema):
        choices = " | ".join(json.dumps(choice) for choice in _choices(schema))
        return f"parameter_{index}: {opening} WS? CHOICE_{index} WS? {closing}\nCHOICE_{index}: {choices}"
    if is_text(schema):
        return f"parameter_{index}: {opening} TEXT_VALUE_{index} WS?\nTEXT_VALUE_{index}: {TEXT_VALUE}"
    return f"parameter_{index}: {opening} WS? value_{index} WS? {closing}\nvalue_{index}: {json_lark(schema)}"


def is_text(schema: Any) -> bool:
    """Whether a parameter's value is written as plain text: a string, or a choice among strings."""
    return bool(_choices(schema)) or (isinstance(schema, dict) and schema.get("type") == "string")


def _choices(schema: Any) -> list[str]:
    """A parameter's choices where they are all strings (an `enum`), written as they are."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(choice, str) for choice in enum):
        return enum
    return []


def read_calls(text: str, tools: list[dict[str, Any]]) -> list[tuple[str, str]] | None:
    """The calls in `<tool_call>` blocks' contents (`text`, from the first block's tag on), each (name,
    arguments as a JSON string); a call cut by max_tokens keeps what was written of it. None where a
    block holds no function's name (cut before it, or not a call)."""
    blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.S)
    calls = []
    for block in blocks:
        found = FUNCTION.search(block)
        if found is None:
            return None
        name, body = found[1].strip(), found[2]
        schemas = _properties(tools, name)
        written = ((key.strip(), value) for key, value in PARAMETER.findall(body))
        arguments = {key: _value(value, schemas.get(key)) for key, value in written}
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool["function"]["name"] == name:
            return (tool["function"].get("parameters") or {}).get("properties") or {}
    return {}


def _value(written: str, schema: Any) -> Any:
    """A parameter's value as its schema's kind: the text between its tags less the line breaks the format
    puts around it; parsed as JSON unless the schema says text (and kept as text where it does not
    parse, as vLLM's parser keeps it)."""
    text = written.removeprefix("\n").removesuffix("\n")
    if _choices(schema):
        return text.strip()
    if is_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text

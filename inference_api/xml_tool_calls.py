"""Tool calls written as XML, not JSON: Qwen3-Coder's and Qwen3.5's, GLM-4.5's, Seed-OSS's and MiniMax-M2's
(tool_calls.py's `qwen3_coder`, `glm45`, `seed_oss` and `minimax_m2` formats).

Their chat templates teach calls in `<tool_call>` blocks as

    <tool_call>                       <tool_call>get_weather
    <function=get_weather>            <arg_key>city</arg_key>
    <parameter=city>                  <arg_value>Paris</arg_value>
    Paris                             <arg_key>days</arg_key>
    </parameter>                      <arg_value>3</arg_value>
    <parameter=days>                  </tool_call>
    3
    </parameter>
    </function>
    </tool_call>

(Qwen3-Coder's on the left, GLM-4.5's on the right). Seed-OSS writes Qwen3-Coder's calls between
`<seed:tool_call>` tags; MiniMax-M2 writes `<invoke name="get_weather">` and `<parameter name="city">`
between `<minimax:tool_call>` tags. A value is plain text when its schema says it is a string, else
JSON (a number, a boolean, an object or an array), as vLLM's parsers of these names read them.
`call_lark` is a call in a format as Lark rules, so that `auto` decodes a started call as one of the
tools with each of its required parameters, in its schema's order, every value its schema's kind (the
Hermes format's grammar does the same in JSON); `read_call` reads a call back into OpenAI's shape
(arguments a JSON string).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from inference_api import json_text
from inference_api.structured_output import DEFINITIONS, json_lark


@dataclass(frozen=True)
class XmlFormat:
    name: str  # tool_calls.py's name for it (vLLM's)
    function_open: str  # how a call opens, around "{name}"
    function_close: str
    parameter_open: str  # how a parameter opens, around "{name}" (GLM-4.5's: its key, then its value's tag)
    parameter_close: str
    function: re.Pattern  # a block's function name and the rest of it
    parameter: re.Pattern  # each of its parameters' name and value
    tags: tuple[str, ...] = ()  # its tags that a tokenizer may have as tokens of their own (GLM-4.5's does)
    block_open: str = "<tool_call>"  # the tags around each call
    block_close: str = "</tool_call>"


def _named(opening: str, closing: str) -> re.Pattern:
    """A tag written as `opening` (its name where "{name}" is) read back: the name, and what follows up to
    `closing` or the text's end (a call max_tokens cut)."""
    before, after = opening.split("{name}")
    name = f"([^{re.escape(after[0])}\\n]+)"  # up to the character that ends the name in the tag
    return re.compile(f"{re.escape(before)}{name}{re.escape(after)}(.*?)(?:{re.escape(closing)}|\\Z)", re.S)


QWEN3_CODER = XmlFormat(
    "qwen3_coder",
    "<function={name}>",
    "</function>",
    "<parameter={name}>",
    "</parameter>",
    _named("<function={name}>", "</function>"),
    _named("<parameter={name}>", "</parameter>"),
)
GLM45 = XmlFormat(
    "glm45",
    "{name}",
    "",
    "<arg_key>{name}</arg_key>\n<arg_value>",
    "</arg_value>",
    re.compile(r"\A\s*([^<\s]+)(.*)", re.S),
    re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|\Z)", re.S),
    ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
)


# Seed-OSS's: Qwen3-Coder's calls in blocks of its own.
SEED_OSS = replace(
    QWEN3_CODER, name="seed_oss", block_open="<seed:tool_call>", block_close="</seed:tool_call>"
)
MINIMAX_M2 = XmlFormat(
    "minimax_m2",
    '<invoke name="{name}">',
    "</invoke>",
    '<parameter name="{name}">',
    "</parameter>",
    _named('<invoke name="{name}">', "</invoke>"),
    _named('<parameter name="{name}">', "</parameter>"),
    block_open="<minimax:tool_call>",
    block_close="</minimax:tool_call>",
)


def template_format(template_source: str) -> XmlFormat | None:
    """The XML format a chat template teaches (and writes its calls in), if any."""
    for form in (SEED_OSS, MINIMAX_M2):  # by their blocks' tags, which no other format writes
        if form.block_open in template_source:
            return form
    if "<function=" in template_source and "<parameter=" in template_source:
        return QWEN3_CODER
    if "<arg_key>" in template_source and "<arg_value>" in template_source:
        return GLM45
    return None


def call_lark(tools: list[dict[str, Any]], form: XmlFormat, tokens: frozenset[str] = frozenset()) -> str:
    """Rules of a Lark grammar whose `call` is one call of any of the tools in the format (without its
    `<tool_call>` tags: the caller's grammar puts them around it). `tokens`: the format's tags that are
    tokens llguidance takes as special (tokenizer.are_grammar_tokens), which the rules name as tokens:
    no string or text of a grammar holds them."""
    rules = ["call: " + " | ".join(f"function_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") or {}
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        # Each value a JSON schema of its own: the definitions the tool's `$ref`s point to, at its root.
        definitions = {where: schema[where] for where in DEFINITIONS if where in schema}
        parts = []
        for j, (name, property_schema) in enumerate(properties.items()):
            parts.append(f"parameter_{i}_{j}" + ("" if name in required else "?"))
            value_schema = {**_resolved(property_schema, schema), **definitions}
            rules.append(_parameter_rule(f"{i}_{j}", name, value_schema, form, tokens))
        opening = _literals(form.function_open.format(name=function["name"]), tokens)
        closing = [_literals(form.function_close, tokens)] if form.function_close else []
        body = " ".join([opening, "WS?", *parts, *closing])
        rules.append(f"function_{i}: {body}")
    return "\n".join(rules)


def _parameter_rule(
    index: str, name: str, schema: dict[str, Any], form: XmlFormat, tokens: frozenset[str]
) -> str:
    opening = _literals(form.parameter_open.format(name=name), tokens)
    closing = f"{_literals(form.parameter_close, tokens)} WS?"
    if _is_text(schema) and not _choices(schema) and form.parameter_close in tokens:
        # A string up to its closing tag, a token no text lexeme holds: the lexeme ends where it comes.
        return f"parameter_{index}: {opening} TEXT_VALUE_{index}? {closing}\nTEXT_VALUE_{index}: /(?s:.+)/"
    if _choices(schema):
        choices = " | ".join(json.dumps(choice) for choice in _choices(schema))
        return f"parameter_{index}: {opening} WS? CHOICE_{index} WS? {closing}\nCHOICE_{index}: {choices}"
    if _is_text(schema):
        # A string: everything up to its closing tag, which is part of the lexeme. llguidance's lexer is
        # greedy: a text lexeme before a literal closing tag would end before the tag's last byte and
        # refuse it (as tool_calls.AUTO_TAGGED's OPEN).
        tag = re.escape(form.parameter_close).replace("/", "\\/")
        text = f"/(?s:.*){tag}/ & ~/(?s:.*){tag}(?s:.+)/"
        return f"parameter_{index}: {opening} TEXT_VALUE_{index} WS?\nTEXT_VALUE_{index}: {text}"
    return f"parameter_{index}: {opening} WS? value_{index} WS? {closing}\nvalue_{index}: {json_lark(schema)}"


def _literals(written: str, tokens: frozenset[str] = frozenset()) -> str:
    """A format's fixed text as Lark literals, each line break in it any run of whitespace (WS), each of
    its tags that is a token (`tokens`) named as one."""
    return " WS? ".join(_line(line, tokens) for line in written.split("\n"))


def _line(line: str, tokens: frozenset[str]) -> str:
    if not tokens:
        return json.dumps(line)
    parts = re.split("(" + "|".join(re.escape(tag) for tag in sorted(tokens)) + ")", line)
    return " ".join(part if part in tokens else json.dumps(part) for part in parts if part) or '""'


def _is_text(schema: Any) -> bool:
    """Whether a parameter's value is written as plain text: a string, or a choice among strings."""
    return bool(_choices(schema)) or (isinstance(schema, dict) and schema.get("type") == "string")


def _choices(schema: Any) -> list[str]:
    """A parameter's choices where they are all strings (an `enum`), written as they are."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(choice, str) for choice in enum):
        return enum
    return []


def read_call(block: str, tools: list[dict[str, Any]], form: XmlFormat) -> tuple[str, str] | None:
    """A `<tool_call>` block's call (what is between its tags) as (name, arguments as a JSON string); a
    call cut by max_tokens keeps what was written of it. None where the block holds no function's name
    (cut before it, or not a call)."""
    found = form.function.search(block)
    if found is None:
        return None
    name, body = found[1].strip(), found[2]
    schemas = _properties(tools, name)
    written = ((key.strip(), value) for key, value in form.parameter.findall(body))
    arguments = {key: _value(value, schemas.get(key)) for key, value in written}
    return name, json.dumps(arguments, ensure_ascii=False)


def _properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool["function"]["name"] == name:
            schema = tool["function"].get("parameters") or {}
            return {key: _resolved(value, schema) for key, value in (schema.get("properties") or {}).items()}
    return {}


def _resolved(schema: Any, root: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema, its `$ref` to one of the tool's definitions followed (a string or a choice
    among strings is then written as text, as the template teaches, whether given there or by name)."""
    for _ in range(8):  # a definition that is itself a reference, but no cycle
        if not isinstance(schema, dict):
            return {}
        where, _, name = str(schema.get("$ref", "")).removeprefix("#/").partition("/")
        if where not in DEFINITIONS or name not in (root.get(where) or {}):
            return schema
        schema = root[where][name]
    return schema


def _value(written: str, schema: Any) -> Any:
    """A parameter's value as its schema's kind: the text between its tags less the line breaks the format
    puts around it; parsed as JSON unless the schema says text (and kept as text where it does not
    parse, as vLLM's parser keeps it)."""
    text = written.removeprefix("\n").removesuffix("\n")
    if _choices(schema):
        return text.strip()
    if _is_text(schema):
        return text
    try:
        return json_text.loads(text)
    except ValueError:
        return text

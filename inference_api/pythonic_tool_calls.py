"""LFM2's tool calls (tool_calls.py's `lfm2` format): a Python list of calls between its
two tags,

    <|tool_call_start|>[get_weather(city='Paris', days=3), get_time()]<|tool_call_end|>

and vLLM's `pythonic` format (`BARE`): the same list as the whole answer, no tags, as Llama 3.2's
lightweight models and ToolACE write it behind a template that asks for it (vLLM's
`tool_chat_template_llama3.2_pythonic.jinja`); an answer that does not open with `[` is text.

each argument a keyword, its value a Python literal (LFM2's templates write a string between single
quotes, an object as JSON, anything else as Python prints it), as vLLM's `lfm2` parser reads them.
LFM2 and LFM2.5 are Liquid AI's small models for CPUs and devices.

The tags are tokens of their own; the calls' grammar names them by id (`<[id]>`), so a format is made for
one tokenizer (`PythonicTags`), and each call is one of the tools with its required parameters, in its
schema's order, each value its schema's kind. `read_calls` reads them back with Python's own parser,
evaluating literals only (`ast.literal_eval`): JSON's true, false and null are taken too.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from inference_api.call_rules import listed_parameters
from inference_api.structured_output import json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
BARE = "pythonic"  # the format's name (vLLM's) where the list is the whole answer
# `pythonic`'s `auto`: text that does not open a list, or the list of calls (and whitespace before it).
AUTO_BARE = r"""start: TEXT | WS? calls
WS: /[ \n]+/
TEXT: /(?s:.+)/ & ~/[ \n\t]*\[(?s:.*)/
"""
# `auto`: text, or text then the calls; the text cannot spell the opening tag out.
AUTO = r"""start: TEXT | TEXT? calls
TEXT: /(?s:.+)/ & ~/(?s:.*)<\|tool_call_start\|>(?s:.*)/
"""
# Any Python literal, for a parameter whose schema is an object, an array or anything else.
ANY_VALUE = r"""py_value: PY_STRING | PY_NUMBER | PY_CONSTANT | py_list | py_dict
py_list: "[" (py_value (", " py_value)*)? "]"
py_dict: "{" (PY_STRING ": " py_value (", " PY_STRING ": " py_value)*)? "}"
PY_STRING: /'([^'\\\n]|\\.)*'/ | /"([^"\\\n]|\\.)*"/
PY_NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
PY_CONSTANT: "True" | "False" | "None" | "true" | "false" | "null"
"""
# JSON's constants, which LFM2's templates write inside an object (`| tojson`), as Python's.
JSON_CONSTANTS = {"true": True, "false": False, "null": None}
# A tool's name as a call writes it: anything up to what follows a name; a parameter's, spaces inside it
# too ("first name": a schema's may have them), up to its `=`.
_NAME = re.compile(r"[^\s(),=\[\]{}'\"]+")
_KEY = re.compile(r"[^(),=\[\]{}'\"]+")
OPENERS = {"(": ")", "[": "]", "{": "}"}
_CUT = object()  # a call max_tokens cut before its arguments
_NOT_LITERAL = object()


def writes_lfm2(template_source: str, tokenizer: PromptTokenizer) -> bool:
    """Whether a chat template writes LFM2's calls, and the tokenizer has their tags as tokens."""
    return OPEN in template_source and are_tokens((OPEN, CLOSE), tokenizer)


@dataclass(frozen=True)
class PythonicTags:
    """The ids of the calls' two tags in a tokenizer."""

    open_id: int
    close_id: int

    @classmethod
    def of(cls, tokenizer: PromptTokenizer) -> PythonicTags | None:
        """The tokenizer's tags; None where they are not tokens of its own."""
        if not are_tokens((OPEN, CLOSE), tokenizer):
            return None
        return cls(tokenizer.token_id(OPEN), tokenizer.token_id(CLOSE))

    def auto_lark(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar of `auto`'s answers: text, or text then a list of calls of the tools (one only
        unless `parallel`)."""
        return AUTO + _list_rules(tools, parallel, f"<[{self.open_id}]> ", f" <[{self.close_id}]>")


def bare_auto_lark(tools: list[dict[str, Any]], parallel: bool) -> str:
    """`pythonic`'s Lark grammar of `auto`'s answers: text, or a list of calls of the tools (one only
    unless `parallel`) as the whole answer."""
    return AUTO_BARE + _list_rules(tools, parallel)


def _list_rules(tools: list[dict[str, Any]], parallel: bool, before: str = "", after: str = "") -> str:
    """`calls`: a list of calls of the tools between `before` and `after`; and the rules it needs."""
    more = ' (", " call)*' if parallel else ""
    rules = [
        f'calls: {before}"[" call{more} "]"{after}',
        "call: " + " | ".join(f"function_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        rules += _function_rules(i, tool["function"])
    return "\n".join(rules) + "\n" + ANY_VALUE


def _function_rules(i: int, function: dict[str, Any]) -> list[str]:
    """`function_i`: its name, then its parameters as keywords between parentheses."""
    schema = function.get("parameters") or {}
    required = set(schema.get("required") or ())
    parameters = list((schema.get("properties") or {}).items())
    rules = [
        f"parameter_{i}_{j}: {json.dumps(name + '=')} {_value(value_schema)}"
        for j, (name, value_schema) in enumerate(parameters)
    ]
    listed = listed_parameters(i, [name not in required for name, _ in parameters], '", "')
    rules.append(f'function_{i}: {json.dumps(function["name"] + "(")} {listed} ")"')
    return rules


def _value(schema: Any) -> str:
    """A parameter's value as the body of a Lark rule: a string in quotes (one of its `enum`'s where it
    has one), a number as JSON writes it, a boolean or null as Python does, anything else any literal."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(choice, str) for choice in enum):
        quoted = [json.dumps(written) for choice in enum for written in (repr(choice), json.dumps(choice))]
        return "(" + " | ".join(quoted) + ")"
    kind = schema.get("type")
    if kind == "string":
        return "PY_STRING"
    if kind in ("integer", "number"):
        return json_lark(schema)
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    return "py_value"


def read_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls in `text` from its first OPEN on, as (name, arguments as a JSON string); a call cut by
    max_tokens keeps what it wrote where closing it makes it read, and is left out where it does not.
    None where they do not read as calls."""
    _, found, rest = text.partition(OPEN)
    return read_list(rest.partition(CLOSE)[0]) if found else None


def read_list(listed: str) -> list[tuple[str, str]] | None:
    """The calls of a Python list of calls (`pythonic`'s whole answer, LFM2's between its tags), as
    `read_calls` reads them. Read by hand, not by Python's parser: a tool's name or a parameter's may be
    no Python name (`get-weather`, `user-id`, `from`), which the grammar writes all the same; each value
    is a literal, which Python's parser reads (`_literal`)."""
    text = listed.strip()
    if not text.startswith("["):
        return None
    calls: list[tuple[str, str]] = []
    at = 1
    while True:
        at = _skip(text, at)
        if at == len(text):  # cut between calls
            break
        if text[at] == "]":  # the end, with nothing after it
            return (calls or None) if not text[at + 1 :].strip() else None
        read = _call(text, at)
        if read is _CUT:  # a call cut before its arguments: left out
            break
        if read is None:
            return None
        call, at = read
        calls.append(call)
        at = _skip(text, at)
        if text.startswith(",", at):
            at += 1
        elif at < len(text) and text[at] != "]":
            return None
    return calls or None


def _call(text: str, at: int) -> tuple[tuple[str, str], int] | object | None:
    """The call at `at` and where it ends (the text's end where max_tokens cut it: then with what was
    written of its arguments); _CUT where it was cut before its parenthesis, None where it is no call."""
    name = _NAME.match(text, at)
    if name is None:
        return None
    at = _skip(text, name.end())
    if at == len(text):
        return _CUT
    if text[at] != "(":
        return None
    arguments: dict[str, Any] = {}
    at += 1
    while True:
        at = _skip(text, at)
        if at == len(text):
            break
        if text[at] == ")":
            return (name[0], json.dumps(arguments, ensure_ascii=False)), at + 1
        key = _KEY.match(text, at)
        if key is None:  # a positional argument, **kwargs: no call of ours
            return None
        at = _skip(text, key.end())
        if at == len(text):  # cut in the keyword: left out
            break
        if text[at] != "=":
            return None
        end, closing = _value_end(text, at + 1)
        value = _literal(text[at + 1 : end] + closing)
        if end == len(text):  # cut in the value: kept where closing it makes it read
            if value is not _NOT_LITERAL:
                arguments[key[0].rstrip()] = value
            break
        if value is _NOT_LITERAL:  # not a literal (a name, a call), or not JSON's (a set)
            return None
        arguments[key[0].rstrip()] = value
        at = end + 1 if text[end] == "," else end
    return (name[0], json.dumps(arguments, ensure_ascii=False)), len(text)


def _value_end(text: str, at: int) -> tuple[int, str]:
    """Where the value at `at` ends (at the `,` or `)` after it, outside its strings and brackets; the
    text's end where it was cut), and what would close it there (its open string and brackets)."""
    closers: list[str] = []
    quote = ""
    index = at
    while index < len(text):
        character = text[index]
        if quote:
            if character == "\\":
                index += 1
            elif character == quote:
                quote = ""
        elif character in "'\"":
            quote = character
        elif character in OPENERS:
            closers.append(OPENERS[character])
        elif closers and character == closers[-1]:
            closers.pop()
        elif not closers and character in ",)":
            return index, ""
        index += 1
    return len(text), quote + "".join(reversed(closers))


def _literal(written: str) -> Any:
    """A value as Python writes it (JSON's true, false and null too), if it is JSON's; else _NOT_LITERAL.
    A NUL or a carriage return the model wrote inside a string (the grammar's strings take any character
    but the line feed) is read as its escape: Python's parser takes neither there."""
    source = written.strip().replace("\x00", "\\x00").replace("\r", "\\r")
    try:
        value = ast.literal_eval(_JsonConstants().visit(ast.parse(source, mode="eval").body))
        json.dumps(value)
        return value
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return _NOT_LITERAL


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \n\t":
        at += 1
    return at


class _JsonConstants(ast.NodeTransformer):
    """JSON's true, false and null as Python's constants; any other name is not a literal."""

    def visit_Name(self, node: ast.Name) -> ast.Constant:
        if node.id not in JSON_CONSTANTS:
            raise ValueError(f"{node.id} is not a literal")
        return ast.copy_location(ast.Constant(JSON_CONSTANTS[node.id]), node)

"""Gemma 4's tool calls (tool_calls.py's `gemma4` format) and FunctionGemma's (`functiongemma`): neither
JSON nor XML, but a compact notation of their own between special tokens,

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{metric:true}}<tool_call|>
    <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>

its keys bare, its strings between `<|"|>` (FunctionGemma: `<escape>`) tokens, its numbers, booleans and
nulls as JSON writes them, its objects and arrays in braces and brackets, as vLLM's `gemma4` and
`functiongemma` parsers read them. FunctionGemma is Google's Gemma 3 270M tuned for calling functions,
small enough for a CPU; Gemma 4's notation came from it, under new tags (`Notation`). The three tags are
special tokens, which a decoded answer leaves out unless it keeps them: an answer that may call keeps
them (SamplingParams.skip_special_tokens false, as vLLM sets it), and its grammar names them as tokens
(`<|tool_call>`), which llguidance matches by the tokenizer's vocabulary.

`call_lark` is a call as Lark rules, one of the tools with each required parameter in its schema's
order and each value its schema's kind (an object or an array any value in the notation); `read_call`
reads one back into OpenAI's shape (arguments a JSON string), what was written of a call cut by
max_tokens too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference_api import json_text
from inference_api.call_rules import listed_parameters
from inference_api.structured_output import json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens


@dataclass(frozen=True)
class Notation:
    """A model's tags for the notation: a call's two, the one around each string, and the one its
    templates write after a turn's calls, where their results follow (the model writes it too: the end of
    its calls, a stop for vLLM's users)."""

    name: str  # the format's name (--tool-call-parser)
    open: str
    close: str
    quote: str
    response: str
    family: str  # the models', for messages

    def has_tags(self, tokenizer: PromptTokenizer) -> bool:
        """Whether the tokenizer has the four tags as tokens of their own."""
        return are_tokens((self.open, self.close, self.quote, self.response), tokenizer)

    def is_taught(self, template_source: str, tokenizer: PromptTokenizer) -> bool:
        """Whether a chat template teaches these calls, and the tokenizer has their tags as tokens."""
        return self.open in template_source and "call:" in template_source and self.has_tags(tokenizer)


GEMMA4 = Notation("gemma4", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>", "Gemma 4")
FUNCTIONGEMMA = Notation(
    "functiongemma",
    "<start_function_call>",
    "<end_function_call>",
    "<escape>",
    "<start_function_response>",
    "FunctionGemma",
)
NOTATIONS = {notation.name: notation for notation in (GEMMA4, FUNCTIONGEMMA)}
COMMA = '","'  # between two parameters, as a Lark literal
CALL = re.compile(r"\A\s*call:([\w.-]+)\{(.*)\Z", re.S)  # a block's function name and its arguments
# Lark rules of any value in the notation, for an object's or an array's parameter ({quote}: its tag).
ANY_VALUE = """any_value: any_string | any_object | any_array | BARE
any_string: {quote} STRING {quote}
any_object: "{{" (KEY ":" any_value ("," KEY ":" any_value)*)? "}}"
any_array: "[" (any_value ("," any_value)*)? "]"
KEY: /[A-Za-z_][A-Za-z0-9_]*/
BARE: /-?[0-9][0-9.eE+-]*|true|false|null/
STRING: /(?s:.*)/
"""


def call_lark(tools: list[dict[str, Any]], notation: Notation) -> str:
    """Rules of a Lark grammar whose `call` is one call of any of the tools in the notation (without its
    tags, which the caller's grammar puts around it), and `any_value`'s."""
    rules = ["call: " + " | ".join(f"function_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") or {}
        required = set(schema.get("required") or ())
        parameters = list((schema.get("properties") or {}).items())
        for j, (name, value_schema) in enumerate(parameters):
            rules.append(f"parameter_{i}_{j}: {json.dumps(name + ':')} value_{i}_{j}")
            rules.append(f"value_{i}_{j}: {_value(value_schema, notation.quote)}")
        optional = [name not in required for name, _ in parameters]
        listed = listed_parameters(i, optional, COMMA)
        rules.append(f'function_{i}: {json.dumps("call:" + function["name"] + "{")} {listed} "}}"')
    return "\n".join(rules) + "\n" + ANY_VALUE.format(quote=notation.quote)


def _value(schema: Any, quote: str) -> str:
    """A parameter's value as the body of a Lark rule: a string between `quote` tokens (one of its
    `enum`'s where it has one), a number, boolean or null as JSON writes it, anything else any value."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(choice, str) for choice in enum):
        return f"{quote} (" + " | ".join(json.dumps(choice) for choice in enum) + f") {quote}"
    kind = schema.get("type")
    if kind == "string":
        return f"{quote} STRING {quote}"
    if kind in ("integer", "number", "boolean", "null"):
        return json_lark(schema)
    return "any_value"


def read_call(block: str, notation: Notation) -> tuple[str, str] | None:
    """A call's block (what is between its tags) as (name, arguments as a JSON string); a call cut by
    max_tokens keeps what was written of it. None where the block holds no `call:NAME{`, or nests past
    Python's recursion limit (a model looping on `[`): no call then, its text kept."""
    found = CALL.match(block)
    if found is None:
        return None
    try:
        arguments, _ = _object(found[2], 0, notation.quote)
        return found[1], json.dumps(arguments, ensure_ascii=False)
    except RecursionError:
        return None


def _object(text: str, at: int, quote: str) -> tuple[dict[str, Any], int]:
    """The pairs of an object from `at` (past its brace) up to its closing brace or the text's end; and
    where it ended."""
    pairs: dict[str, Any] = {}
    while at < len(text):
        at = _skip(text, at, " \n\t,")
        if at >= len(text) or text[at] == "}":
            return pairs, at + 1
        colon = text.find(":", at)
        if colon < 0:  # a key cut off: not a pair yet
            return pairs, len(text)
        key = text[at:colon].strip()
        value, at = _item(text, _skip(text, colon + 1, " \n\t"), "}", quote)
        if value is not _CUT:
            pairs[key] = value
    return pairs, at


def _array(text: str, at: int, quote: str) -> tuple[list[Any], int]:
    items: list[Any] = []
    while at < len(text):
        at = _skip(text, at, " \n\t,")
        if at >= len(text) or text[at] == "]":
            return items, at + 1
        value, at = _item(text, at, "]", quote)
        if value is not _CUT:
            items.append(value)
    return items, at


_CUT = object()  # a bare value the text ends inside (max_tokens): left out, as it may not be whole


def _item(text: str, at: int, closer: str, quote: str) -> tuple[Any, int]:
    """The value at `at`, and where it ended."""
    if text.startswith(quote, at):
        end = text.find(quote, at + len(quote))
        if end < 0:  # cut inside the string: what was written
            return text[at + len(quote) :], len(text)
        return text[at + len(quote) : end], end + len(quote)
    if text.startswith("{", at):
        return _object(text, at + 1, quote)
    if text.startswith("[", at):
        return _array(text, at + 1, quote)
    end = at
    while end < len(text) and text[end] not in "," + closer:
        end += 1
    if end == len(text):
        return _CUT, end
    written = text[at:end].strip()
    try:
        return json_text.loads(written), end
    except ValueError:
        return written, end


def _skip(text: str, at: int, characters: str) -> int:
    while at < len(text) and text[at] in characters:
        at += 1
    return at

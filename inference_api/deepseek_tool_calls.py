"""DeepSeek's tool calls (tool_calls.py's `deepseek_v3` and `deepseek_v31` formats): calls between its
tags, in the two layouts its models write, as vLLM's parsers of those names read them,

    deepseek_v3 (V3, R1):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    deepseek_v31 (V3.1 and later):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3.1's calls follow each other with nothing between; the line breaks above are for reading). A
template that writes the calls fenced as JSON teaches the first, any other the second.

The tags are tokens of their own in DeepSeek's tokenizers. The calls' grammar names them by their ids
(`<[id]>`, llguidance's syntax), so that it holds whether a tokenizer marks them special or not: a format
is made for one tokenizer (`DeepSeekTags`). The text before the calls cannot spell the opening tag out.

DeepSeek's chat templates take no `tools`: its model card gives the system prompt that lists them, which
`tools_system_prompt` writes (in the fenced layout for V3's). Its templates add a call's arguments to
text, which tool_calls.ArgumentsObject allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inference_api.mistral_tool_calls import json_arguments
from inference_api.structured_output import json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TAGS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
V3, V31 = "deepseek_v3", "deepseek_v31"  # vLLM's names for the two layouts
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"  # around V3's arguments, after the name
# `auto`: text, or text then the calls; the text cannot spell the opening tag (a tokenizer may not mark
# it special, and then a text lexeme could hold it).
AUTO = f"""start: TEXT | TEXT? calls
TEXT: /(?s:.+)/ & ~/(?s:.*){CALLS_BEGIN}(?s:.*)/
"""
# `none`: text that opens no calls.
NONE = f"""start: TEXT?
TEXT: /(?s:.+)/ & ~/(?s:.*){CALLS_BEGIN}(?s:.*)/
"""


def template_format(template_source: str, tokenizer: PromptTokenizer) -> str | None:
    """The layout a chat template teaches (V3 where it fences the arguments as JSON, else V31); None where
    it writes no DeepSeek calls or the tokenizer does not have their tags as tokens."""
    if CALLS_BEGIN not in template_source or not are_tokens(TAGS, tokenizer):
        return None
    return V3 if "```json" in template_source else V31


@dataclass(frozen=True)
class DeepSeekTags:
    """The ids of the calls' five tags in a tokenizer, and the layout (`fenced`: V3's)."""

    calls_begin: int
    calls_end: int
    call_begin: int
    call_end: int
    sep: int
    fenced: bool

    @classmethod
    def of(cls, tokenizer: PromptTokenizer, parser: str) -> DeepSeekTags | None:
        """The tokenizer's tags for a format; None where they are not tokens of its own."""
        if not are_tokens(TAGS, tokenizer):
            return None
        return cls(*(tokenizer.token_id(tag) for tag in TAGS), fenced=parser == V3)

    def auto_lark(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar of `auto`'s answers: text, or text then calls of the tools (one only unless
        `parallel`), each with arguments valid under its tool's parameters."""
        between = '"\\n"? ' if self.fenced else ""  # V3's templates put a line break between two calls
        more = f" ({between}call)*" if parallel else ""
        names = " | ".join(f"function_{i}" for i in range(len(tools)))
        rules = [
            f"calls: <[{self.calls_begin}]> call{more} <[{self.calls_end}]>",
            f"call: <[{self.call_begin}]> ({names}) <[{self.call_end}]>",
        ]
        rules += [self._function(i, tool["function"]) for i, tool in enumerate(tools)]
        return AUTO + "\n".join(rules) + "\n"

    def _function(self, i: int, function: dict[str, Any]) -> str:
        name, schema = json.dumps(function["name"]), function.get("parameters") or {"type": "object"}
        if self.fenced:
            fenced = f"{json.dumps(FENCE_OPEN)} {json_lark(schema)} {json.dumps(FENCE_CLOSE)}"
            return f'function_{i}: "function" <[{self.sep}]> {name} {fenced}'
        return f"function_{i}: {name} <[{self.sep}]> {json_lark(schema)}"


def read_calls(text: str, fenced: bool) -> list[tuple[str, str]] | None:
    """The calls in `text` from its first CALLS_BEGIN on, as (name, arguments as a JSON string); a call
    cut by max_tokens keeps what was written of its arguments. None where they do not read as calls."""
    _, found, rest = text.partition(CALLS_BEGIN)
    blocks = rest.partition(CALLS_END)[0].split(CALL_BEGIN)[1:]
    if not found or not blocks:
        return None
    calls = [_call(block.partition(CALL_END)[0], fenced) for block in blocks]
    return None if None in calls else calls


def _call(block: str, fenced: bool) -> tuple[str, str] | None:
    """A call's `name<sep>arguments` (V3.1), or `function<sep>name` and its fenced arguments (V3)."""
    head, found, rest = block.partition(SEP)
    if not found:
        return None
    if fenced:
        name, _, arguments = rest.partition("\n")
        arguments = _unfenced("\n" + arguments)
    else:
        name, arguments = head, rest
    name = name.strip()
    return (name, json_arguments(arguments.strip())) if name else None


def _unfenced(written: str) -> str:
    """V3's arguments without the fence around them, or what was written of it (a call cut short)."""
    if FENCE_OPEN.startswith(written):  # cut before the arguments
        return ""
    written = written.removeprefix(FENCE_OPEN)
    for end in range(len(FENCE_CLOSE), 0, -1):  # the longest start of the closing fence it ends with
        if written.endswith(FENCE_CLOSE[:end]):
            return written[:-end]
    return written


def tools_system_prompt(tools: list[dict[str, Any]], fenced: bool) -> str:
    """The tools as DeepSeek-V3.1's model card lists them in the system prompt, and the layout of its
    calls; V3's fenced one where `fenced`."""
    listing = "\n\n".join(_listed(tool["function"]) for tool in tools)
    if fenced:
        call = f"function{SEP}tool_call_name{FENCE_OPEN}tool_call_arguments{FENCE_CLOSE}"
        several = "- For multiple tool calls, put each on a line of its own"
    else:
        call = f"tool_call_name{SEP}tool_call_arguments"
        several = "- For multiple tool calls, chain them directly without separators or spaces"
    return (
        f"## Tools\nYou have access to the following tools:\n\n{listing}\n\n"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        f"{CALLS_BEGIN}{CALL_BEGIN}{call}{CALL_END}{{additional_tool_calls}}{CALLS_END}\n\n"
        "Where:\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        f"{several}"
    )


def _listed(function: dict[str, Any]) -> str:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return (
        f"### {function['name']}\nDescription: {function.get('description') or ''}\n\n"
        f"Parameters: {json.dumps(parameters, ensure_ascii=False)}"
    )

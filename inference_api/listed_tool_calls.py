"""Tool calls as a JSON list between two tags of their own (tool_calls.py's `jamba`, `nemotron_nano_v2`
and `phi4_mini` formats), the first two as vLLM's parsers of these names read them:

    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>    Jamba, Hunyuan
    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>        Nemotron Nano 2
    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>  Phi-4-mini

The tags are tokens of their own in these models' tokenizers; the calls' grammar names them by id
(`<[id]>`), so a format is made for one tokenizer (`ListTags`), and the text before the calls cannot
spell the opening tag out. The list is read as Mistral's listed calls are (mistral_tool_calls.read_calls).

Phi-4-mini's template writes no calls and takes no `tools` argument: it takes the tools as a JSON string
in the system message's `tools` field (`takes_system_tools`), writes them between `<|tool|>` and
`<|/tool|>`, and the model answers with its `<|tool_call|>` tokens (as Microsoft's model card and the
Berkeley function-calling leaderboard's handler of the model have it; vLLM's `phi4_mini_json` reads
`functools[...]` instead, which its own example template teaches). A call in the history goes back into
the assistant's text in that format (tool_calls.template_messages).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference_api.structured_output import json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens

PHI4_MINI = "phi4_mini"
# Each format's tags, by vLLM's name for it (Phi-4-mini's: see above).
LISTS = {
    "jamba": ("<tool_calls>", "</tool_calls>"),
    "nemotron_nano_v2": ("<TOOLCALL>", "</TOOLCALL>"),
    PHI4_MINI: ("<|tool_call|>", "<|/tool_call|>"),
}
# How Phi-4-mini's template reads the tools: a system message's field.
SYSTEM_TOOLS = re.compile(r"""message\[\s*['"]tools['"]\s*\]|message\.tools\b""")
# The system message Microsoft's examples give Phi-4-mini with tools, for a conversation without one.
PHI4_MINI_SYSTEM = "You are a helpful assistant with some tools."


def template_format(template_source: str, tokenizer: PromptTokenizer) -> str | None:
    """The format whose opening tag the chat template writes (Phi-4-mini's: or whose template takes the
    tools in the system message), where the tokenizer has both its tags as tokens; else None."""
    for name, tags in LISTS.items():
        written = tags[0] in template_source or (name == PHI4_MINI and takes_system_tools(template_source))
        if written and are_tokens(tags, tokenizer):
            return name
    return None


def takes_system_tools(template_source: str) -> bool:
    """Whether a chat template takes the tools from the system message's `tools` field (Phi-4-mini's)."""
    return SYSTEM_TOOLS.search(template_source) is not None


def with_system_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the tools' functions, as a JSON list, in their system message's `tools` field
    (Microsoft's system message added where there is none)."""
    listing = json.dumps([tool["function"] for tool in tools], ensure_ascii=False)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools": listing}, *messages[1:]]
    return [{"role": "system", "content": PHI4_MINI_SYSTEM, "tools": listing}, *messages]


def written_calls(calls: list[dict[str, Any]], parser: str) -> str:
    """An assistant's calls (chat's shape, their arguments read as objects: tool_calls.read_tool_calls) as
    the format writes them, for a template that writes none itself."""
    opening, closing = LISTS[parser]
    listed = [
        {"name": call["function"]["name"], "arguments": call["function"]["arguments"]} for call in calls
    ]
    return opening + json.dumps(listed, ensure_ascii=False) + closing


@dataclass(frozen=True)
class ListTags:
    """A format's two tags and their ids in a tokenizer."""

    opening: str
    closing: str
    open_id: int
    close_id: int

    @classmethod
    def of(cls, tokenizer: PromptTokenizer, parser: str) -> ListTags | None:
        """The tokenizer's tags for a format; None where they are not tokens of its own."""
        tags = LISTS[parser]
        if not are_tokens(tags, tokenizer):
            return None
        return cls(*tags, *(tokenizer.token_id(tag) for tag in tags))

    def auto_lark(self, one_call: dict[str, Any], parallel: bool) -> str:
        """A Lark grammar of `auto`'s answers: text, or text then a list of calls (one only unless
        `parallel`), `one_call` the schema of one as `{"name", "arguments"}`."""
        spelled = re.escape(self.opening).replace("/", "\\/")
        more = ' (", " listed_call)*' if parallel else ""
        return (
            f"start: TEXT | TEXT? calls\nTEXT: /(?s:.+)/ & ~/(?s:.*){spelled}(?s:.*)/\n"
            f'calls: <[{self.open_id}]> "\\n"? "[" listed_call{more} "]" "\\n"? <[{self.close_id}]>\n'
            f"listed_call: {json_lark(one_call)}\n"
        )

"""Tool calls as a JSON list between two tags of their own (tool_calls.py's `jamba` and `nemotron_nano_v2`
formats), as vLLM's parsers of these names read them:

    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>    Jamba, Hunyuan
    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>        Nemotron Nano 2

The tags are tokens of their own in these models' tokenizers; the calls' grammar names them by id
(`<[id]>`), so a format is made for one tokenizer (`ListTags`), and the text before the calls cannot
spell the opening tag out. The list is read as Mistral's listed calls are (mistral_tool_calls.read_calls).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inference_api.structured_output import json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens

# Each format's tags, by vLLM's name for it.
LISTS = {"jamba": ("<tool_calls>", "</tool_calls>"), "nemotron_nano_v2": ("<TOOLCALL>", "</TOOLCALL>")}


def template_format(template_source: str, tokenizer: PromptTokenizer) -> str | None:
    """The format whose opening tag the chat template writes, where the tokenizer has both its tags as
    tokens; else None."""
    for name, tags in LISTS.items():
        if tags[0] in template_source and are_tokens(tags, tokenizer):
            return name
    return None


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

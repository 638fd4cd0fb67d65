"""Mistral's tool calls (tool_calls.py's `mistral` format), after its `[TOOL_CALLS]` token, in the two
layouts of Mistral's tokenizers, as vLLM's `mistral` parser reads them:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}     (v11 and later:
                                    Mistral Small 3.2, Devstral, Magistral, Ministral 3)
    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]         (before: Mistral 7B
                                    v0.3, Mixtral 8x22B, Mistral Nemo, Mistral Small 3.1)

A tokenizer with `[ARGS]` as a token writes the first, any other the second. Granite 3 (tool_calls.py's
`granite` format) writes the second after its own `<|tool_call|>` token, as vLLM's `granite` parser
reads it. The tags are special tokens, which a decoded answer leaves out unless it keeps them
(SamplingParams.skip_special_tokens false), and which no text grammar can spell: the calls' grammar
names them by their ids (`<[id]>`, llguidance's syntax), so a format is made for one tokenizer
(`CallTags`).

Mistral's templates refuse a history whose call ids are not 9 letters and digits (mistral-common checks
the same): calls read here get such ids, and `history_ids` turns another server's (OpenAI's `call_...`,
Anthropic's `toolu_...`) into 9 of them, the same for a call and its result.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from inference_api import json_text
from inference_api.structured_output import json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens

OPEN, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GRANITE_OPEN = "<|tool_call|>"
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9
# A listed call (before v11) cut by max_tokens after its name, as its grammar lays it out (JSON_LAYOUT's
# spacing, the name first): the name, and what was written of the arguments.
CUT_LISTED_CALL = re.compile(r'\A\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (.*)\Z', re.S)
# `auto`: text, or text then calls; the tags are special tokens, which no text lexeme holds.
AUTO = """start: TEXT | TEXT? calls
TEXT: /(?s:.+)/
"""


@dataclass(frozen=True)
class CallTags:
    """The token the calls follow (`opening`, Mistral's `[TOOL_CALLS]` or Granite's `<|tool_call|>`) and its
    id in a tokenizer, and (Mistral's v11 and later) the id of its `[ARGS]` token."""

    opening: str
    open_id: int
    args_id: int | None = None

    @classmethod
    def of(cls, tokenizer: PromptTokenizer, opening: str = OPEN) -> CallTags | None:
        """The tokenizer's tags; None where `opening` is not a token of its own."""
        open_id = _token(opening, tokenizer)
        if open_id is None:
            return None
        return cls(opening, open_id, _token(ARGS, tokenizer) if opening == OPEN else None)

    @property
    def named_calls(self) -> bool:
        """Whether calls are written v11's way, `[TOOL_CALLS]name[ARGS]{...}` each, not as a JSON list."""
        return self.args_id is not None

    def auto_lark(self, tools: list[dict[str, Any]], one_call: dict[str, Any], parallel: bool) -> str:
        """A Lark grammar of `auto`'s answers: text, or text then calls of the tools (one only unless
        `parallel`). `one_call`: the schema of one call as `{"name", "arguments"}`, for the list."""
        if self.named_calls:
            names = " | ".join(f"function_{i}" for i in range(len(tools)))
            calls = "named_call+" if parallel else "named_call"
            rules = [f"calls: {calls}", f"named_call: <[{self.open_id}]> ({names})"]
            rules += [self._named_call(i, tool) for i, tool in enumerate(tools)]
        else:
            # One space at most after the tag (Mistral's " [", Granite's "["), JSON's between calls: a run
            # of whitespace there would be free for a model to spend its tokens on.
            more = ' (", " listed_call)*' if parallel else ""
            rules = [
                f'calls: <[{self.open_id}]> " "? "[" listed_call{more} "]"',
                f"listed_call: {json_lark(one_call)}",
            ]
        return AUTO + "\n".join(rules) + "\n"

    def _named_call(self, i: int, tool: dict[str, Any]) -> str:
        function = tool["function"]
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        return f"function_{i}: {json.dumps(function['name'])} <[{self.args_id}]> {json_lark(schema)}"


def _token(text: str, tokenizer: PromptTokenizer) -> int | None:
    """The id of the token that is `text` whole (special, as Mistral's tokenizers have their tags); None
    where the tokenizer spells it out."""
    return tokenizer.token_id(text) if are_tokens((text,), tokenizer) else None


def writes_calls(opening: str, template_source: str, tokenizer: PromptTokenizer) -> bool:
    """Whether a chat template teaches calls after `opening`, and the tokenizer has it as a token."""
    return opening in template_source and CallTags.of(tokenizer, opening) is not None


def read_calls(text: str, opening: str = OPEN) -> list[tuple[str, str]] | None:
    """The calls in `text` from its first `opening` on, as (name, arguments as a JSON string); a call cut
    by max_tokens keeps what was written of its arguments. None where they do not read as calls."""
    blocks = text.split(opening)[1:]
    if not blocks:
        return None
    if opening == OPEN and any(ARGS in block for block in blocks):
        calls = [_named_call(block) for block in blocks]
        return None if None in calls else calls
    return listed_calls(opening.join(blocks))


def _named_call(block: str) -> tuple[str, str] | None:
    """v11's `name[ARGS]{...}` (a `[CALL_ID]id` after the name, as histories write it, left out)."""
    name, found, arguments = block.partition(ARGS)
    name = name.partition(CALL_ID)[0].strip()
    if not found or not name:
        return None
    return name, json_arguments(arguments.strip())


def listed_calls(
    text: str, name: str = "name", arguments: str = "arguments", cut: re.Pattern = CUT_LISTED_CALL
) -> list[tuple[str, str]] | None:
    """A JSON list of calls, `[{"name": ..., "arguments": {...}}, ...]` (the list before v11; `name` and
    `arguments` its keys, Cohere's actions' `tool_name` and `parameters`), its last call maybe cut by
    max_tokens: `cut` reads that one's name and what was written of its arguments."""
    rest = text.strip().removeprefix("[")
    calls: list[tuple[str, str]] = []
    while rest.strip() and not rest.strip().startswith("]"):
        rest = rest.lstrip(" \n\t,")
        try:
            call, end = json_text.raw_decode(rest)
        except ValueError:
            written = cut.match(rest)
            return calls + [(json.loads(written[1]), written[2])] if written else (calls or None)
        if not isinstance(call, dict) or not isinstance(call.get(name), str):
            return None
        calls.append((call[name], json.dumps(call.get(arguments, {}), ensure_ascii=False)))
        rest = rest[end:]
    return calls or None


def json_arguments(written: str) -> str:
    """Arguments as a JSON string: re-serialized where whole, as written where cut."""
    try:
        return json.dumps(json_text.loads(written), ensure_ascii=False)
    except ValueError:
        return written


def new_call_id() -> str:
    """An id as Mistral's templates take it: 9 letters and digits."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))


def is_mistral_id(call_id: str) -> bool:
    return len(call_id) == ID_LENGTH and call_id.isascii() and call_id.isalnum()


def history_id(call_id: Any) -> Any:
    """A call's id as Mistral's templates take it: kept where it is 9 letters and digits, else 9 of them
    derived from it (the same for the call and its result); what is not a string is left to the template."""
    if not isinstance(call_id, str) or is_mistral_id(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = []
    for _ in range(ID_LENGTH):
        number, digit = divmod(number, len(ID_ALPHABET))
        digits.append(ID_ALPHABET[digit])
    return "".join(digits)


def history_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their calls' ids and their results' `tool_call_id`s as `history_id` makes them."""
    shaped = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**call, "id": history_id(call.get("id"))} for call in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        if message.get("role") == "tool" and "tool_call_id" in message:
            message = {**message, "tool_call_id": history_id(message["tool_call_id"])}
        shaped.append(message)
    return shaped

"""JSON text that the server did not write: a request's string fields (a call's `arguments`, a
`guided_json` schema) and the calls a model writes.

Such text may nest deeper than Python's recursion limit (`[[[[...`, which a looping model writes too),
and json raises that as a RecursionError, not as the ValueError of any other bad JSON. Read here, it
is a ValueError like the rest, so that one `except ValueError` covers both: a request's 400, a call
kept as written, never a 500.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOO_DEEP = "JSON nested too deeply to read"

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def loads(text: str | bytes) -> Any:
    """json.loads, with JSON nested past the recursion limit a ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


def raw_decode(text: str, at: int = 0) -> tuple[Any, int]:
    """The JSON value at `at` and where it ends (JSONDecoder.raw_decode), nested too deeply a ValueError."""
    try:
        return _DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


def object_written(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (Anthropic's `input`, Ollama's `arguments`): whole; or, for a call
    max_tokens cut, the members written whole before the cut (a value cut short is left out rather than
    guessed)."""
    try:
        whole = loads(arguments)
    except ValueError:
        return _written_members(arguments)
    return whole if isinstance(whole, dict) else {}


def _written_members(text: str) -> dict[str, Any]:
    """The members of a cut JSON object whose values are whole: ended by `,` or `}`, or at the cut a
    value that ends itself (a string, an object, an array, a literal; not a number, which more digits
    could have followed)."""
    members: dict[str, Any] = {}
    at = _SPACE.match(text).end()
    if not text.startswith("{", at):
        return members
    at += 1
    while True:
        try:
            key, at = raw_decode(text, _SPACE.match(text, at).end())
            at = _SPACE.match(text, at).end()
            if text[at] != ":" or not isinstance(key, str):
                return members
            value, at = raw_decode(text, _SPACE.match(text, at + 1).end())
        except (ValueError, IndexError):  # cut inside the member
            return members
        if at == len(text) and type(value) in (int, float):
            return members
        at = _SPACE.match(text, at).end()
        if text[at : at + 1] not in (",", "}", ""):
            return members
        members[key] = value
        if at == len(text):
            return members
        at += 1

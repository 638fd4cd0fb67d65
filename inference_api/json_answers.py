"""The app's JSON writer: a big answer written a piece at a time, so that the router thread gets the GIL.

json.dumps writes in C and holds the GIL until it is done. An answer of a 1,900-token prompt's
prompt_logprobs (20 alternatives a position) is 2-3 MB of JSON: 40-60 ms in one call on a 2-core Xeon,
and every stream of the worker waited that long, as the router thread hands their tokens over while
holding the GIL. Here a long list is written a slice at a time, each slice in one C call (8 objects, or
1,024 numbers or strings): Python runs between the calls, and a thread waiting for the GIL gets it
within the interpreter's switch interval (5 ms). The text is json.dumps' own, to the byte.
"""

from __future__ import annotations

import json
from typing import Any

from flask.json.provider import DefaultJSONProvider

# A list longer than this is written a slice at a time. Shorter ones, and whatever lies below a long
# list's items, go to C whole.
LONG_LIST = 64
# A long list is written this many items a call: about 0.2 ms of floats, or of a 1,900-token prompt's
# logprobs with 20 alternatives a position (8 positions); a call's own cost is about a microsecond.
SLICE = 1024
OBJECTS_A_CALL = 8
CONTAINERS = (list, tuple, dict)  # (a tuple of types: isinstance takes it faster than a union)
# How deep the walk looks for long lists, through objects and short lists: a response's
# choices[i].logprobs.content, a TGI answer's details.prefill.
DEPTH = 6


class PiecewiseJSONProvider(DefaultJSONProvider):
    """Flask's JSON provider (its defaults: sorted keys, ASCII escapes), long lists written in pieces."""

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        kwargs.setdefault("default", self.default)
        kwargs.setdefault("ensure_ascii", self.ensure_ascii)
        kwargs.setdefault("sort_keys", self.sort_keys)
        if kwargs.get("indent") is not None:  # debug mode's pretty answers: json.dumps whole
            return json.dumps(obj, **kwargs)
        return dumps_in_pieces(obj, json.JSONEncoder(**kwargs))


def dumps_in_pieces(obj: Any, encoder: json.JSONEncoder) -> str:
    """`encoder.encode(obj)`, its long lists a slice a call."""
    return "".join(_pieces(obj, encoder, 0))


def _pieces(obj: Any, encoder: json.JSONEncoder, depth: int) -> list[str]:
    if isinstance(obj, list | tuple) and len(obj) > LONG_LIST:
        # A slice a call, written as a list whose brackets are the long list's own: numbers or strings (an
        # embedding) SLICE a call, objects or lists (a position's logprobs) OBJECTS_A_CALL. An answer's
        # long list holds one kind of item, told by its ends (prompt_logprobs: a None, then objects).
        objects = isinstance(obj[0], CONTAINERS) or isinstance(obj[-1], CONTAINERS)
        size = OBJECTS_A_CALL if objects else SLICE
        slices = [encoder.encode(list(obj[i : i + size]))[1:-1] for i in range(0, len(obj), size)]
        return _joined("[", slices, encoder.item_separator, "]")
    if depth >= DEPTH or not _holds_containers(obj):
        return [encoder.encode(obj)]
    if isinstance(obj, list | tuple):
        items = ["".join(_pieces(item, encoder, depth + 1)) for item in obj]
        return _joined("[", items, encoder.item_separator, "]")
    members = sorted(obj.items()) if encoder.sort_keys else obj.items()
    texts = [
        encoder.encode(key) + encoder.key_separator + "".join(_pieces(value, encoder, depth + 1))
        for key, value in members
    ]
    return _joined("{", texts, encoder.item_separator, "}")


def _holds_containers(obj: Any) -> bool:
    """Whether a long list may lie below `obj`: a list or an object (string keys alone: C converts the
    others, and sorts them) with a list or an object in it."""
    if isinstance(obj, dict) and all(isinstance(key, str) for key in obj):
        values = obj.values()
    elif isinstance(obj, list | tuple):
        values = obj
    else:
        return False
    return any(isinstance(value, CONTAINERS) for value in values)


def _joined(opening: str, items: list[str], separator: str, closing: str) -> list[str]:
    return [opening, separator.join(items), closing]

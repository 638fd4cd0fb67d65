"""The app's JSON writer: a big answer written a piece at a time, so that the router thread gets the GIL.

json.dumps writes in C and holds the GIL until it is done. An answer of a 1,900-token prompt's
prompt_logprobs (20 alternatives a position) is 2-3 MB of JSON: 40-60 ms in one call on a 2-core Xeon,
and every stream of the worker waited that long, as the router thread hands their tokens over while
holding the GIL. Here a long list is written an element at a time, each element in one C call (a long
list of numbers or strings, an embedding, a slice of them a call): Python runs between the calls, and
a thread waiting for the GIL gets it within the interpreter's switch interval (5 ms). The text is
json.dumps' own, to the byte.
"""

from __future__ import annotations

import json
from typing import Any

from flask.json.provider import DefaultJSONProvider

# A list longer than this is written an element at a time. Shorter ones, and whatever lies below a long
# list's elements, go to C whole: a call's overhead is a few microseconds, an element's writing tens.
LONG_LIST = 64
# A long list of numbers or strings is written this many a call: about 0.2 ms of floats.
SLICE = 1024
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
    """`encoder.encode(obj)`, its long lists an element a call."""
    return "".join(_pieces(obj, encoder, 0))


def _pieces(obj: Any, encoder: json.JSONEncoder, depth: int) -> list[str]:
    if isinstance(obj, list | tuple) and len(obj) > LONG_LIST and not _holds_containers(obj):
        # Numbers or strings (an embedding): a slice of them a call, whose brackets are the list's own
        slices = [encoder.encode(list(obj[i : i + SLICE]))[1:-1] for i in range(0, len(obj), SLICE)]
        return _joined("[", slices, encoder.item_separator, "]")
    if isinstance(obj, list | tuple) and len(obj) > LONG_LIST:
        return _joined("[", [encoder.encode(item) for item in obj], encoder.item_separator, "]")
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
    return any(isinstance(value, list | tuple | dict) for value in values)


def _joined(opening: str, items: list[str], separator: str, closing: str) -> list[str]:
    return [opening, separator.join(items), closing]

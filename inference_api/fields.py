"""Reading typed fields out of a parsed JSON body, with errors that name the field.

Each reader takes the body (a dict), a field name and a default, and returns
the value or raises InvalidParams(field, message), which the HTTP layer turns
into a 400. A field that is absent or null takes its default. Numbers may come
as numeric strings ("top_k": "40"), as in the original Falcon API's examples;
booleans are never numbers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from backend.messages import InvalidParams
from inference_api import json_text


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or InvalidParams("body", ...)."""
    try:
        # As json.loads reads bytes (UTF-8, -16 or -32; surrogates written raw pass), but with the text kept
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        data = json_text.loads(text)
    except ValueError as exc:  # UnicodeDecodeError is one
        raise InvalidParams("body", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidParams("body", f"the request body must be a JSON object, got {_kind(data)}")
    if ESCAPED_SURROGATE.search(text) or not _encodes(text):
        _check_unicode_within(data)
    return data


# JSON may carry lone surrogates ("\ud800", or their UTF-8 bytes), which no tokenizer, template or socket
# can encode. A body that has neither a surrogate's escape nor a raw surrogate holds none, and is not walked.
ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_unicode_within(data: dict[str, Any]) -> None:
    """InvalidParams naming the first string (key or value) in the body that holds a lone surrogate,
    wherever it is nested: a field read later would otherwise fail to encode with a 500."""
    unwalked: list[tuple[str, Any]] = [("", data)]
    while unwalked:  # a loop, not recursion: the body may nest as deep as the JSON reader allows
        path, value = unwalked.pop()
        if isinstance(value, str):
            _check_unicode(path, value)
        elif isinstance(value, list):  # reversed, so that items pop in the order written
            unwalked.extend((f"{path}[{index}]", item) for index, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if not _encodes(key):
                    where = path or "body"
                    message = (
                        f"{path or 'the request body'} has a key that is not valid Unicode ({LONE_SURROGATE})"
                    )
                    raise InvalidParams(where, message)
                unwalked.append((f"{path}.{key}" if path else key, item))


def read_string(
    data: dict[str, Any], name: str, *, required: bool = False, non_empty: bool = False
) -> str | None:
    value = data.get(name)
    if value is None:
        if required:
            raise InvalidParams(name, f"{name} is required")
        return None
    if not isinstance(value, str):
        raise InvalidParams(name, f"{name} must be a string, got {_kind(value)}")
    if non_empty and not value:
        raise InvalidParams(name, f"{name} must not be empty")
    return value


def read_number(
    data: dict[str, Any], name: str, default: float, low: float, high: float, *, low_open: bool = False
) -> float:
    """A finite number in [low, high], or (low, high] when low_open."""
    value = data.get(name)
    if value is None:
        return default
    number = _to_number(name, value)
    if not math.isfinite(number) or number > high or number < low or (low_open and number == low):
        bounds = f"over {low:g} and at most {high:g}" if low_open else f"from {low:g} to {high:g}"
        raise InvalidParams(name, f"{name} must be a number {bounds}, got {value!r}")
    return number


def read_integer(data: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return default
    integer = _to_integer(name, value)
    if not low <= integer <= high:
        raise InvalidParams(name, f"{name} must be an integer from {low} to {high}, got {value!r}")
    return integer


def read_bool(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParams(name, f"{name} must be a boolean (true or false), got {_kind(value)}")
    return value


def read_truncation_direction(data: dict[str, Any], name: str = "truncation_direction") -> str:
    """Text Embeddings Inference's `truncation_direction`: "right" (the default: an input cut from its end)
    or "left" (from its start), in either case ("Right" and "Left" as TEI spells them)."""
    direction = read_string(data, name) or "right"
    if direction.lower() not in ("right", "left"):
        raise InvalidParams(name, f'{name} must be "right" or "left", got {direction!r}')
    return direction.lower()


def read_stop(data: dict[str, Any], name: str, max_count: int = 4) -> tuple[str, ...]:
    """A string or a list of at most max_count non-empty strings."""
    value = data.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise InvalidParams(name, f"{name} must be a string or a list of strings, got {_kind(value)}")
    if len(items) > max_count:
        raise InvalidParams(name, f"{name} may hold at most {max_count} strings, got {len(items)}")
    if any(not item for item in items):
        raise InvalidParams(name, f"{name} must not contain an empty string")
    return tuple(items)


def read_object(data: dict[str, Any], name: str) -> dict[str, Any]:
    """A nested object (absent or null: an empty one), whose fields are read `within` its name."""
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParams(name, f"{name} must be an object, got {_kind(value)}")
    return value


@contextmanager
def within(name: str) -> Iterator[None]:
    """Errors of the fields read inside this block name them as fields of `name`
    ("sampling_params.max_tokens"): every reader's message starts with the field's name."""
    try:
        yield
    except InvalidParams as error:
        raise InvalidParams(f"{name}.{error.param}", f"{name}.{error}") from None


def _to_number(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise InvalidParams(name, f"{name} must be a number, got {_kind(value)}")


def _to_integer(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    if isinstance(value, (float, str)) and not isinstance(value, bool):
        # 40.0 and "40.0" are whole numbers, as JavaScript clients send them.
        number = _to_number(name, value)
        if number.is_integer():
            return int(number)
    raise InvalidParams(name, f"{name} must be an integer, got {_kind(value)}")


LONE_SURROGATE = "it holds a lone surrogate"


def _check_unicode(name: str, text: str) -> None:
    if not _encodes(text):
        raise InvalidParams(name, f"{name} is not valid Unicode ({LONE_SURROGATE})")


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__

"""OpenAI request fields this server does not implement: a 400 that names them, never a silent default.

A client that sends `response_format` or `tools` expects JSON or a tool
call; answering with free text as if the field were honoured would let it
believe it got what it asked for (SPEC §4.2). A field with a value that asks
for nothing (`tools: []`, `response_format: {"type": "text"}`, `best_of`
equal to `n`, checked where `n` is read, an empty `suffix`) is accepted. Fields that are accepted and
have no effect here (`user`, `metadata`, `store`, `service_tier`,
`parallel_tool_calls`, `reasoning_effort`) are listed in docs/frontend.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend.messages import InvalidParams

# field -> whether a value of it asks for something this server does not do
ASKS_FOR_MORE: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "response_format": lambda value, _: not (isinstance(value, dict) and value.get("type") == "text"),
    "tools": lambda value, _: value != [],
    "tool_choice": lambda value, _: value != "none",
    "functions": lambda value, _: value != [],
    "function_call": lambda value, _: value != "none",
    "audio": lambda value, _: True,
    "modalities": lambda value, _: value != ["text"],
    "prediction": lambda value, _: True,
    "web_search_options": lambda value, _: True,
    "suffix": lambda value, _: value != "",
}

# Fields each endpoint has in OpenAI's API; the rest of ASKS_FOR_MORE is not OpenAI's there and so
# ignored as any unknown field is (the legacy completions API has no tools, chat has no suffix).
ENDPOINT_FIELDS = {
    "completions": {"suffix"},  # and best_of other than n (openai_request.py)
    "chat": {
        "response_format",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
    },
}


def reject_unsupported(data: dict[str, Any], endpoint: str) -> None:
    """InvalidParams (a 400) for the first field of `endpoint` that asks for what is not built."""
    for name in sorted(ENDPOINT_FIELDS[endpoint]):
        value = data.get(name)
        if value is not None and ASKS_FOR_MORE[name](value, data):
            raise InvalidParams(name, f"{name} is not supported by this server; leave it out or null")

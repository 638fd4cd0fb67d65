"""OpenAI's Responses request (POST /v1/responses), served stateless: parsed and checked.

`instructions` and `input` (a string, or message items whose content is a
string or `input_text` / `output_text` parts) go through the model's chat
template as /v1/chat/completions renders messages. Nothing is stored, so
`store: true`, `previous_response_id` and `conversation` are 400s that say so
(unsupported_fields.py), rather than answers that could not be looked up later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import InvalidParams, SamplingParams
from inference_api.fields import read_bool, read_integer, read_number, read_string
from inference_api.prompts import (
    CHAT_DEFAULT_MAX_TOKENS,
    chat_ids,
    completion_budget,
    read_messages,
    text_content,
)
from inference_api.router import Serving
from inference_api.unsupported_fields import reject_unsupported

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class ResponsesRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echoed: dict[str, Any]  # what the response object repeats of the request


def parse_responses_request(data: dict[str, Any], serving: Serving) -> ResponsesRequest:
    reject_unsupported(data, "responses")
    instructions = read_string(data, "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    prompt_ids = chat_ids(system + _input(data.get("input")), serving, "input")
    max_output_tokens = read_integer(data, "max_output_tokens", None, 1, serving.backend.max_seq_len)
    params = SamplingParams(
        temperature=read_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=read_number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=completion_budget(
            serving, len(prompt_ids), max_output_tokens, CHAT_DEFAULT_MAX_TOKENS, "input"
        ),
    )
    metadata, user = data.get("metadata"), data.get("user")
    echoed = {
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "parallel_tool_calls": read_bool(data, "parallel_tool_calls", True),
        "metadata": metadata if isinstance(metadata, dict) else {},
        "user": user if isinstance(user, str) else None,
    }
    return ResponsesRequest(prompt_ids, params, read_bool(data, "stream", False), echoed)


def _input(value: Any) -> list[dict[str, str]]:
    """A string is one user message; a list holds message items (`type` "message" or left out)."""
    if isinstance(value, str):
        if not value:
            raise InvalidParams("input", "input must not be empty")
        return [{"role": "user", "content": text_content(value, "input")}]
    if isinstance(value, list):
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else "message"
            if kind != "message":
                message = f"input[{i}] is a {kind!r} item: this server takes message items only"
                raise InvalidParams(f"input[{i}].type", message)
    return read_messages(value, "input", ROLES, TEXT_PARTS)

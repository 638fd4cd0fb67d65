"""The Responses API's items: the input's as OpenAI chat's messages, and the output's, as a response lists
them.

Input: message items (a string content, or `input_text` / `output_text` parts); `function_call` items
(call_id, name, arguments as a JSON string; id and status are ignored) and `function_call_output` items
(call_id, output: a string or `input_text` parts). A run of function_call items, with the assistant
message right before them, is one assistant turn with `tool_calls`, as chat has it and chat templates
render it; each output is a `tool` message. A `reasoning` item (a reasoning model's thoughts, which
clients send back with the turn they led to) is that assistant turn's `reasoning_content`: its
`reasoning_text` parts (else its summary's texts, else its `encrypted_content` where this server wrote it:
`sealed_thoughts`), which the chat template keeps or drops; OpenAI's `encrypted_content` is ignored. Other
item types (item_reference, hosted tools' calls) are a 400 naming the item.

Output: a `reasoning` item with one `reasoning_text` part (and its `encrypted_content`, where the
request's `include` asks for it), if the model thought (reasoning.py); a message item with one
`output_text` part, if the model wrote text or made no call; then one `function_call` item per call.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any

from backend.messages import InvalidParams
from inference_api import json_text
from inference_api.prompts import read_messages, text_content

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = "message, reasoning, function_call and function_call_output"
# What a reasoning item's `encrypted_content` holds where `include: ["reasoning.encrypted_content"]` asks
# for it (Codex and other stateless agents always do): this server keeps nothing, so the thoughts
# themselves, in base64 behind this mark, for a client that sends the item back with that field alone.
# Not encrypted: the item's reasoning_text part, which the same client reads, holds the same text.
SEALED_MARK = "inference-server:thoughts:"


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The `input` as chat's messages: a string is one user message; a list holds items."""
    if isinstance(value, str):
        if not value:
            raise InvalidParams("input", "input must not be empty")
        return [{"role": "user", "content": text_content(value, "input")}]
    if not isinstance(value, list):
        return read_messages(value, "input")  # its 400: required, or not a list
    calls: set[str] = set()  # the call_ids so far, which an output must answer
    shaped = [_as_message(item, f"input[{i}]", calls) for i, item in enumerate(value)]
    # One message per item, so that read_messages' 400s name the item they are about.
    return _joined(read_messages(shaped, "input", (*ROLES, "tool"), TEXT_PARTS))


def _as_message(item: Any, param: str, calls: set[str]) -> Any:
    """One item as one chat message, checked in the Responses API's terms."""
    if not isinstance(item, dict):
        return item  # read_messages' 400
    kind = item.get("type") or "message"
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            roles = ", ".join(ROLES)
            raise InvalidParams(f"{param}.role", f"{param}.role must be one of {roles}, got {role!r}")
        return {"role": role, "content": item.get("content")}
    if kind == "function_call":
        call_id = _string(item, "call_id", param)
        calls.add(call_id)
        call = {"name": _string(item, "name", param), "arguments": _arguments(item, param)}
        return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "function": call}]}
    if kind == "function_call_output":
        call_id = _string(item, "call_id", param)
        if call_id not in calls:
            message = f"{param}.call_id {call_id!r} answers no function_call item before it in the input"
            raise InvalidParams(f"{param}.call_id", message)
        output = text_content(item.get("output"), f"{param}.output", ("input_text",))
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    if kind == "reasoning":  # thoughts alone, for now: joined to the assistant turn after them
        return {"role": "assistant", "content": None, "reasoning_content": _thoughts(item, param)}
    raise InvalidParams(f"{param}.type", f"{param} is a {kind!r} item: this server takes {ITEM_TYPES} items")


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidParams(f"{param}.{name}", f"{param}.{name} must be a non-empty string")
    return value


def _arguments(item: dict[str, Any], param: str) -> str:
    arguments = item.get("arguments")
    try:
        json_text.loads(arguments)
    except (TypeError, ValueError):
        raise InvalidParams(f"{param}.arguments", f"{param}.arguments must be a JSON string") from None
    return arguments


def _thoughts(item: dict[str, Any], param: str) -> str:
    """A reasoning item's thoughts: its reasoning_text parts, else its summary's summary_text parts, else
    its encrypted_content where this server sealed them into it (OpenAI's own: nothing to read)."""
    for field, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise InvalidParams(f"{param}.{field}", f"{param}.{field} must be a list of {part_type} parts")
        text = text_content(parts, f"{param}.{field}", (part_type,)) if parts else ""
        if text:
            return text
    return unsealed_thoughts(item.get("encrypted_content"), f"{param}.encrypted_content")


def sealed_thoughts(text: str) -> str:
    """The thoughts as a reasoning item's encrypted_content (SEALED_MARK)."""
    return SEALED_MARK + base64.b64encode(text.encode()).decode()


def unsealed_thoughts(value: Any, param: str) -> str:
    """The thoughts `sealed_thoughts` wrote; "" for an encrypted_content of another's (OpenAI's)."""
    if not isinstance(value, str) or not value.startswith(SEALED_MARK):
        return ""
    try:
        return base64.b64decode(value.removeprefix(SEALED_MARK), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        message = f"{param} is not as this server wrote it: send it back unchanged"
        raise InvalidParams(param, message) from None


def _thoughts_only(message: dict[str, Any]) -> bool:
    """A reasoning item's message, not yet joined to a turn."""
    alone = message["role"] == "assistant" and not message["content"] and "tool_calls" not in message
    return alone and "reasoning_content" in message


def _joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each reasoning item's thoughts joined to the assistant turn right after them, and each call to the
    assistant turn right before it (its text, or the calls before it). Thoughts that lead to no
    assistant turn are left out: a turn of thoughts alone is not one the template could render."""
    joined: list[dict[str, Any]] = []
    for message in messages:
        previous = joined[-1] if joined else None
        if previous is not None and _thoughts_only(previous) and message["role"] == "assistant":
            thoughts = previous["reasoning_content"] + message.get("reasoning_content", "")
            joined[-1] = {**message, "reasoning_content": thoughts}
        elif "tool_calls" in message and previous is not None and previous["role"] == "assistant":
            joined[-1] = {
                **previous,
                "content": previous["content"] + message["content"],
                "tool_calls": [*previous.get("tool_calls", []), *message["tool_calls"]],
            }
        else:
            joined.append(message)
    return [message for message in joined if not _thoughts_only(message)]


def message_item(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    """The answer's message item; `text` None: opened, no part yet."""
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, status: str, text: str | None, sealed: bool = False) -> dict[str, Any]:
    """The answer's thoughts as a reasoning item, whole (no summary); `text` None: opened, no part yet;
    `sealed`: with them as its encrypted_content too (`include: ["reasoning.encrypted_content"]`)."""
    content = [] if text is None else [reasoning_part(text)]
    item = {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}
    return item | {"encrypted_content": sealed_thoughts(text)} if sealed and text is not None else item


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    """A call of chat's shape ({id, type, function: {name, arguments}}) as a function_call item."""
    return {
        "id": "fc_" + uuid.uuid4().hex,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
    }

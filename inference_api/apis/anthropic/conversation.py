"""Anthropic's conversation (`system`, and `messages` with their content blocks) in OpenAI chat's shapes,
as the chat template and the tool helpers take them (prompts.tool_chat_ids).

A turn's content is a string or blocks: `text` blocks, joined; in an assistant turn `tool_use` blocks
({id, name, input}), the message's calls; in a user turn `tool_result` blocks ({tool_use_id, content,
is_error}), each a `tool` message answering its call, before the turn's text (Anthropic puts the
results first). An assistant turn's `thinking` blocks (a reasoning model's thoughts, which Anthropic's
clients send back in a tool-use loop) are its `reasoning_content`, which the chat template keeps or
drops; `redacted_thinking` blocks, encrypted by Anthropic's API, are dropped. Any other block (an
image, a document) is a 400 naming it: this server serves text. A last assistant message is a
prefill: its text follows the generation prompt and the answer goes on from it (Anthropic's clients
send one to steer the start of an answer).
"""

from __future__ import annotations

from typing import Any

from backend.messages import InvalidParams
from inference_api.prompts import text_content

ROLES = ("user", "assistant")
BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}


def read_conversation(system: Any, messages: Any) -> tuple[list[dict[str, Any]], str]:
    """The conversation as chat's messages ({role, content}, an assistant's `tool_calls`, a tool
    message's `tool_call_id`), and the prefill ("" if none)."""
    if messages is None:
        raise InvalidParams("messages", "messages is required")
    if not isinstance(messages, list) or not messages:
        raise InvalidParams("messages", "messages must be a non-empty list of {role, content} objects")
    system_text = text_content(system, "system")
    shaped = [{"role": "system", "content": system_text}] if system_text else []
    call_ids: set[str] = set()  # the tool_use ids so far, which a tool_result may answer
    for i, message in enumerate(messages):
        shaped += _turn(message, f"messages[{i}]", call_ids)
    if shaped[-1]["role"] != "assistant":
        return shaped, ""
    return shaped[:-1], _prefill(shaped[-1], messages[-1], f"messages[{len(messages) - 1}]")


def _turn(message: Any, param: str, call_ids: set[str]) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        raise InvalidParams(param, f"{param} must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidParams(f"{param}.role", f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content")
    if content is None and role != "assistant":  # only an assistant turn may be empty
        raise InvalidParams(f"{param}.content", f"{param}.content is required in a {role} message")
    if not isinstance(content, list):
        return [{"role": role, "content": text_content(content, f"{param}.content")}]
    blocks = [
        (f"{param}.content[{j}]", _block(block, f"{param}.content[{j}]", role))
        for j, block in enumerate(content)
    ]
    if role == "assistant":
        return [_assistant_turn(blocks, call_ids)]
    return _user_turn(blocks, call_ids)


def _assistant_turn(blocks: list[tuple[str, dict[str, Any]]], call_ids: set[str]) -> dict[str, Any]:
    """The turn's text, and its tool_use blocks as the calls of chat's assistant message."""
    calls = [_call(block, param) for param, block in blocks if block["type"] == "tool_use"]
    call_ids.update(call["id"] for call in calls)
    turn = {"role": "assistant", "content": _joined_text(blocks)}
    thoughts = "".join(block["thinking"] for _, block in blocks if block["type"] == "thinking")
    if thoughts:
        turn["reasoning_content"] = thoughts
    return {**turn, "tool_calls": calls} if calls else turn


def _user_turn(blocks: list[tuple[str, dict[str, Any]]], call_ids: set[str]) -> list[dict[str, Any]]:
    """A tool message per tool_result, then the turn's text (if any, or if there are no results)."""
    results = [_result(block, param, call_ids) for param, block in blocks if block["type"] == "tool_result"]
    if results and all(block["type"] == "tool_result" for _, block in blocks):
        return results
    return [*results, {"role": "user", "content": _joined_text(blocks)}]


def _joined_text(blocks: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(block["text"] for _, block in blocks if block["type"] == "text")


def _block(block: Any, param: str, role: str) -> dict[str, Any]:
    """A content block of a kind this role may send, its text checked."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in BLOCKS[role]:
        what = f"a block of type {kind!r}" if isinstance(kind, str) else "not a typed block"
        kinds = " and ".join(BLOCKS[role])
        raise InvalidParams(param, f"{param} is {what}: this server takes {kinds} blocks in {role} turns")
    if kind == "text":
        _text(block, param)
    if kind == "thinking" and not isinstance(block.get("thinking"), str):
        raise InvalidParams(f"{param}.thinking", f"{param}.thinking must be a string")
    return block


def _text(block: dict[str, Any], param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidParams(f"{param}.text", f"{param}.text must be a string")
    return text_content(block["text"], f"{param}.text")


def _call(block: dict[str, Any], param: str) -> dict[str, Any]:
    """A tool_use block as a call of chat's assistant message, its arguments the input object (as
    transformers' templates take them)."""
    for field in ("id", "name"):
        if not isinstance(block.get(field), str) or not block[field]:
            raise InvalidParams(f"{param}.{field}", f"{param}.{field} must be a non-empty string")
    if not isinstance(block.get("input"), dict):
        raise InvalidParams(f"{param}.input", f"{param}.input must be an object")
    function = {"name": block["name"], "arguments": block["input"]}
    return {"id": block["id"], "type": "function", "function": function}


def _result(block: dict[str, Any], param: str, call_ids: set[str]) -> dict[str, Any]:
    """A tool_result block as chat's tool message."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in call_ids:
        raise InvalidParams(
            f"{param}.tool_use_id",
            f"{param}.tool_use_id {call_id!r} names no tool_use of an assistant turn before it",
        )
    content = block.get("content")
    if isinstance(content, list):
        text = "".join(_result_text(part, f"{param}.content[{k}]") for k, part in enumerate(content))
    else:
        text = text_content(content, f"{param}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidParams(f"{param}.is_error", f"{param}.is_error must be a boolean (true or false)")
    # Chat's tool message has no error flag: the model reads that the call failed in the text itself.
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if is_error else text}


def _result_text(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text":
        what = f"a block of type {kind!r}" if isinstance(kind, str) else "not a typed block"
        raise InvalidParams(param, f"{param} is {what}: this server takes text blocks in a tool_result")
    return _text(part, param)


def _prefill(last: dict[str, Any], message: dict[str, Any], param: str) -> str:
    """The text a last assistant message gives the answer to go on from; a call there is a 400, since
    the answer would have to go on from a call that no tool_result answers."""
    if "tool_calls" in last:
        at = next(j for j, block in enumerate(message["content"]) if block["type"] == "tool_use")
        raise InvalidParams(
            f"{param}.content[{at}]",
            f"{param}.content[{at}] is a tool_use in the last message: a last assistant message is a prefill "
            "of text, and a tool_use is answered by a tool_result in a user message after it",
        )
    return last["content"]

"""Anthropic's Messages API: POST /v1/messages, as one Message or as Anthropic's stream of typed events,
and POST /v1/messages/count_tokens.

Shaped as Anthropic documents them, so that the official `anthropic` client
works unchanged, `messages.create`, `messages.stream` and `messages.count_tokens` alike. The answer's
content is a text block (left out when the answer is only tool calls), then a tool_use block per call;
streamed:

    message_start, ping,
    content_block_start (text), content_block_delta (text_delta)..., content_block_stop,
    for each call: content_block_start (tool_use, input {}), content_block_delta (input_json_delta),
        content_block_stop,
    message_delta (stop_reason, stop_sequence, usage), message_stop

each as `event: <type>` and `data: {...}`, the blocks numbered by `index`. A call is only known whole
when the answer ends (tool_calls.ToolCallReader holds its text back), so its input comes in one
input_json_delta. Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}`
(errors.py), mid-stream as an `error` event, which the client raises.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from inference_api.apis.anthropic.request import parse_messages_request, read_prompt
from inference_api.apis.anthropic.tools import tool_use_block
from inference_api.errors import anthropic_error
from inference_api.generation import (
    NO_EVENT,
    ApiFields,
    Generation,
    GenerationFailed,
    answering_model,
    event_stream,
    read_request,
    sse_event,
)

bp = Blueprint("anthropic_api", __name__)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
FIELDS = ApiFields(prompt_ids="messages", grammar="tools")  # the only grammar here is the tools'


@bp.post("/v1/messages")
def messages() -> Response:
    data, serving = read_request()
    parsed = parse_messages_request(data, serving)
    generation = Generation(parsed.prompt_ids, parsed.params, FIELDS, parsed.tools, parsed.thinking)
    message = Message(generation, answering_model(serving))
    if parsed.stream:
        return event_stream(message.events(), generation.close, generation.choices.waiting)
    return jsonify(message.whole())


@bp.post("/v1/messages/count_tokens")
def count_tokens() -> Response:
    """The prompt's tokens, as messages.create would count them in usage.input_tokens."""
    data, serving = read_request()
    return jsonify(input_tokens=len(read_prompt(data, serving).ids))


class Message:
    """One answer in Anthropic's shapes."""

    def __init__(self, generation: Generation, model: str):
        self.generation = generation
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model

    def whole(self) -> dict[str, Any]:
        text = self.generation.text()
        reasoning = self.generation.reasoning
        thinking = [_block("thinking", reasoning)] if reasoning else []
        calls = [tool_use_block(call) for call in self.generation.tool_calls]
        # A text block unless the answer is only calls (an empty answer keeps its empty text block).
        content = [_block("text", text)] if text or not calls else []
        return {**self._opening(thinking + content + calls), **self._ending()}

    def events(self) -> Iterator[bytes]:
        yield _event(
            "message_start", message={**self._opening([]), "stop_reason": None, "stop_sequence": None}
        )
        yield _event("ping")
        # Each block opens with its first delta: the thoughts' (if the model thought), then the text's,
        # so that an answer that is only calls has no text block.
        index, open_kind = 0, None
        try:
            for kind, text in self.generation.parts(marked=True):
                if not kind:
                    yield NO_EVENT
                    continue
                if kind != open_kind:
                    if open_kind is not None:
                        yield _event("content_block_stop", index=index)
                        index += 1
                    yield _event("content_block_start", index=index, content_block=_block(kind, ""))
                    open_kind = kind
                yield _event("content_block_delta", index=index, delta=_delta(kind, text))
        except GenerationFailed as error:
            # Too late for a status: Anthropic's clients raise on an error event.
            yield sse_event(anthropic_error(500, str(error)), "error")
            return
        calls = [tool_use_block(call) for call in self.generation.tool_calls]
        if open_kind != "text" and not calls:  # an answer of no text and no calls: an empty text block
            if open_kind is not None:
                yield _event("content_block_stop", index=index)
                index += 1
            yield _event("content_block_start", index=index, content_block=_block("text", ""))
            open_kind = "text"
        if open_kind is not None:
            yield _event("content_block_stop", index=index)
            index += 1
        for call_index, call in enumerate(calls, start=index):
            yield from _tool_use_events(call_index, call)
        ending = self._ending()
        delta = {"stop_reason": ending["stop_reason"], "stop_sequence": ending["stop_sequence"]}
        yield _event("message_delta", delta=delta, usage=ending["usage"])
        yield _event("message_stop")

    def _opening(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.generation.prompt_tokens, "output_tokens": 0},
        }

    def _ending(self) -> dict[str, Any]:
        generation = self.generation
        return {
            "stop_reason": _stop_reason(generation),
            "stop_sequence": generation.stop_sequence,
            "usage": {
                "input_tokens": generation.prompt_tokens,
                "output_tokens": generation.completion_tokens,
            },
        }


def _stop_reason(generation: Generation) -> str:
    """max_tokens for an answer it cut, calls and all (a cut call's input holds what was written whole);
    then the stop sequence that ended it; tool_use for an answer with calls; else end_turn."""
    if generation.finish_reason == "length":
        return "max_tokens"
    if generation.stop_sequence:
        return "stop_sequence"
    return "tool_use" if generation.tool_calls else STOP_REASONS[generation.finish_reason]


def _block(kind: str, text: str) -> dict[str, Any]:
    """A text block, or a thinking block: a reasoning model's thoughts. Its signature, which Anthropic's
    API signs the thoughts with so that they come back unaltered, is empty: this server signs nothing."""
    if kind == "text":
        return {"type": "text", "text": text}
    return {"type": "thinking", "thinking": text, "signature": ""}


def _delta(kind: str, text: str) -> dict[str, Any]:
    return (
        {"type": "text_delta", "text": text}
        if kind == "text"
        else {"type": "thinking_delta", "thinking": text}
    )


def _tool_use_events(index: int, block: dict[str, Any]) -> Iterator[bytes]:
    """A tool_use block as Anthropic streams one: opened with an empty input, then its input as JSON."""
    yield _event("content_block_start", index=index, content_block={**block, "input": {}})
    delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    yield _event("content_block_delta", index=index, delta=delta)
    yield _event("content_block_stop", index=index)


def _event(kind: str, **fields: Any) -> bytes:
    return sse_event({"type": kind, **fields}, kind)

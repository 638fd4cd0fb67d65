"""Anthropic's Messages API: POST /v1/messages, as one Message or as Anthropic's stream of typed events.

Shaped as Anthropic documents them, so that the official `anthropic` client
works unchanged, `messages.create` and `messages.stream` alike:

    message_start, content_block_start, ping, content_block_delta (text_delta)...,
    content_block_stop, message_delta (stop_reason, stop_sequence, usage), message_stop

each as `event: <type>` and `data: {...}`. Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}` (errors.py), mid-stream as an
`error` event, which the client raises.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from inference_api.apis.anthropic.request import parse_messages_request
from inference_api.errors import anthropic_error
from inference_api.generation import (
    ApiFields,
    Generation,
    GenerationFailed,
    event_stream,
    read_request,
    sse_event,
)

bp = Blueprint("anthropic_api", __name__)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
FIELDS = ApiFields(prompt_ids="messages")


@bp.post("/v1/messages")
def messages() -> Response:
    data, serving = read_request()
    messages_request = parse_messages_request(data, serving)
    generation = Generation(messages_request.prompt_ids, messages_request.params, FIELDS)
    message = Message(generation, serving.model_name)
    if messages_request.stream:
        return event_stream(message.events(), generation.close)
    return jsonify(message.whole())


class Message:
    """One answer in Anthropic's shapes."""

    def __init__(self, generation: Generation, model: str):
        self.generation = generation
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model

    def whole(self) -> dict[str, Any]:
        text = self.generation.text()
        return {**self._opening([{"type": "text", "text": text}]), **self._ending()}

    def events(self) -> Iterator[bytes]:
        generation = self.generation
        yield _event(
            "message_start", message={**self._opening([]), "stop_reason": None, "stop_sequence": None}
        )
        yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield _event("ping")
        try:
            for text in generation.deltas():
                yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})
        except GenerationFailed as error:
            # Too late for a status: Anthropic's clients raise on an error event.
            yield sse_event(anthropic_error(500, str(error)), "error")
            return
        yield _event("content_block_stop", index=0)
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
        stop_sequence = generation.stop_sequence
        return {
            "stop_reason": "stop_sequence" if stop_sequence else STOP_REASONS[generation.finish_reason],
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": generation.prompt_tokens,
                "output_tokens": generation.completion_tokens,
            },
        }


def _event(kind: str, **fields: Any) -> bytes:
    return sse_event({"type": kind, **fields}, kind)

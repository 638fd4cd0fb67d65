"""OpenAI's Responses API, stateless: POST /v1/responses, as one response object or as its typed events.

The answer is one message item holding one `output_text` part. Streamed, as
OpenAI's (`event: <type>` and `data: {..., "sequence_number": n}`):

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed (response.incomplete when max_output_tokens cut it)

A backend that fails mid-stream ends it with `response.failed`. Errors before
the stream are OpenAI's error shape, as on every path under /v1/.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from inference_api.apis.responses.request import ResponsesRequest, parse_responses_request
from inference_api.generation import (
    ApiFields,
    Generation,
    GenerationFailed,
    event_stream,
    read_request,
    sse_event,
)

bp = Blueprint("responses_api", __name__)
FIELDS = ApiFields(prompt_ids="input")


@bp.post("/v1/responses")
def responses() -> Response:
    data, serving = read_request()
    responses_request = parse_responses_request(data, serving)
    generation = Generation(responses_request.prompt_ids, responses_request.params, FIELDS)
    answer = ModelResponse(generation, serving.model_name, responses_request)
    if responses_request.stream:
        return event_stream(answer.events(), generation.close)
    return jsonify(answer.whole())


class ModelResponse:
    """One answer in the Responses API's shapes."""

    def __init__(self, generation: Generation, model: str, responses_request: ResponsesRequest):
        self.generation = generation
        self.model = model
        self.echoed = responses_request.echoed
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.sequence = itertools.count()

    @property
    def status(self) -> str:
        """completed, or incomplete when the answer was cut at max_output_tokens (or the context's end)."""
        return "incomplete" if self.generation.finish_reason == "length" else "completed"

    def whole(self) -> dict[str, Any]:
        text = self.generation.text()
        return self._response(self.status, [self._item(self.status, [_part(text)])], self._usage())

    def events(self) -> Iterator[bytes]:
        opened = self._response("in_progress", [])
        yield self._event("response.created", response=opened)
        yield self._event("response.in_progress", response=opened)
        yield self._event("response.output_item.added", output_index=0, item=self._item("in_progress", []))
        yield self._event("response.content_part.added", **self._place(), part=_part(""))
        texts = []
        try:
            for text in self.generation.deltas():
                texts.append(text)
                yield self._event("response.output_text.delta", **self._place(), delta=text, logprobs=[])
        except GenerationFailed as error:
            failed = self._response("failed", [], error={"code": "server_error", "message": str(error)})
            yield self._event("response.failed", response=failed)
            return
        text, status = "".join(texts), self.status
        yield self._event("response.output_text.done", **self._place(), text=text, logprobs=[])
        yield self._event("response.content_part.done", **self._place(), part=_part(text))
        item = self._item(status, [_part(text)])
        yield self._event("response.output_item.done", output_index=0, item=item)
        yield self._event(f"response.{status}", response=self._response(status, [item], self._usage()))

    def _event(self, kind: str, **fields: Any) -> bytes:
        return sse_event({"type": kind, "sequence_number": next(self.sequence), **fields}, kind)

    def _place(self) -> dict[str, Any]:
        """Where the text goes: the one part of the one message item."""
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _usage(self) -> dict[str, Any]:
        generation = self.generation
        return {
            "input_tokens": generation.prompt_tokens,
            # Prompt tokens the backend found in its cache (prefix reuse), as chat's cached_tokens.
            "input_tokens_details": {
                "cached_tokens": min(generation.cached_tokens, generation.prompt_tokens)
            },
            "output_tokens": generation.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        }

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echoed,
            # Stateless, text only, no tools: what the request could not have asked otherwise.
            "store": False,
            "previous_response_id": None,
            "reasoning": None,
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "truncation": "disabled",
        }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

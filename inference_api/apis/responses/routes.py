"""OpenAI's Responses API, stateless: POST /v1/responses, as one response object or as its typed events.

The answer is a reasoning item holding one `reasoning_text` part, if a reasoning model thought; a message
item holding one `output_text` part, if the model wrote text or made no call; then one `function_call`
item per tool call (items.py). Streamed, as OpenAI's (`event: <type>` and
`data: {..., "sequence_number": n}`):

    response.created, response.in_progress,
    the thoughts': response.output_item.added, response.content_part.added,
        response.reasoning_text.delta..., response.reasoning_text.done, response.content_part.done,
        response.output_item.done;
    the message's: response.output_item.added, response.content_part.added,
        response.output_text.delta..., response.output_text.done, response.content_part.done,
        response.output_item.done;
    each call's: response.output_item.added (arguments ""), response.function_call_arguments.delta,
        response.function_call_arguments.done, response.output_item.done;
    response.completed (response.incomplete when max_output_tokens cut it)

The thoughts' events begin with their first text, the message's with its. A call is read from the text
once the answer has ended (tool_calls.ToolCallReader), so its arguments come in one delta. A backend
that fails mid-stream ends the stream with `response.failed`. Errors before the stream are OpenAI's
error shape, as on every path under /v1/.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from inference_api.apis.responses.items import (
    call_item,
    message_item,
    reasoning_item,
    reasoning_part,
    text_part,
)
from inference_api.apis.responses.request import ResponsesRequest, parse_responses_request
from inference_api.generation import (
    NO_EVENT,
    Generation,
    GenerationFailed,
    answering_model,
    event_stream,
    read_request,
    sse_event,
)
from inference_api.reasoning import thought_tokens
from inference_api.tokenizer import PromptTokenizer

bp = Blueprint("responses_api", __name__)


@bp.post("/v1/responses")
def responses() -> Response:
    data, serving = read_request()
    asked = parse_responses_request(data, serving)
    generation = Generation(asked.prompt_ids, asked.params, asked.fields, asked.tools, asked.thinking)
    answer = ModelResponse(generation, answering_model(serving), asked, serving.tokenizer)
    if asked.stream:
        return event_stream(answer.events(), generation.close, generation.choices.waiting)
    return jsonify(answer.whole())


class ModelResponse:
    """One answer in the Responses API's shapes."""

    def __init__(
        self,
        generation: Generation,
        model: str,
        responses_request: ResponsesRequest,
        tokenizer: PromptTokenizer,
    ):
        self.generation = generation
        self.model = model
        self.tokenizer = tokenizer  # counts the thoughts' tokens
        self.echoed = responses_request.echoed
        self.sealed_thoughts = responses_request.sealed_thoughts
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.sequence = itertools.count()

    @property
    def status(self) -> str:
        """completed, or incomplete when the answer was cut at max_output_tokens (or the context's end)."""
        return "incomplete" if self.generation.finish_reason == "length" else "completed"

    def whole(self) -> dict[str, Any]:
        text = self.generation.text()
        calls = self._calls()
        thoughts = self._thoughts_item(text, calls)
        message = [message_item(self.item_id, self._message_status(calls), text)] if text or not calls else []
        return self._response(self.status, thoughts + message + calls, self._usage())

    def events(self) -> Iterator[bytes]:
        opened = self._response("in_progress", [])
        yield self._event("response.created", response=opened)
        yield self._event("response.in_progress", response=opened)
        thinking, texts = False, []
        try:
            for kind, text in self.generation.parts(marked=True):
                if not kind:
                    yield NO_EVENT
                    continue
                if kind == "reasoning":
                    if not thinking:
                        yield from self._open_thoughts()
                        thinking = True
                    yield self._event("response.reasoning_text.delta", **self._thoughts_place(), delta=text)
                    continue
                if not texts:
                    if thinking:  # the answer begins: the thoughts are whole
                        yield from self._close_thoughts(self._thoughts_item(text, [])[0])
                    yield from self._open_message()
                texts.append(text)
                yield self._event("response.output_text.delta", **self._place(), delta=text, logprobs=[])
        except GenerationFailed as error:
            failed = self._response("failed", [], error={"code": "server_error", "message": str(error)})
            yield self._event("response.failed", response=failed)
            return
        calls = self._calls()
        output = self._thoughts_item("".join(texts), calls)
        if thinking and not texts:  # the thoughts' item is still open
            yield from self._close_thoughts(output[0])
        if texts or not calls:  # an answer of calls only has no message item
            if not texts:
                yield from self._open_message()
            output.append(message_item(self.item_id, self._message_status(calls), "".join(texts)))
            yield from self._close_message(output[-1])
        for item in calls:
            yield from self._call_events(item, len(output))
            output.append(item)
        status = self.status
        yield self._event(f"response.{status}", response=self._response(status, output, self._usage()))

    def _calls(self) -> list[dict[str, Any]]:
        """The answer's calls as function_call items, once it has ended: a call max_output_tokens cut (the
        last one) is incomplete, with the arguments written so far."""
        calls = self.generation.tool_calls
        last = len(calls) - 1
        return [call_item(call, self.status if i == last else "completed") for i, call in enumerate(calls)]

    def _message_status(self, calls: list[dict[str, Any]]) -> str:
        """The message is what max_output_tokens cut unless calls came after it."""
        return "completed" if calls else self.status

    def _thoughts_item(self, text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The thoughts as the first item, if the model thought: what max_output_tokens cut if nothing
        came after them."""
        reasoning = self.generation.reasoning
        if not reasoning:
            return []
        status = "completed" if text or calls else self.status
        return [reasoning_item(self.reasoning_id, status, reasoning, self.sealed_thoughts)]

    def _open_thoughts(self) -> Iterator[bytes]:
        item = reasoning_item(self.reasoning_id, "in_progress", None)
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event("response.content_part.added", **self._thoughts_place(), part=reasoning_part(""))

    def _close_thoughts(self, item: dict[str, Any]) -> Iterator[bytes]:
        [part] = item["content"]
        yield self._event("response.reasoning_text.done", **self._thoughts_place(), text=part["text"])
        yield self._event("response.content_part.done", **self._thoughts_place(), part=part)
        yield self._event("response.output_item.done", output_index=0, item=item)

    @property
    def message_index(self) -> int:
        """The message item's place in the output: after the thoughts' item, if the model thought (they
        come whole before any text)."""
        return 1 if self.generation.reasoning else 0

    def _open_message(self) -> Iterator[bytes]:
        item = message_item(self.item_id, "in_progress", None)
        yield self._event("response.output_item.added", output_index=self.message_index, item=item)
        yield self._event("response.content_part.added", **self._place(), part=text_part(""))

    def _close_message(self, item: dict[str, Any]) -> Iterator[bytes]:
        [part] = item["content"]
        yield self._event("response.output_text.done", **self._place(), text=part["text"], logprobs=[])
        yield self._event("response.content_part.done", **self._place(), part=part)
        yield self._event("response.output_item.done", output_index=self.message_index, item=item)

    def _call_events(self, item: dict[str, Any], index: int) -> Iterator[bytes]:
        place = {"item_id": item["id"], "output_index": index}
        added = {**item, "status": "in_progress", "arguments": ""}
        yield self._event("response.output_item.added", output_index=index, item=added)
        if item["arguments"]:
            yield self._event("response.function_call_arguments.delta", **place, delta=item["arguments"])
        yield self._event(
            "response.function_call_arguments.done", **place, arguments=item["arguments"], name=item["name"]
        )
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _event(self, kind: str, **fields: Any) -> bytes:
        return sse_event({"type": kind, "sequence_number": next(self.sequence), **fields}, kind)

    def _place(self) -> dict[str, Any]:
        """Where the text goes: the one part of the message item."""
        return {"item_id": self.item_id, "output_index": self.message_index, "content_index": 0}

    def _thoughts_place(self) -> dict[str, Any]:
        """Where the thoughts go: the one part of the reasoning item, the first item."""
        return {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}

    def _usage(self) -> dict[str, Any]:
        generation = self.generation
        return {
            "input_tokens": generation.prompt_tokens,
            # Prompt tokens the backend found in its cache (prefix reuse), as chat's cached_tokens.
            "input_tokens_details": {
                "cached_tokens": min(generation.cached_tokens, generation.prompt_tokens)
            },
            "output_tokens": generation.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        }

    def _reasoning_tokens(self) -> int:
        """The thoughts' tokens (reasoning.thought_tokens), within the answer's."""
        return min(
            thought_tokens(self.generation.reasoning, self.tokenizer), self.generation.completion_tokens
        )

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
            # Stateless: what the request could not have asked otherwise.
            "store": False,
            "previous_response_id": None,
            "truncation": "disabled",
        }

"""Llama Stack's inference API: completion and chat completion, answered whole or streamed, and embeddings.

    POST /inference/completion, /inference/chat_completion        (its first releases' routes)
    POST /v1/inference/completion, /v1/inference/chat-completion  (its later releases')
    POST /inference/embeddings, /v1/inference/embeddings

Shaped as Llama Stack publishes them. A completion answers `{"content",
"stop_reason"}` and streams `data: {"delta": text, "stop_reason": null}`
events, the last with the stop reason; a chat completion answers
`{"completion_message": {"role", "content", "stop_reason", "tool_calls"}}`
and streams `data: {"event": {"event_type": "start" | "progress" |
"complete", "delta": {"type": "text", "text"}, "stop_reason"}}`. The stop
reason is `end_of_turn` (an EOS token or a stop sequence) or `out_of_tokens`
(max_tokens); the token counts come as Llama Stack's `metrics` (prompt_tokens,
completion_tokens, total_tokens) with the answer or the last event. Errors are
`{"detail": message}` (errors.py), mid-stream `data: {"error": {"message"}}`,
as Llama Stack's own server sends them. Embeddings answer `{"embeddings":
[[float, ...], ...]}`, one vector per content, by /v1/embeddings' machinery
(embedder.py). Its client's OpenAI-compatible routes (/v1/openai/v1/...) and
its model fields in /v1/models are the OpenAI API's (app.py, apis/openai).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from inference_api.apis.llama_stack.request import (
    LlamaStackRequest,
    model_field,
    parse_chat_completion,
    parse_completion,
    parse_embeddings,
)
from inference_api.embedder import embed
from inference_api.generation import (
    EMBEDDINGS,
    NO_EVENT,
    ApiFields,
    Generation,
    GenerationFailed,
    check_model,
    event_stream,
    read_request,
    sse_event,
)
from inference_api.router import Serving

bp = Blueprint("llama_stack_api", __name__)

STOP_REASONS = {"stop": "end_of_turn", "length": "out_of_tokens"}
EMBEDDING_FIELDS = ApiFields(prompt_ids="contents", count="contents")


@bp.post("/inference/completion")
@bp.post("/v1/inference/completion")
def completion() -> Response:
    return _answer(parse_completion, Completion())


@bp.post("/inference/chat_completion")
@bp.post("/v1/inference/chat-completion")
def chat_completion() -> Response:
    return _answer(parse_chat_completion, ChatCompletion())


@bp.post("/inference/embeddings")
@bp.post("/v1/inference/embeddings")
def embeddings() -> Response:
    data, serving = read_request(model_field=None)
    check_model(data, serving, model_field(data), endpoint=EMBEDDINGS)
    vectors = embed(parse_embeddings(data, serving), EMBEDDING_FIELDS)
    return jsonify(embeddings=[list(vector) for vector in vectors])


class Completion:
    """The shapes of a completion."""

    fields = ApiFields(prompt_ids="content")

    def whole(self, text: str, ending: dict[str, Any]) -> dict[str, Any]:
        return {"content": text, **ending, "logprobs": None}

    def opening(self) -> Iterator[dict[str, Any]]:
        return iter(())

    def delta(self, text: str) -> dict[str, Any]:
        return {"delta": text, "stop_reason": None, "logprobs": None}

    def end(self, ending: dict[str, Any]) -> dict[str, Any]:
        return {"delta": "", **ending, "logprobs": None}


class ChatCompletion:
    """The shapes of a chat completion."""

    fields = ApiFields(prompt_ids="messages")

    def whole(self, text: str, ending: dict[str, Any]) -> dict[str, Any]:
        message = {
            "role": "assistant",
            "content": text,
            "stop_reason": ending["stop_reason"],
            "tool_calls": [],
        }
        return {"completion_message": message, "logprobs": None, "metrics": ending["metrics"]}

    def opening(self) -> Iterator[dict[str, Any]]:
        yield _chat_event("start", "")

    def delta(self, text: str) -> dict[str, Any]:
        return _chat_event("progress", text)

    def end(self, ending: dict[str, Any]) -> dict[str, Any]:
        return {**_chat_event("complete", "", ending["stop_reason"]), "metrics": ending["metrics"]}


def _chat_event(kind: str, text: str, stop_reason: str | None = None) -> dict[str, Any]:
    delta = {"type": "text", "text": text}
    return {"event": {"event_type": kind, "delta": delta, "logprobs": None, "stop_reason": stop_reason}}


def _answer(
    parse: Callable[[dict[str, Any], Serving], LlamaStackRequest], api: Completion | ChatCompletion
) -> Response:
    data, serving = read_request(model_field=None)
    check_model(data, serving, model_field(data))
    asked = parse(data, serving)
    generation = Generation(asked.prompt_ids, asked.params, api.fields, thinking=asked.thinking)
    if asked.stream:
        return event_stream(_events(api, generation), generation.close, generation.choices.waiting)
    text = generation.text()
    return jsonify(api.whole(text, _ending(generation)))


def _events(api: Completion | ChatCompletion, generation: Generation) -> Iterator[bytes]:
    for event in api.opening():
        yield sse_event(event)
    try:
        for text in generation.deltas(marked=True):
            yield sse_event(api.delta(text)) if text else NO_EVENT
    except GenerationFailed as error:
        yield sse_event({"error": {"message": str(error)}})
        return
    yield sse_event(api.end(_ending(generation)))


def _ending(generation: Generation) -> dict[str, Any]:
    """Why the answer ended, and its token counts as Llama Stack's metrics."""
    counts = {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }
    metrics = [{"metric": name, "value": value, "unit": "tokens"} for name, value in counts.items()]
    return {"stop_reason": STOP_REASONS[generation.finish_reason], "metrics": metrics}

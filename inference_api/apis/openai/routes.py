"""The OpenAI-compatible API (SPEC §4.2): /v1/models, /v1/completions, /v1/chat/completions.

Responses follow OpenAI's documented shapes closely enough that the official
`openai` client works unchanged, streaming (SSE, ending with `data: [DONE]`)
and not. Each choice is its own request in its own row.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from backend.messages import Piece
from inference_api.apis.openai.logprobs import ChatLogprobs, CompletionLogprobs
from inference_api.apis.openai.request import OpenAIRequest, parse_chat_request, parse_completion_request
from inference_api.choices import Choices
from inference_api.generation import (
    ApiFields,
    error_of,
    event_stream,
    read_request,
    serving_now,
    sse_event,
    start_choices,
)
from inference_api.router import Serving
from inference_api.tool_calls import ToolCallReader

bp = Blueprint("openai_api", __name__, url_prefix="/v1")
STARTED = int(time.time())


@bp.get("/models")
def models() -> Response:
    """The model once under each served name (vLLM's --served-model-name), the one responses report first."""
    serving = serving_now()
    models = [
        {
            "id": name,
            "object": "model",
            "created": STARTED,
            "owned_by": "inference-server",
            "root": serving.backend.model_name,
            "max_model_len": serving.backend.max_seq_len,
        }
        for name in serving.served_names
    ]
    embedding = serving.backend.embedding_model
    if embedding is not None:  # --embedding-model, for /v1/embeddings only; max_model_len: an input's tokens
        models.append(
            {
                "id": embedding.name,
                "object": "model",
                "created": STARTED,
                "owned_by": "inference-server",
                "root": embedding.name,
                "max_model_len": embedding.max_tokens,
            }
        )
    return jsonify(object="list", data=models)


@bp.post("/completions")
def completions() -> Response:
    return _answer(Completion())


@bp.post("/chat/completions")
def chat_completions() -> Response:
    return _answer(ChatCompletion())


class Completion:
    """The shapes of /v1/completions."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def parse(self, data: dict[str, Any], serving: Serving) -> OpenAIRequest:
        return parse_completion_request(data, serving)

    def logprobs(self, openai_request: OpenAIRequest, serving: Serving, index: int) -> CompletionLogprobs:
        prompt = openai_request.prompts[index // openai_request.n]
        return CompletionLogprobs(serving.tokenizer, prompt if openai_request.echo else None)

    def opening(self, index: int) -> dict[str, Any] | None:
        return None

    def choice(
        self, index: int, text: str, finish_reason: str, logprobs: Any = None, tool_calls: list | None = None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Any = None,
        tool_calls: list | None = None,
    ) -> dict[str, Any]:
        return self.choice(index, text, finish_reason, logprobs)  # a chunk's choice is a whole one's


class ChatCompletion:
    """The shapes of /v1/chat/completions."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def parse(self, data: dict[str, Any], serving: Serving) -> OpenAIRequest:
        return parse_chat_request(data, serving)

    def logprobs(self, openai_request: OpenAIRequest, serving: Serving, index: int) -> ChatLogprobs:
        return ChatLogprobs(serving.tokenizer)

    def opening(self, index: int) -> dict[str, Any] | None:
        """The first chunk of each choice names the role, as OpenAI's do."""
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def choice(
        self, index: int, text: str, finish_reason: str, logprobs: Any = None, tool_calls: list | None = None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:  # as OpenAI's: content null unless the model also wrote text
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            finish_reason = calls_finish_reason(finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Any = None,
        tool_calls: list | None = None,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if tool_calls:  # each whole, in one chunk, with its index among the calls
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            finish_reason = calls_finish_reason(finish_reason)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


class ChoiceOutput:
    """What one choice adds to the response at each piece: its text (the echoed prompt before the
    first), and its logprobs entries in the endpoint's shape when the request asked for them."""

    def __init__(
        self, api: Completion | ChatCompletion, openai_request: OpenAIRequest, serving: Serving, index: int
    ):
        self.echo = openai_request.prompt_texts[index // openai_request.n] if openai_request.echo else ""
        self.writer = api.logprobs(openai_request, serving, index) if openai_request.logprobs else None
        self.tools = ToolCallReader(openai_request.tools) if openai_request.tools else None
        self.tool_calls: list[dict[str, Any]] = []  # set at the last piece

    def text(self, piece: Piece) -> str:
        """The content this piece adds (with tools, text that may be a call is held back until the end,
        then `tool_calls` holds the calls it was)."""
        text, self.echo = self.echo + piece.text, ""
        if self.tools is None:
            return text
        text = self.tools.feed(text)
        if piece.finished:
            rest, self.tool_calls = self.tools.finish()
            text += rest
        return text

    def entries(self, piece: Piece) -> tuple:
        return (*(piece.prompt_logprobs or ()), *piece.logprobs)

    def logprobs(self, entries: tuple) -> dict[str, Any] | None:
        return None if self.writer is None else self.writer.shape(entries)


def _answer(api: Completion | ChatCompletion) -> Response:
    data, serving = read_request()
    openai_request = api.parse(data, serving)
    fields = api_fields(openai_request)
    choices, pieces = start_choices(openai_request.choice_requests(), openai_request.cache_salt, fields)
    response_id = api.id_prefix + uuid.uuid4().hex
    usage = Usage(openai_request, choices)
    if openai_request.stream:
        events = _events(api, response_id, serving, openai_request, choices, pieces, usage, fields)
        return event_stream(events, choices.close)
    return _whole(api, response_id, serving, openai_request, choices, pieces, usage, fields)


def api_fields(openai_request: OpenAIRequest) -> ApiFields:
    """The request's fields for the 400s: its prompt's and grammar's, and what makes its many choices (n,
    or the prompt's list when n is 1)."""
    many_prompts = openai_request.n == 1 and len(openai_request.prompts) > 1
    return ApiFields(
        prompt_ids=openai_request.prompt_param,
        grammar=openai_request.grammar_param,
        count=openai_request.prompt_param if many_prompts else "n",
    )


class Usage:
    """Prompt tokens once per prompt (however many choices), completion tokens of every choice."""

    def __init__(self, openai_request: OpenAIRequest, choices: Choices):
        self.prompt_tokens = sum(len(ids) for ids in openai_request.prompts)
        self.choices = choices

    def as_dict(self) -> dict[str, Any]:
        completion = self.choices.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            # As OpenAI counts them: prompt tokens served from the cache (prefix reuse). With n > 1,
            # each choice of a prompt is its own request, the first to arrive computes the prefix.
            "prompt_tokens_details": {"cached_tokens": min(self.choices.cached_tokens, self.prompt_tokens)},
        }


def _whole(
    api: Completion | ChatCompletion,
    response_id: str,
    serving: Serving,
    openai_request: OpenAIRequest,
    choices: Choices,
    pieces: Iterator[tuple[int, Piece]],
    usage: Usage,
    fields: ApiFields,
) -> Response:
    outputs = [ChoiceOutput(api, openai_request, serving, i) for i in range(len(choices.streams))]
    texts: list[list[str]] = [[] for _ in choices.streams]
    entries: list[list] = [[] for _ in choices.streams]
    finish_reasons: list[str | None] = [None] * len(choices.streams)
    try:
        for index, piece in pieces:
            if piece.finish_reason == "error":  # a later choice's: no status has gone out yet
                raise error_of(piece, fields)
            texts[index].append(outputs[index].text(piece))
            entries[index] += outputs[index].entries(piece)
            finish_reasons[index] = piece.finish_reason
    finally:
        choices.close()
    return jsonify(
        id=response_id,
        object=api.object,
        created=int(time.time()),
        model=serving.model_name,
        choices=[
            api.choice(
                i,
                "".join(parts),
                finish_reasons[i],
                outputs[i].logprobs(tuple(entries[i])),
                outputs[i].tool_calls,
            )
            for i, parts in enumerate(texts)
        ],
        usage=usage.as_dict(),
    )


def _events(
    api: Completion | ChatCompletion,
    response_id: str,
    serving: Serving,
    openai_request: OpenAIRequest,
    choices: Choices,
    pieces: Iterator[tuple[int, Piece]],
    usage: Usage,
    fields: ApiFields,
) -> Iterator[bytes]:
    """Server-sent events: a chunk per piece, the usage chunk if asked for, then [DONE]."""
    created = int(time.time())
    extra = {"usage": None} if openai_request.include_usage else {}

    def chunk(choice_list: list[dict[str, Any]], **fields: Any) -> bytes:
        body = {
            "id": response_id,
            "object": api.chunk_object,
            "created": created,
            "model": serving.model_name,
            "choices": choice_list,
            **extra,
            **fields,
        }
        return sse_event(body)

    outputs = [ChoiceOutput(api, openai_request, serving, i) for i in range(len(choices.streams))]
    try:
        for index in range(len(choices.streams)):
            opening = api.opening(index)
            if opening is not None:
                yield chunk([opening])
        for index, piece in pieces:
            if piece.finish_reason == "error":
                # Too late for a status: OpenAI's clients raise on an error event.
                failed = error_of(piece, fields)
                kind = "invalid_request_error" if failed.status < 500 else "server_error"
                yield sse_event({"error": {"message": failed.message, "type": kind, "param": failed.param}})
                return
            text, entries = outputs[index].text(piece), outputs[index].entries(piece)
            if text or entries or piece.finished:
                logprobs = outputs[index].logprobs(entries)
                calls = outputs[index].tool_calls
                yield chunk([api.delta(index, text, piece.finish_reason, logprobs, calls)])
        if openai_request.include_usage:
            yield chunk([], usage=usage.as_dict())
        yield b"data: [DONE]\n\n"
    finally:
        choices.close()


def calls_finish_reason(finish_reason: str | None) -> str:
    """An answer that is tool calls ends with `tool_calls`, or, cut by max_tokens, `length` (as OpenAI's)."""
    return "length" if finish_reason == "length" else "tool_calls"

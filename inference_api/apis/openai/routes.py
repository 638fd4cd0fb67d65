"""The OpenAI-compatible API (SPEC §4.2): /v1/models, /v1/completions, /v1/chat/completions.

Responses follow OpenAI's documented shapes closely enough that the official
`openai` client works unchanged, streaming (SSE, ending with `data: [DONE]`)
and not. Each choice is its own request in its own row.

Llama Stack's client reads this API too: a model entry also has the fields of
its `Model` (`identifier`, `model_type`, ...), and its OpenAI-compatible routes
(/v1/openai/v1/...) are these same handlers (app.py), whose streams end there
without `data: [DONE]`, as Llama Stack's server ends them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, Response, jsonify, request

from backend.messages import Piece
from inference_api.answers import answer_reader
from inference_api.apis.openai.logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprobs, TokenNames
from inference_api.apis.openai.request import OpenAIRequest, parse_chat_request, parse_completion_request
from inference_api.choices import Choices
from inference_api.errors import ApiError
from inference_api.generation import (
    NO_EVENT,
    ApiFields,
    answering_model,
    error_of,
    event_stream,
    read_request,
    serving_now,
    sse_event,
    start_choices,
    unknown_model,
)
from inference_api.reasoning import thought_tokens
from inference_api.router import Serving

bp = Blueprint("openai_api", __name__, url_prefix="/v1")
STARTED = int(time.time())
OWNER = "inference-server"
LLAMA_STACK_PREFIX = "/v1/openai/v1"  # where Llama Stack's client calls this API (app.py serves it there too)
DONE = b"data: [DONE]\n\n"


@bp.get("/models")
def models() -> Response:
    """The model once under each served name (vLLM's --served-model-name), the one responses report first,
    then the --embedding-model, for /v1/embeddings only, and the --rerank-model, for /v1/rerank only."""
    return jsonify(object="list", data=_models(serving_now()))


@bp.get("/models/<path:model>")
def retrieve_model(model: str) -> Response:
    """One entry of /v1/models (the OpenAI client's models.retrieve, Llama Stack's client's too)."""
    serving = serving_now()
    for entry in _models(serving):
        if entry["id"] == model:
            return jsonify(entry)
    message = unknown_model(model, serving)
    raise ApiError(404, message, param="model", code="model_not_found")


def _models(serving: Serving) -> list[dict[str, Any]]:
    backend = serving.backend
    models = [_model(name, backend.model_name, backend.max_seq_len, "llm") for name in serving.served_names]
    for adapter in backend.adapters:  # vLLM's entry of a LoRA adapter: its parent the model it changes
        models.append(_model(adapter, adapter, backend.max_seq_len, "llm") | {"parent": serving.model_name})
    embedding = backend.embedding_model
    if embedding is not None:  # max_model_len: an input's tokens
        models.append(_model(embedding.name, embedding.name, embedding.max_tokens, "embedding"))
    rerank = backend.rerank_model
    if rerank is not None:  # max_model_len: a query's and a document's tokens together
        models.append(_model(rerank.name, rerank.name, rerank.max_tokens, "rerank"))
    return models


def _model(name: str, root: str, max_model_len: int, model_type: str) -> dict[str, Any]:
    """OpenAI's model object (with vLLM's root and max_model_len), and what Llama Stack's client reads
    of one: an identifier, its type (an llm, an embedding or a rerank model), the provider and its name
    for it."""
    return {
        "id": name,
        "object": "model",
        "created": STARTED,
        "owned_by": OWNER,
        "root": root,
        "max_model_len": max_model_len,
        "identifier": name,
        "model_type": model_type,
        "provider_id": OWNER,
        "provider_resource_id": root,
        "type": "model",
        "metadata": {},
    }


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
        names = TokenNames(serving.tokenizer, openai_request.tokens_as_ids)
        echoed = prompt if openai_request.echo else None
        return CompletionLogprobs(names, openai_request.params.logprobs, echoed)

    def opening(self, index: int) -> dict[str, Any] | None:
        return None

    def choice(self, index: int, output: Output, finish_reason: str) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": output.content,
            "logprobs": output.logprobs,
            "finish_reason": finish_reason,
            "stop_reason": output.stop_reason,
        }
        if output.prompt_logprobs is not None:  # vLLM's, on each choice of a completion
            choice["prompt_logprobs"] = output.prompt_logprobs
        if output.token_ids is not None:  # vLLM's return_token_ids (the prompt's: in a stream's first chunk)
            choice |= {"prompt_token_ids": output.prompt_token_ids, "token_ids": output.token_ids}
        return choice

    def delta(self, index: int, output: Output, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(index, output, finish_reason)  # a chunk's choice is a whole one's

    def response_fields(self, outputs: list[Output]) -> dict[str, Any]:
        return {}

    def opening_fields(self, output: ChoiceOutput) -> dict[str, Any]:
        return {}


class ChatCompletion:
    """The shapes of /v1/chat/completions."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def parse(self, data: dict[str, Any], serving: Serving) -> OpenAIRequest:
        return parse_chat_request(data, serving)

    def logprobs(self, openai_request: OpenAIRequest, serving: Serving, index: int) -> ChatLogprobs:
        return ChatLogprobs(TokenNames(serving.tokenizer, openai_request.tokens_as_ids))

    def opening(self, index: int) -> dict[str, Any] | None:
        """The first chunk of each choice names the role, as OpenAI's do."""
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def choice(self, index: int, output: Output, finish_reason: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": output.content}
        if output.reasoning:  # vLLM's and llama.cpp's field for a reasoning model's thoughts
            message["reasoning_content"] = output.reasoning
        if output.tool_calls:  # as OpenAI's: content null unless the model also wrote text
            message |= {"content": output.content or None, "tool_calls": output.tool_calls}
            finish_reason = calls_finish_reason(finish_reason)
        choice = {
            "index": index,
            "message": message,
            "logprobs": output.logprobs,
            "finish_reason": finish_reason,
            "stop_reason": output.stop_reason,
        }
        return choice if output.token_ids is None else {**choice, "token_ids": output.token_ids}

    def response_fields(self, outputs: list[Output]) -> dict[str, Any]:
        """vLLM gives a chat's prompt_logprobs and prompt_token_ids once, beside the choices (every choice
        has one prompt)."""
        first = outputs[0] if outputs else Output()
        fields = {"prompt_logprobs": first.prompt_logprobs, "prompt_token_ids": first.prompt_token_ids}
        return {name: value for name, value in fields.items() if value is not None}

    def opening_fields(self, output: ChoiceOutput) -> dict[str, Any]:
        """A stream's prompt_token_ids, as vLLM's, on the chunk that opens a choice."""
        prompt_ids = output.prompt_ids_once()
        return {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}

    def delta(self, index: int, output: Output, finish_reason: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {"reasoning_content": output.reasoning} if output.reasoning else {}
        if output.content:
            delta["content"] = output.content
        if output.tool_calls:  # each whole, in one chunk, with its index among the calls
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(output.tool_calls)]
            finish_reason = calls_finish_reason(finish_reason)
        chunk = {
            "index": index,
            "delta": delta,
            "logprobs": output.logprobs,
            "finish_reason": finish_reason,
            "stop_reason": output.stop_reason,
        }
        return chunk if output.token_ids is None else {**chunk, "token_ids": output.token_ids}


@dataclass(frozen=True)
class Output:
    """What a choice gives, whole or in a chunk: its thoughts (a reasoning model's), its content, its
    logprobs in the endpoint's shape (None unless asked for), and its tool calls (at the end)."""

    reasoning: str = ""
    content: str = ""
    logprobs: Any = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token that ended it, at the end
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked for (never streamed)
    # vLLM's return_token_ids: the generated tokens' ids (None: not asked for), and the prompt's
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChoiceOutput:
    """What one choice adds to the response at each piece: its text (the echoed prompt before the
    first), and its logprobs entries in the endpoint's shape when the request asked for them."""

    def __init__(
        self, api: Completion | ChatCompletion, openai_request: OpenAIRequest, serving: Serving, index: int
    ):
        self.echo = openai_request.prompt_texts[index // openai_request.n] if openai_request.echo else ""
        self.writer = api.logprobs(openai_request, serving, index) if openai_request.logprobs else None
        self.echo_scores = openai_request.echo_logprobs  # the prompt's scores lead the choice's logprobs
        asks_ids = openai_request.return_token_ids
        self.prompt_ids = openai_request.prompts[index // openai_request.n] if asks_ids else None
        self.prompt_ids_given = False
        self.prompt_writer = None
        if openai_request.prompt_logprobs is not None:
            names = TokenNames(serving.tokenizer)
            self.prompt_writer = PromptLogprobs(names, openai_request.prompt_logprobs)
        self.answer = answer_reader(openai_request.thinking, openai_request.tools)
        # The stop strings that are special tokens, which end a row as stop tokens (stop_token_ids_of)
        special = ((serving.tokenizer.special_token_id(stop), stop) for stop in openai_request.params.stop)
        self.stop_strings = {token_id: stop for token_id, stop in special if token_id is not None}
        self.fill_ends = openai_request.fill_ends

    @property
    def reasoning(self) -> str:
        """The thoughts so far."""
        return self.answer.reasoning

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls, once the last piece is read."""
        return self.answer.tool_calls

    def text(self, piece: Piece) -> tuple[str, str]:
        """The thoughts and the content this piece adds (answers.py): a reasoning model's thoughts come
        apart, and with tools, content that may be a call is held back until the end, then `tool_calls`
        holds the calls it was."""
        text, self.echo = self.echo + piece.text, ""
        return self.answer.read(text, piece.finished)

    def stop_reason(self, piece: Piece) -> str | int | None:
        """vLLM's stop_reason: the stop string that ended the choice (one that is a special token's text
        too), else the stop token, else None (an end token, a token that ends a suffix's middle as one,
        max_tokens, or not ended yet)."""
        if piece.stop_sequence is not None or piece.stop_token_id in (None, *self.fill_ends):
            return piece.stop_sequence
        return self.stop_strings.get(piece.stop_token_id, piece.stop_token_id)

    def entries(self, piece: Piece) -> tuple:
        """The logprobs entries of the piece's tokens, the echoed prompt's first (scores that only vLLM's
        prompt_logprobs asked for are `prompt_scores`)."""
        prompt = piece.prompt_logprobs if self.echo_scores and piece.prompt_logprobs else ()
        return (*prompt, *piece.logprobs)

    def prompt_scores(self, piece: Piece) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs in its shape, from the piece that carries the prompt's scores (the first)
        when the request asks for them; None from the others."""
        if piece.prompt_logprobs is None or self.prompt_writer is None:
            return None
        return self.prompt_writer.shape(piece.prompt_logprobs)

    def logprobs(self, entries: tuple) -> dict[str, Any] | None:
        return None if self.writer is None else self.writer.shape(entries)

    def token_ids(self, token_ids: Sequence[int]) -> list[int] | None:
        """The ids of the tokens behind a chunk or a whole choice, when the request asks for them."""
        return None if self.prompt_ids is None else list(token_ids)

    def prompt_ids_once(self) -> list[int] | None:
        """The prompt's ids the first time a stream asks (its chunks after the first leave them out)."""
        if self.prompt_ids is None or self.prompt_ids_given:
            return None
        self.prompt_ids_given = True
        return self.prompt_ids


def _answer(api: Completion | ChatCompletion) -> Response:
    data, serving = read_request()
    openai_request = api.parse(data, serving)
    fields = api_fields(openai_request)
    choices, pieces = start_choices(openai_request.choice_requests(), openai_request.cache_salt, fields)
    response_id = api.id_prefix + uuid.uuid4().hex
    usage = Usage(openai_request, choices, serving)
    if openai_request.stream:
        # The model the answer names is read here: the events are written after the request's context
        model = answering_model(serving)
        events = _events(api, response_id, model, serving, openai_request, choices, pieces, usage, fields)
        if request.path.startswith(LLAMA_STACK_PREFIX + "/"):
            events = _without_done(events)
        return event_stream(events, choices.close, choices.waiting)
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
    """Prompt tokens once per prompt (however many choices), completion tokens of every choice, and of
    those a reasoning model's thoughts (counted where its answers are read for them)."""

    def __init__(self, openai_request: OpenAIRequest, choices: Choices, serving: Serving):
        self.prompt_tokens = sum(len(ids) for ids in openai_request.prompts)
        self.choices = choices
        self.tokenizer = serving.tokenizer if openai_request.thinking is not None else None
        self.predicted = bool(openai_request.params.prediction)

    def as_dict(self, outputs: list[ChoiceOutput]) -> dict[str, Any]:
        completion = self.choices.completion_tokens
        details = {}
        if self.tokenizer is not None:
            counted = sum(thought_tokens(output.reasoning, self.tokenizer) for output in outputs)
            details["reasoning_tokens"] = min(counted, completion)
        if self.predicted:
            # OpenAI's Predicted Outputs: the prediction's tokens that stood in the answer and those
            # that did not, of those drafted (backend/engine/prediction.py).
            drafted, stood = self.choices.prediction_tokens
            details |= {"accepted_prediction_tokens": stood, "rejected_prediction_tokens": drafted - stood}
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            # As OpenAI counts them: prompt tokens served from the cache (prefix reuse). With n > 1,
            # each choice of a prompt is its own request, the first to arrive computes the prefix.
            "prompt_tokens_details": {"cached_tokens": min(self.choices.cached_tokens, self.prompt_tokens)},
        }
        return usage | ({"completion_tokens_details": details} if details else {})

    def so_far(self) -> dict[str, int]:
        """The counts of a stream's chunk (vLLM's continuous_usage_stats): its tokens so far."""
        completion = self.choices.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
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
    stop_reasons: list[str | int | None] = [None] * len(choices.streams)
    token_ids: list[list[int]] = [[] for _ in choices.streams]
    prompt_scores: list[list[dict[str, Any] | None] | None] = [None] * len(choices.streams)
    try:
        for index, piece in pieces:
            if piece.finish_reason == "error":  # a later choice's: no status has gone out yet
                raise error_of(piece, fields)
            _, text = outputs[index].text(piece)  # the thoughts gather in outputs[index].reasoning
            texts[index].append(text)
            entries[index] += outputs[index].entries(piece)
            token_ids[index] += piece.token_ids
            if piece.prompt_logprobs is not None:  # the choice's first piece
                prompt_scores[index] = outputs[index].prompt_scores(piece)
            finish_reasons[index] = piece.finish_reason
            stop_reasons[index] = outputs[index].stop_reason(piece)
    finally:
        choices.close()
    whole = [
        Output(
            output.reasoning,
            "".join(parts),
            output.logprobs(tuple(entries[i])),
            output.tool_calls,
            stop_reasons[i],
            prompt_scores[i],
            output.token_ids(token_ids[i]),
            output.prompt_ids,
        )
        for i, (parts, output) in enumerate(zip(texts, outputs, strict=True))
    ]
    return jsonify(
        id=response_id,
        object=api.object,
        created=int(time.time()),
        model=answering_model(serving),
        choices=[api.choice(i, output, finish_reasons[i]) for i, output in enumerate(whole)],
        usage=usage.as_dict(outputs),
        **api.response_fields(whole),
    )


def _events(
    api: Completion | ChatCompletion,
    response_id: str,
    model: str,
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
            "model": model,
            "choices": choice_list,
            **extra,
            **({"usage": usage.so_far()} if openai_request.continuous_usage else {}),
            **fields,
        }
        return sse_event(body)

    outputs = [ChoiceOutput(api, openai_request, serving, i) for i in range(len(choices.streams))]
    try:
        for index in range(len(choices.streams)):
            opening = api.opening(index)
            if opening is not None:
                yield chunk([opening], **api.opening_fields(outputs[index]))
        for index, piece in pieces:
            if piece.finish_reason == "error":
                # Too late for a status: OpenAI's clients raise on an error event.
                failed = error_of(piece, fields)
                kind = "invalid_request_error" if failed.status < 500 else "server_error"
                yield sse_event({"error": {"message": failed.message, "type": kind, "param": failed.param}})
                return
            (reasoning, text), entries = outputs[index].text(piece), outputs[index].entries(piece)
            if reasoning or text or entries or piece.token_ids or piece.finished:
                choice = outputs[index]
                output = Output(
                    reasoning,
                    text,
                    choice.logprobs(entries),
                    choice.tool_calls,
                    choice.stop_reason(piece),
                    token_ids=choice.token_ids(piece.token_ids),
                    prompt_token_ids=choice.prompt_ids_once(),
                )
                yield chunk([api.delta(index, output, piece.finish_reason)])
            else:
                yield NO_EVENT  # (coalesced: what it holds may go out before the next piece is awaited)
        if openai_request.include_usage:
            yield chunk([], usage=usage.as_dict(outputs))
        yield DONE
    finally:
        choices.close()


def _without_done(events: Generator[bytes, None, None]) -> Iterator[bytes]:
    """The events without the last `data: [DONE]`, as Llama Stack's server ends its OpenAI-compatible
    streams: its client (0.2.x) reads every event as JSON, and OpenAI's clients end at the stream's end."""
    try:
        for event in events:
            if event != DONE:
                yield event
    finally:
        events.close()


def calls_finish_reason(finish_reason: str | None) -> str:
    """An answer that is tool calls ends with `tool_calls`, or, cut by max_tokens, `length` (as OpenAI's)."""
    return "length" if finish_reason == "length" else "tool_calls"

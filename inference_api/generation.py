"""What every generating endpoint does between parsing a request and shaping its answer.

    data, serving = read_request()               # 503 while the model loads, 404 for another model
    choices, pieces = start_choices(requests, fields=ApiFields(...))   # 503 past the queue; first piece
    return event_stream(events(...), choices.close)   # or one JSON answer

The first piece is awaited before any status goes out, so that a backend
that dies before it still gets the client a 503 rather than a broken
stream, and a request the backend refuses as its own fault a 400 naming
the API's field for what it refused (`ApiFields`, `error_of`).
`Generation` reads one request's pieces as text, for the APIs that answer
one prompt with one text (Anthropic's Messages, OpenAI's Responses, Llama
Stack's inference).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

from flask import Response, current_app, g, request

from backend.messages import InvalidParams, Piece, SamplingParams, TokenLogprob
from inference_api.answers import answer_reader
from inference_api.choices import Choices
from inference_api.client_watch import ClientWatch
from inference_api.errors import RETRY_AFTER_NOT_READY, RETRY_AFTER_QUEUE_FULL, ApiError, unavailable
from inference_api.fields import parse_json_object
from inference_api.metrics import team_of
from inference_api.reasoning import Thinking
from inference_api.router import NotReady, QueueFull, Router, Serving
from inference_api.tool_calls import ToolRequest


@dataclass(frozen=True)
class ApiFields:
    """An API's names for what a 400 about its request as a whole names: each part of a request the
    backend may refuse as the request's own fault (Piece.invalid, named as in messages.InvalidPart), and
    the field that sets how many requests one call makes (`count`)."""

    prompt_ids: str = "prompt"
    grammar: str | None = None  # the field the request's grammar came from
    logit_bias: str = "logit_bias"
    stop_token_ids: str = "stop_token_ids"
    allowed_token_ids: str = "allowed_token_ids"
    bad_words: str = "bad_words"
    count: str = "n"


OPENAI_FIELDS = ApiFields()


def error_of(piece: Piece, fields: ApiFields, failed: str = "generation failed") -> ApiError:
    """The answer to a request that ended with this error piece before its status went out: a 400 naming
    the API's field when the backend refused the request as its own fault, which no retry mends; else a
    503, since the server failed it (a backend that died, a step that raised) and a retry may succeed."""
    if piece.invalid is not None:
        param = getattr(fields, piece.invalid)
        return ApiError(400, f"{param}: {piece.error}" if param else str(piece.error), param=param)
    return unavailable(f"{failed}: {piece.error}", RETRY_AFTER_NOT_READY)


def read_request(
    model_field: str | None = "model", model_required: bool = True
) -> tuple[dict[str, Any], Serving]:
    """The request's JSON object and what is served. The body is read first, so that a rejected request
    leaves nothing unread on the connection; then 503 while the model loads, 400 for a body that is
    not a JSON object, and `check_model` on `model_field` (None: the caller checks it)."""
    body = request.get_data(cache=False)
    serving = serving_now()
    data = parse_json_object(body)
    if model_field is not None:
        check_model(data, serving, model_field, model_required)
    return data, serving


def serving_now() -> Serving:
    """What the backend serves, or a 503 while it loads."""
    serving = current_app.extensions["router"].serving
    if serving is None:
        raise unavailable("the model is not loaded yet", RETRY_AFTER_NOT_READY)
    return serving


GENERATE, EMBEDDINGS, RERANK = "generate", "/v1/embeddings", "/v1/rerank"  # what a model answers


def models_for(serving: Serving, endpoint: str) -> tuple[str, ...]:
    """The names requests at `endpoint` may call a model by: the served model's at the generating
    endpoints, the --embedding-model's (else the served model's) at /v1/embeddings, the --rerank-model's
    at /v1/rerank."""
    if endpoint == EMBEDDINGS:
        return serving.embedding_names
    return serving.rerank_names if endpoint == RERANK else serving.generating_names


def check_model(
    data: dict[str, Any],
    serving: Serving,
    name: str = "model",
    required: bool = True,
    endpoint: str = GENERATE,
) -> None:
    """The request's `name` field must name a model that answers at `endpoint` (models_for): 400 if it
    is missing, 404 if another."""
    model = data.get(name)
    if model is None and not required:
        return
    if not isinstance(model, str) or not model:
        raise ApiError(400, f"{name} is required: a string naming the served model", param=name)
    if model not in models_for(serving, endpoint):
        raise ApiError(404, unknown_model(model, serving, endpoint), param=name, code="model_not_found")
    g.adapter = model if model in serving.backend.adapters else ""  # the request's answers come from it


def answering_model(serving: Serving) -> str:
    """The model name an answer reports: the LoRA adapter the request named, else the model's."""
    return g.get("adapter") or serving.model_name


def unknown_model(model: str, serving: Serving, endpoint: str = GENERATE) -> str:
    """Why `model` is refused: it is one of the server's other models (the embedding model at a
    generating endpoint, the generating model at /v1/embeddings, ...), or no model here."""
    here = " or ".join(repr(name) for name in models_for(serving, endpoint))
    where = "this endpoint" if endpoint == GENERATE else endpoint
    if serving.serves(model):
        return f"The model {model!r} does not serve {endpoint}; {where} serves {here}"
    for other in (EMBEDDINGS, RERANK):
        if model in models_for(serving, other):
            return f"The model {model!r} serves {other} only; {where} serves {here}"
    separate = ((serving.backend.embedding_model, EMBEDDINGS), (serving.backend.rerank_model, RERANK))
    also = "".join(f", and {one.name!r} for {other}" for one, other in separate if one is not None)
    return f"The model {model!r} does not exist; this server serves {served_names(serving)}{also}" + (
        TGI_CLIENTS_HINT if model in TGI_CLIENTS_NAMES else ""
    )


# The names clients written for Text Generation Inference (which ignores `model`) send: its examples'
# "tgi", and huggingface_hub's "dummy" (InferenceClient, LangChain's ChatHuggingFace, smolagents, given a
# URL and no model). They are 404s as any other (docs/troubleshooting.md); the error says what to do.
TGI_CLIENTS_NAMES = ("tgi", "dummy")
TGI_CLIENTS_HINT = (
    " (a client written for Text Generation Inference, which ignores the model, sends this name: give it"
    " the served name, or start the server with --served-model-name adding this one)"
)


def served_names(serving: Serving) -> str:
    """The names an unknown model's error offers instead: 'a', or 'a' or 'b'."""
    return " or ".join(repr(name) for name in serving.generating_names)


def start_choices(
    requests: list[tuple[list[int], SamplingParams]],
    cache_salt: str | None = None,
    fields: ApiFields = OPENAI_FIELDS,
) -> tuple[Choices, Iterator[tuple[int, Piece]]]:
    """Open every request (503 if the rows and the queue cannot take them all now, 400 if they never
    could) and wait for the first piece; the pieces, that one first, come as (choice index, piece) while
    the client is watched. Cached prefixes are shared within the team the proxy names, and `cache_salt`
    (vLLM's) narrows it. `fields`: the API's names for the 400s."""
    router = current_app.extensions["router"]
    check_capacity(router, len(requests), fields.count)
    try:
        choices = Choices(router, requests, team_of(request.headers), cache_salt, g.get("adapter", ""))
    except NotReady:
        raise unavailable("the model is not loaded yet", RETRY_AFTER_NOT_READY) from None
    except QueueFull as full:
        raise unavailable(f"the server is busy: {full}", RETRY_AFTER_QUEUE_FULL) from None
    try:
        pieces = choices.pieces(ClientWatch())
        first = next(pieces)
        if first[1].finish_reason == "error":
            raise error_of(first[1], fields)
    except BaseException:
        choices.close()
        raise
    return choices, chain([first], pieces)


def read_all(
    choices: Choices, pieces: Iterator[tuple[int, Piece]], fields: ApiFields, read: Callable[[Piece], object]
) -> None:
    """Each piece of an answer sent whole, to `read`, then the requests end: a piece that ends in an
    error (no status has gone out yet) raises it as the API's error (error_of)."""
    try:
        for _, piece in pieces:
            if piece.finish_reason == "error":
                raise error_of(piece, fields)
            read(piece)
    finally:
        choices.close()


def check_capacity(router: Router, count: int, param: str) -> None:
    """A 400 naming `param` for an API call of more requests than the rows and the queue hold together:
    on an idle server it would still meet a full queue, and a 503 would have its client retry for ever."""
    serving = router.serving
    if serving is None or count <= serving.backend.rows + router.max_queue:
        return  # not ready: the 503 of Choices
    rows, queue = serving.backend.rows, router.max_queue
    raise InvalidParams(
        param,
        f"{param} asks for {count} requests at once (one for each prompt and choice, or input); this "
        f"server holds at most {rows + queue} ({rows} rows and a queue of {queue}): send fewer at a time",
    )


def event_stream(
    events: Iterator[bytes], close: Callable[[], None], waiting: Callable[[], bool] | None = None
) -> Response:
    """Server-sent events, written as they are made; `close` ends the requests when the response ends
    (a generator that never started runs no finally: the WSGI close() does it then). With `waiting`
    (whether a piece is already queued), the events are `coalesced`: `events` must then yield
    NO_EVENT for each piece that makes none."""
    if waiting is not None:
        events = coalesced(events, waiting)
    response = Response(events, content_type="text/event-stream; charset=utf-8")
    response.call_on_close(close)
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # ask proxies in front not to buffer the stream
    return response


def coalesced(events: Iterator[bytes], waiting: Callable[[], bool]) -> Iterator[bytes]:
    """The events, those made while more pieces were already queued joined into one write.

    Each write is a chunk of the response and a send to the client, the worker's dearest part of a
    token at thousands a second (docs/performance.md, "The frontend at thousands of tokens a second").
    A request thread that falls behind its steps finds several pieces waiting and writes them at once;
    one that keeps up writes each as before. Nothing is held while the thread could wait: `events`
    yields NO_EVENT after a piece that makes no event (text held back at a stop string's start, a tool
    call's arguments being read), so that every piece read is a point where what is held goes out
    unless the next piece is already there."""
    held: list[bytes] = []
    try:
        for event in events:
            if event:
                held.append(event)
            if held and not waiting():
                yield b"".join(held)
                held = []
        if held:
            yield b"".join(held)
    except Exception:  # a failure mid-stream (the native API's StreamAborted): what came before it first
        if held:
            yield b"".join(held)
        raise
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()  # a client gone mid-stream: the events' own finally runs now, not when collected


NO_EVENT = b""  # what an events generator for `coalesced` yields for a piece that makes no event
NO_PART = ("", "")  # what Generation.parts(marked=True) yields for a piece that makes no part


def sse_event(data: dict[str, Any], name: str | None = None) -> bytes:
    """One server-sent event: its JSON data, after an `event:` line naming it if it is named."""
    line = f"event: {name}\n" if name else ""
    return f"{line}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class GenerationFailed(RuntimeError):
    """The backend failed after the answer had begun: the stream ends with the API's error event.
    `error`: what the answer would have been had it not begun (error_of)."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


class Generation:
    """One request's answer as text: `deltas()` as it comes, or `text()` whole; then why it ended
    (finish_reason "stop" or "length", and the stop sequence if one ended it) and its token counts.
    `fields`: the API's names for the 400s (start_choices). The text is read as answers.py reads it:
    with `tools`, for calls (what may be a call is held back, and `tool_calls` holds the calls at the
    end, in OpenAI chat's shape: {id, type, function: {name, arguments (a JSON string)}}); with
    `thinking` (not None: a reasoning model's answer, Serving.prompt_thinking), its thoughts come apart:
    `parts()` gives them first, as ("reasoning", text), and `reasoning` holds them whole at the end.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        fields: ApiFields = OPENAI_FIELDS,
        tools: ToolRequest | None = None,
        thinking: Thinking | None = None,
    ):
        self.choices, self._pieces = start_choices([(prompt_ids, params)], fields=fields)
        self.fields = fields
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.token_ids: list[int] = []  # the answer's tokens so far, with SamplingParams.token_ids
        self.logprobs: list[TokenLogprob] = []  # the answer's tokens' so far, with SamplingParams.logprobs
        self._answer = answer_reader(thinking, tools)

    @property
    def reasoning(self) -> str:
        """The thoughts so far."""
        return self._answer.reasoning

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls, once the answer has ended."""
        return self._answer.tool_calls

    @property
    def prompt_tokens(self) -> int:
        return self.choices.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.choices.completion_tokens

    @property
    def cached_tokens(self) -> int:
        return self.choices.cached_tokens

    def deltas(self, marked: bool = False) -> Iterator[str]:
        """The text as it comes, in non-empty pieces, without the thoughts; GenerationFailed if the
        backend fails. With `marked`, "" for each piece that makes no text (for `coalesced`)."""
        parts = self.parts(marked)
        try:
            for kind, text in parts:
                if kind == "text":
                    yield text
                elif marked:
                    yield ""
        finally:
            parts.close()

    def parts(self, marked: bool = False) -> Iterator[tuple[str, str]]:
        """The answer as it comes, in non-empty pieces: ("reasoning", thoughts) then ("text", text);
        GenerationFailed if the backend fails. With `marked`, NO_PART for each piece that makes none
        (text held back at a stop string's start, a tool call being read): the events generator of a
        `coalesced` stream yields NO_EVENT for it."""
        try:
            for _, piece in self._pieces:
                if piece.finish_reason == "error":
                    raise GenerationFailed(error_of(piece, self.fields))
                self.token_ids += piece.token_ids
                self.logprobs += piece.logprobs
                reasoning, text = self._answer.read(piece.text, piece.finished)
                if piece.finished:
                    self.finish_reason, self.stop_sequence = piece.finish_reason, piece.stop_sequence
                if reasoning:
                    yield "reasoning", reasoning
                if text:
                    yield "text", text
                elif marked and not reasoning:
                    yield NO_PART
                if self.finish_reason is not None:
                    return
        finally:
            self.close()

    def text(self) -> str:
        """The whole text (the error's answer, error_of, if the backend fails before the end)."""
        try:
            return "".join(self.deltas())
        except GenerationFailed as failed:
            raise failed.error from None

    def close(self) -> None:
        """End the request; one still running is cancelled (its row frees at the next step)."""
        self.choices.close()

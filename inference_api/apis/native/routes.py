"""The native API (SPEC §4.1): POST /predictions/<model>, streamed as plain text or answered as JSON."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from flask import Blueprint, Response, current_app, jsonify, request

from backend.messages import Piece, SamplingParams
from inference_api.apis.native.request import check_context, parse_native_request
from inference_api.client_watch import ClientWatch
from inference_api.errors import RETRY_AFTER_NOT_READY, RETRY_AFTER_QUEUE_FULL, ApiError, unavailable
from inference_api.generation import NO_EVENT, ApiFields, coalesced, error_of, served_names
from inference_api.metrics import team_of
from inference_api.request_stream import RequestStream
from inference_api.router import NotReady, QueueFull, Router
from inference_api.tokenizer import stop_token_ids_of

bp = Blueprint("native_api", __name__)
FIELDS = ApiFields(prompt_ids="text", grammar="json_schema")


class StreamAborted(RuntimeError):
    """Raised mid-stream so that gunicorn cuts the connection: a client must not take a stream
    the backend could not finish for a complete answer (there is no status left to send)."""


@bp.post("/predictions/<path:model>")
def predictions(model: str) -> Response:
    # The body first (413 past the limit): a rejected request must not leave it unread on the connection.
    body = request.get_data(cache=False)
    router: Router = current_app.extensions["router"]
    serving = router.serving
    if serving is None:
        raise unavailable("the model is not loaded yet", RETRY_AFTER_NOT_READY)
    if not serving.serves(model):
        raise ApiError(404, f"model {model!r} not found; this server serves {served_names(serving)}")
    native = parse_native_request(body)
    prompt_ids = serving.tokenizer.encode(native.text)
    check_context(len(prompt_ids), native.params.max_tokens, serving.backend.max_seq_len)

    params = replace(native.params, stop_token_ids=stop_token_ids_of(native.params.stop, serving.tokenizer))
    adapter = model if model in serving.backend.adapters else ""  # a LoRA adapter's name
    stream = open_stream(router, prompt_ids, params, adapter)
    try:
        # Wait for the first piece before answering, so that a backend that dies before it
        # still gets the client a status code rather than a cut connection.
        watch = ClientWatch()
        first = stream.next_piece(watch)
        if first.finish_reason == "error":
            raise error_of(first, FIELDS)
    except BaseException:
        stream.close()
        raise
    prefix = native.text if native.return_prompt else ""
    if native.stream:
        return streaming_response(stream, first, prefix)
    return json_response(stream, first, prefix)


def open_stream(
    router: Router, prompt_ids: list[int], params: SamplingParams, adapter: str = ""
) -> RequestStream:
    try:
        return router.open(prompt_ids, params, team=team_of(request.headers), adapter=adapter)
    except NotReady:
        raise unavailable("the model is not loaded yet", RETRY_AFTER_NOT_READY) from None
    except QueueFull as full:
        raise unavailable(f"the server is busy: {full}; retry later", RETRY_AFTER_QUEUE_FULL) from None


def streaming_response(stream: RequestStream, first: Piece, prefix: str) -> Response:
    body = coalesced(stream_body(stream, first, prefix), stream.waiting)
    response = Response(body, content_type="text/plain; charset=utf-8")
    # A generator that never started runs no finally: the WSGI close() ends the request then.
    response.call_on_close(stream.close)
    response.headers["X-Accel-Buffering"] = "no"  # ask proxies in front not to buffer the stream
    return response


def stream_body(stream: RequestStream, first: Piece, prefix: str) -> Iterator[bytes]:
    """The chunks of the response, each written by gunicorn as soon as it is yielded (those made while
    more pieces wait, as one: `coalesced`, for which a piece of no text yields NO_EVENT).

    When the client hangs up, gunicorn's write fails and it closes this generator
    (GeneratorExit at the yield): the finally cancels the request.
    """
    try:
        if prefix:
            yield prefix.encode("utf-8")
        piece = first
        while True:
            if piece.finish_reason == "error":
                raise StreamAborted(f"generation failed mid-stream: {piece.error}")
            yield piece.text.encode("utf-8") if piece.text else NO_EVENT
            if piece.finished:
                return
            piece = stream.next_piece()
    finally:
        stream.close()


def json_response(stream: RequestStream, first: Piece, prefix: str) -> Response:
    watch = ClientWatch()  # nothing is written until the end: a hang-up must be looked for
    parts = [prefix, first.text]
    piece = first
    try:
        while not piece.finished:
            piece = stream.next_piece(watch)
            parts.append(piece.text)
    finally:
        stream.close()
    if piece.finish_reason == "error":
        raise error_of(piece, FIELDS)
    return jsonify(
        text="".join(parts),
        finish_reason=piece.finish_reason,
        usage={
            "prompt_tokens": stream.prompt_tokens,
            "completion_tokens": stream.completion_tokens,
            "total_tokens": stream.prompt_tokens + stream.completion_tokens,
        },
    )

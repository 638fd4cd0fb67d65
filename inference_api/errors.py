"""Every error as JSON, whatever raised it, in the shape of the API its path belongs to.

Native paths get {"status_code": N, "message": "..."} (SPEC §4.1); paths under
/v1/ get OpenAI's {"error": {"message", "type", "param", "code"}} (SPEC §4.2),
which the official openai client turns into its typed exceptions; Anthropic's
/v1/messages gets Anthropic's {"type": "error", "error": {"type", "message"}},
Llama Stack's inference paths FastAPI's {"detail": "..."}, as Llama Stack's
own server answers, and Text Generation Inference's paths TGI's {"error", "error_type"}, whose
type its clients raise by.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, current_app, g, has_request_context, jsonify, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound, RequestEntityTooLarge

from backend.messages import InvalidParams
from inference_api.client_watch import CLIENT_CLOSED_REQUEST, ClientGone

log = logging.getLogger(__name__)

RETRY_AFTER_QUEUE_FULL = 1  # seconds: a row frees up within a few steps
RETRY_AFTER_NOT_READY = 5  # seconds: a model loads or a backend restarts
# An oversized body is read and dropped up to this size, so that the connection stays usable: gunicorn
# drains at most 64 KiB of an unread body and then closes a connection it has announced as keep-alive.
DISCARD_BODY_LIMIT = 16 * 1024 * 1024


class ApiError(Exception):
    """An error the client gets as it is: a status, a message naming the field, maybe headers."""

    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.param = param
        self.code = code


# vLLM's extensions beside /v1/, which answer errors in OpenAI's shape as vLLM's do, and llama.cpp's own
# paths, whose server answers in that shape too.
OPENAI_STYLE_PATHS = ("/tokenize", "/detokenize", "/rerank", "/v2/rerank", "/score")
OPENAI_STYLE_PATHS += ("/completion", "/infill", "/apply-template", "/props", "/embedding", "/embeddings")
ANTHROPIC_PATH = "/v1/messages"
LLAMA_STACK_PREFIXES = ("/inference/", "/v1/inference/")
OLLAMA_PREFIX = "/api/"
# and POST /, either of the first two; Text Embeddings Inference's /embed answers in TGI's shape too, and its
# body at /rerank (answer_errors_as_tgi)
TGI_PATHS = ("/generate", "/generate_stream", "/info", "/embed")
# Anthropic's error types by status; its clients pick their exception by the status alone.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def unavailable(message: str, retry_after: int) -> ApiError:
    return ApiError(503, message, {"Retry-After": str(retry_after)})


def error_response(
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    code: str | None = None,
) -> Response:
    path = request.path if has_request_context() else ""
    response = jsonify(error_body(path, status, message, param, code))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def error_body(path: str, status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error(status, message)
    if path.startswith(LLAMA_STACK_PREFIXES):
        return {"detail": message}
    if path.startswith(OLLAMA_PREFIX):
        return {"error": message}
    if tgi_shaped(path):
        return tgi_error(status, message)
    if path.startswith("/v1/") or path in OPENAI_STYLE_PATHS:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"status_code": status, "message": message}


def tgi_shaped(path: str) -> bool:
    """Whether a request's errors are TGI's: at TGI's and TEI's paths, POST / (TGI's generate; GET / is
    the chat page), and a TEI body at a path other APIs share (answer_errors_as_tgi)."""
    if path in TGI_PATHS:
        return True
    if not has_request_context():
        return False
    return (path == "/" and request.method == "POST") or g.get("tgi_errors", False)


def answer_errors_as_tgi() -> None:
    """This request's errors in TGI's shape from here on: a body of Text Embeddings Inference at a path
    that other APIs' bodies share (/rerank, also vLLM's and Jina's), known once the body is read."""
    g.tgi_errors = True


def tgi_error(status: int, message: str) -> dict[str, Any]:
    """TGI's error body: huggingface_hub raises a ValidationError or an OverloadedError by its type."""
    kind = "validation" if status < 500 else ("overloaded" if status == 503 else "generation")
    return {"error": message, "error_type": kind}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body, also the data of its streams' `error` event."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(ApiError, _api_error)
    app.register_error_handler(InvalidParams, _invalid_params)
    app.register_error_handler(HTTPException, _http_exception)
    app.register_error_handler(ClientGone, _client_gone)
    app.register_error_handler(Exception, _unexpected)


def _api_error(error: ApiError) -> Response:
    return error_response(error.status, error.message, error.headers, error.param, error.code)


def _invalid_params(error: InvalidParams) -> Response:
    return error_response(400, str(error), param=error.param, code=getattr(error, "code", None))


def _http_exception(error: HTTPException) -> Response:
    status = error.code or 500
    _discard_body()  # raised before the view read it (413, or 404 and 405 from routing)
    if isinstance(error, RequestEntityTooLarge):
        limit = current_app.config["MAX_CONTENT_LENGTH"]
        message = f"the request body is over the limit of {limit} bytes"
    elif isinstance(error, NotFound):
        message = f"no such path: {request.path}"
    elif isinstance(error, MethodNotAllowed):
        allowed = ", ".join(sorted(error.valid_methods or ()))
        message = f"method {request.method} is not allowed on {request.path}; allowed: {allowed}"
    else:
        message = f"{error.name}: {error.description}"
    response = error_response(status, message)
    # Keep what werkzeug adds, such as Allow on a 405.
    for name, value in error.get_response().headers.items():
        if name.lower() not in ("content-type", "content-length"):
            response.headers[name] = value
    return response


def _client_gone(error: ClientGone) -> Response:
    """Nobody will read it: nginx's 499 ("client closed request") for the metrics and gunicorn's log
    (gunicorn_logger.py says there that the client went away)."""
    response = Response(status=CLIENT_CLOSED_REQUEST)
    response.headers["Connection"] = "close"
    return response


def _discard_body() -> None:
    length = request.content_length
    if length is None or length > DISCARD_BODY_LIMIT:
        return  # let gunicorn close the connection
    stream = request.environ["wsgi.input"]
    while length > 0:
        chunk = stream.read(min(length, 65536))
        if not chunk:
            return
        length -= len(chunk)


def _unexpected(error: Exception) -> Response:
    log.exception("unexpected error")
    return error_response(500, f"internal error: {type(error).__name__}")

"""The proxy's error shape, for the app's answers and for those gunicorn writes itself (the worker's).

No Flask and no requests here: the worker imports this before gevent patches the standard library.
"""

from __future__ import annotations

ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict:
    """The native API's error shape, plus OpenAI's `error` object so either kind of client reads it."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {
        "status_code": status,
        "message": message,
        "error": {"message": message, "type": kind, "code": status},
    }

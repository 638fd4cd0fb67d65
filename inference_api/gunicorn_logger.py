"""gunicorn's logger, with a client that hangs up logged as a hang-up (gunicorn.conf.py names it).

Any client may close its connection, so a hang-up must not read as a server error, nor fill the
error log. gunicorn's own logger takes a stream whose client watch saw its client go (ClientGone,
raised from the response body) for an `[ERROR] Error handling request` with a 25-line traceback,
and a stream whose write broke its pipe for a 200 in the access log. Here either is one info line
naming the request, and a 499 (nginx's "client closed request") in the access log, like a JSON
answer whose client left (errors.py answers it 499). Every other error is logged as gunicorn logs it.
"""

from __future__ import annotations

import sys
from datetime import timedelta

from gunicorn.glogging import Logger

from inference_api.client_watch import CLIENT_CLOSED_REQUEST, ClientGone, hang_up_in_flight

HUNG_UP = "client closed the connection before its answer was complete: %s %s after %.1f s (request %s)"


class ApiLogger(Logger):
    def access(self, resp, req, environ: dict, request_time: timedelta) -> None:
        """gunicorn calls it in the `finally` that ends a request, whether its access log is on or not."""
        if hang_up_in_flight() or getattr(resp, "status_code", None) == CLIENT_CLOSED_REQUEST:
            self.info(HUNG_UP, req.method, req.path, request_time.total_seconds(), request_id(resp))
        super().access(resp, req, environ, request_time)

    def atoms(self, resp, req, environ: dict, request_time: timedelta) -> dict:
        atoms = super().atoms(resp, req, environ, request_time)
        if hang_up_in_flight():  # the status it began with is not how it ended
            atoms["s"] = str(CLIENT_CLOSED_REQUEST)
        return atoms

    def exception(self, msg, *args, **kwargs) -> None:
        # Only ClientGone, which only a request raises: gunicorn logs a request's broken pipe at debug
        # level itself, and a ConnectionError it logs elsewhere need not be a client's.
        if isinstance(sys.exc_info()[1], ClientGone):
            return  # access() has said it, in one line
        super().exception(msg, *args, **kwargs)


def request_id(resp) -> str:
    """The response's X-Request-ID, to find the request among the app's own lines."""
    for name, value in resp.headers:
        if name.lower() == "x-request-id":
            return value
    return "-"

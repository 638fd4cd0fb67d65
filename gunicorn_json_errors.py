"""What the API server's and the proxy's gunicorn workers share: gunicorn's own answers as JSON.

gunicorn writes some answers itself, to a request it cannot parse (400, 414, 431...) or to an error
outside the app (500), as an HTML page. Both servers answer every other error in JSON, so their
workers (inference_api/worker.py, proxy/worker.py) take this mixin and say, in `error_json`, what
their own error body is. A module of its own at the top, because the proxy's image carries neither
inference_api nor torch.
"""

from __future__ import annotations

import json
import uuid

from gunicorn import util


class JsonErrorPages:
    """A gunicorn worker mixin: gunicorn picks the status and logs as it does; only the page is JSON."""

    def error_json(self, req, status: int, message: str) -> dict:
        raise NotImplementedError

    def handle_error(self, req, client, addr, exc):
        page = _ErrorPage()
        super().handle_error(req, page, addr, exc)
        if page.status is None:
            return
        message = f"{page.reason}: {exc}" if page.status < 500 else "internal error"
        body = json.dumps(self.error_json(req, page.status, message)).encode()
        head = (
            f"HTTP/1.1 {page.status} {page.reason}\r\n"
            "Connection: close\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"X-Request-ID: {uuid.uuid4().hex}\r\n\r\n"
        )
        try:
            util.write_nonblock(client, head.encode("latin-1") + body)
        except Exception:
            self.log.debug("Failed to send error message.")


class _ErrorPage:
    """Stands for the client's socket in gunicorn's handle_error: keeps the status of the page it writes."""

    status: int | None = None
    reason = ""

    def gettimeout(self) -> float:
        return 0.0  # util.write_nonblock then writes with sendall alone

    def sendall(self, data: bytes) -> None:
        status_line = data.split(b"\r\n", 1)[0].decode("latin-1")
        _, status, self.reason = status_line.split(" ", 2)
        self.status = int(status)

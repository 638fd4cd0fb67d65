"""Whether the client of the request in progress is still connected, for answers that write nothing
until they are done (JSON answers, and every answer before its first piece).

A streaming answer learns of a hang-up when its next write fails. A JSON
answer writes once, at the end, so a client that left (or a proxy that gave
up with a 504) would keep its row generating to max_tokens for nobody. While
such a request waits for pieces it looks at its socket every
POLL_SECONDS, pieces coming or not: a peek that reads end-of-file means the
peer closed.
"""

from __future__ import annotations

import socket
import sys
import time

from flask import has_request_context, request

POLL_SECONDS = 0.5
CLIENT_CLOSED_REQUEST = 499  # nginx's "client closed request": the client closed its connection


class ClientGone(Exception):
    """The client closed its connection while its answer was being made."""


def is_hang_up(error: BaseException | None) -> bool:
    """Whether `error` ended a request because its client went away: ClientGone, or a write into the
    socket it closed (a broken pipe, a reset)."""
    return isinstance(error, (ClientGone, ConnectionError))


def hang_up_in_flight() -> bool:
    """Whether the exception being handled is a hang-up. gunicorn writes a response's access line and
    closes its body (the WSGI close()) in a `finally`, while the exception that cut the response short
    is still in flight: this is how those two learn that its client left."""
    return is_hang_up(sys.exc_info()[1])


class ClientWatch:
    """Called while a request waits for its pieces (and with each piece): raises ClientGone once
    its client has closed the connection. Looks at the socket at most every POLL_SECONDS."""

    def __init__(self) -> None:
        self.sock = request.environ.get("gunicorn.socket") if has_request_context() else None
        self.checked_at = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if self.sock is None or now - self.checked_at < POLL_SECONDS:
            return
        self.checked_at = now
        if client_gone(self.sock):
            raise ClientGone


def client_gone(sock: socket.socket | None) -> bool:
    if sock is None:  # not under gunicorn (Flask's test client): nothing to watch
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):  # connected, nothing sent: the usual case
        return False
    except ValueError:  # a TLS socket takes no flags; its client is not watched
        return False
    except OSError:  # reset by the peer
        return True

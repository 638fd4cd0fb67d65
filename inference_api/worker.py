"""The API server's gunicorn worker: gthread's, with four changes (gunicorn.conf.py names it).

- A connection whose socket gunicorn already closed counts as closed once. When
  a response fails after its headers went out (a stream cut by a backend that
  died, native_api.StreamAborted), gthread's handle_request closes the socket
  itself, and its finish_request then fails to close it again and counts the
  connection closed a second time. The count runs one short for good, and a
  SIGTERM stops waiting for the streams in flight that it no longer counts.
- Before the shutdown grace (graceful_timeout) runs out, every request still in
  flight ends with an error: one still waiting for its answer gets a 503 with
  Retry-After, rather than a connection closed with no reply.
- The answers gunicorn writes itself, to a request it cannot parse (400, 414,
  431...) or to an error outside the app (500), are JSON in the API's error
  shape, like every other error, instead of an HTML page.
- A client that hung up before its answer's first byte gets no 500 and is no error: gunicorn would
  log one, with a traceback, and write the 500 to nobody. (gunicorn_logger.py has logged it already,
  as the hang-up it is.)
"""

from __future__ import annotations

import threading
import time

from gunicorn.workers.gthread import ThreadWorker

from gunicorn_json_errors import JsonErrorPages
from inference_api.client_watch import is_hang_up
from inference_api.errors import error_body

# Requests still in flight this long before the grace ends get their error: time to write it and go.
ANSWER_MARGIN_SECONDS = 1.0
SHUTTING_DOWN = "the server is shutting down"


class ApiWorker(JsonErrorPages, ThreadWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._exit_requested = threading.Event()

    def run(self):
        threading.Thread(target=self._end_requests_before_grace_ends, name="grace", daemon=True).start()
        super().run()

    def handle_exit(self, sig, frame):
        """SIGTERM. A signal handler: it only sets an event (starting a thread here could deadlock), and
        wakes the event loop, which otherwise saw the exit at its next 1 s timeout (a queue put is safe
        here: SimpleQueue's is reentrant, and the wake-up is a byte written to a pipe)."""
        super().handle_exit(sig, frame)
        self._exit_requested.set()
        method_queue = getattr(self, "method_queue", None)
        if method_queue is not None and method_queue.fileno() is not None:
            method_queue.defer(lambda: None)

    def _end_requests_before_grace_ends(self) -> None:
        self._exit_requested.wait()
        time.sleep(max(0.0, self.cfg.graceful_timeout - ANSWER_MARGIN_SECONDS))
        router = getattr(self.wsgi, "extensions", {}).get("router")
        if router is not None:
            router.end_requests(SHUTTING_DOWN)

    def finish_request(self, conn, fs):
        if conn.sock.fileno() == -1:  # closed by gunicorn after its response failed midway
            self.nr_conns -= 1
            return
        super().finish_request(conn, fs)

    def handle_error(self, req, client, addr, exc):
        if is_hang_up(exc):
            return
        super().handle_error(req, client, addr, exc)

    def error_json(self, req, status: int, message: str) -> dict:
        return error_body(getattr(req, "path", None) or "", status, message, None, None)

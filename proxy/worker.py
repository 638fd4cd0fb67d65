"""The proxy's gunicorn worker: gevent's, plus the deadlines a server facing the internet needs.

Each connection is a greenlet, so a slow or idle client holds a little memory,
not a thread (docs/deploy.md, "Slow clients"). gunicorn's gevent worker bounds
the read of a request's line and headers by its keep-alive setting, a whole
number of seconds that is also the idle time; here it is `header_timeout`. It
has no bound at all on the body, which the app reads: `DeadlineBody` is one.
It bounds reading the body only, never the answer: a generation may stream for
minutes, and the next request on that kept-alive connection has its own deadline.

With `--certfile` and `--keyfile` it speaks TLS on the traffic port (proxy/tls.py says why here rather
than through gunicorn's own certfile setting), and the answers gunicorn writes itself, to a request it
cannot parse (400, 414, 431...), are JSON in the proxy's error shape, like every other error.
"""

from __future__ import annotations

import resource
import signal
import ssl
import time
from contextlib import contextmanager

import gevent
from gunicorn.workers.ggevent import GeventWorker
from werkzeug.exceptions import RequestTimeout

from gunicorn_json_errors import JsonErrorPages
from proxy.config import ProxyConfig
from proxy.errors import error_body
from proxy.tls import server_context

# Per client connection: its socket and, while it streams, one to the upstream.
FILES_PER_CONNECTION = 2
SPARE_FILES = 256  # listeners, logs, the health checks' connections
DRAIN_CHUNK_BYTES = 64 * 1024


class DeadlineBody:
    """A request body (gunicorn's `Body`) that must arrive by a deadline: a read past it raises 408."""

    def __init__(self, body, seconds: float):
        self.body = body
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.expired = False

    def read(self, size=None) -> bytes:
        return self._in_time(self.body.read, size)

    def readline(self, size=None) -> bytes:
        return self._in_time(self.body.readline, size)

    def readlines(self, size=None) -> list[bytes]:
        return self._in_time(self.body.readlines, size)

    def __iter__(self):
        while line := self.readline():
            yield line

    def _in_time(self, read, size):
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self._expire()
        timeout = gevent.Timeout(remaining)
        timeout.start()
        try:
            return read(size)
        except gevent.Timeout as fired:
            if fired is not timeout:
                raise
            self._expire()
        finally:
            timeout.cancel()

    def _expire(self):
        self.expired = True
        raise RequestTimeout(f"the request body did not arrive within {self.seconds:g} s of its headers")

    def drain(self) -> bool:
        """Read what the app left of the body (a request refused before reading it), by a deadline
        `seconds` from now: the answer's time is not the body's. False if it did not all come by then."""
        self.deadline = time.monotonic() + self.seconds
        try:
            while self.read(DRAIN_CHUNK_BYTES):
                pass
        except RequestTimeout:
            return False
        return True


class ProxyWorker(JsonErrorPages, GeventWorker):
    # The certificate and key to load: the master's copy of the last good pair, which gunicorn_conf's
    # pre_fork hook hands over (proxy/served_pair.py); without that hook, the configured files.
    tls_files: tuple[str, str] | None = None

    def init_process(self):
        # Until gunicorn installs this worker's own handlers (after gevent's patching, half a second), a
        # stop ends it at once: the master's handlers, which a fork inherits, queued the signal where no
        # one read it, and a proxy stopped while it booted waited out its graceful timeout (10 s).
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, signal.SIG_DFL)
        config = ProxyConfig.from_env()
        self.header_timeout = config.header_timeout
        self.body_timeout = config.body_timeout
        if self.tls_files is None and config.certfile:
            self.tls_files = (config.certfile, config.keyfile)
        self.tls: ssl.SSLContext | None = None
        self.health_port = config.health_port
        # The connections waiting for a request's headers, each with its deadline.
        self.waiting: dict[gevent.Greenlet, gevent.Timeout] = {}
        raise_open_file_limit(FILES_PER_CONNECTION * config.max_connections + SPARE_FILES, self.log)
        super().init_process()  # patches the standard library for gevent, loads the app, serves

    @contextmanager
    def timeout_ctx(self):
        # gunicorn reads each request's line and headers (on a kept-alive connection, waits for
        # them) inside this; False: when the deadline fires the connection is closed, unanswered.
        deadline = gevent.Timeout(self.header_timeout, False)
        self.waiting[gevent.getcurrent()] = deadline
        try:
            with deadline:
                yield
        finally:
            del self.waiting[gevent.getcurrent()]

    def run(self):
        if self.tls_files:
            self.tls = server_context(*self.tls_files)  # here: after gevent has patched ssl
        gevent.spawn(self.close_idle_connections_at_shutdown)
        super().run()

    def handle(self, listener, client, addr):
        if self.tls is not None and listener.getsockname()[1] != self.health_port:
            client = self.tls_handshake(client)
            if client is None:
                return
        super().handle(listener, client, addr)

    def tls_handshake(self, client):
        """The connection wrapped in TLS, or None (closed) if the handshake fails or outlasts the
        header deadline: plain HTTP sent to this port, a client that says nothing, a bad hello."""
        client.setblocking(1)
        # The wrapped socket takes the connection over: it is the one to close if the handshake fails.
        connection = self.tls.wrap_socket(client, server_side=True, do_handshake_on_connect=False)
        deadline = gevent.Timeout(self.header_timeout)
        deadline.start()
        try:
            connection.do_handshake()
            return connection
        except (gevent.Timeout, OSError) as error:  # ssl.SSLError is an OSError
            if isinstance(error, gevent.Timeout) and error is not deadline:
                raise
            self.log.debug("TLS handshake failed: %s", error)
            connection.close()
            return None
        finally:
            deadline.cancel()

    def close_idle_connections_at_shutdown(self):
        """Streams have until the graceful timeout to finish; a connection that waits for a request
        has nothing to finish, so it is closed at once rather than holding the exit for its deadline."""
        while self.alive:
            gevent.sleep(0.2)
        while True:
            for connection, deadline in list(self.waiting.items()):
                connection.kill(deadline, block=False)  # its deadline, come early
            gevent.sleep(0.2)

    def handle_request(self, listener_name, req, sock, addr):
        if isinstance(sock, ssl.SSLSocket):
            req.scheme = "https"  # gunicorn's own TLS would say so; this is the worker's
        req.body = body = DeadlineBody(req.body, self.body_timeout)
        super().handle_request(listener_name, req, sock, addr)
        if body.expired:  # the app answered 408; the rest of the body is not worth waiting for
            raise StopIteration
        # gunicorn reads what is left of the body before the next request on the connection
        # (parser.finish_body). Through the DeadlineBody, that read would come after the answer, past
        # a deadline the answer's time used up, and fail the next request with a 500: drain it here on
        # its own clock, then hand gunicorn its own body back, read to the end.
        if not body.drain():
            raise StopIteration  # where the next request starts is unknown: close
        req.body = body.body

    def error_json(self, req, status: int, message: str) -> dict:
        return error_body(status, message)


def raise_open_file_limit(needed: int, log) -> None:
    """Every connection is a file: lift the soft limit to the hard one, and say if that is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard != resource.RLIM_INFINITY and hard < needed:
        log.warning(
            "the open file limit is %d; --max-connections needs about %d: raise it (ulimit -n, or the "
            "container runtime's nofile limit)",
            hard,
            needed,
        )

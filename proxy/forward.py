"""Sending one request to an upstream and streaming its answer back as it comes."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterator

import requests
import urllib3

from proxy.upstreams import Upstream, UpstreamPool

log = logging.getLogger("proxy")

# RFC 9110 §7.6.1: these describe one connection, not the message, and are never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
    }
)
# Never passed upstream: the token stays at the proxy (in either header it comes in), and the team is
# the token's, not the client's word.
DROPPED_FROM_CLIENT = HOP_BY_HOP | {"host", "authorization", "x-api-key", "x-team-id", "content-length"}


class UpstreamUnavailable(Exception):
    """No upstream could be connected to (502)."""


class UpstreamTimeout(Exception):
    """The upstream took too long to answer (504)."""


def named_in_connection(headers) -> set[str]:
    """The headers a Connection header lists: they too describe that connection only (RFC 9110 §7.6.1)."""
    return {
        token.strip().lower()
        for name, value in headers.items()
        if name.lower() == "connection"
        for token in value.split(",")
    }


def upstream_request_headers(
    client_headers: dict[str, str], team_id: str | None, request_id: str
) -> dict[str, str]:
    """team_id None: a public path, forwarded with no team (never the client's word for one)."""
    dropped = DROPPED_FROM_CLIENT | named_in_connection(client_headers)
    headers = {name: value for name, value in client_headers.items() if name.lower() not in dropped}
    if team_id is not None:
        headers["X-Team-ID"] = team_id
    headers["X-Request-ID"] = request_id
    return headers


# The proxy's server writes its own.
REPLACED_BY_PROXY = frozenset({"date", "server"})


def client_response_headers(upstream_headers, request_id: str) -> list[tuple[str, str]]:
    dropped = HOP_BY_HOP | REPLACED_BY_PROXY | named_in_connection(upstream_headers)
    headers = [(name, value) for name, value in upstream_headers.items() if name.lower() not in dropped]
    if not any(name.lower() == "x-request-id" for name, _ in headers):
        headers.append(("X-Request-ID", request_id))
    return headers


def send(
    pool: UpstreamPool,
    session: requests.Session,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    timeouts: tuple[float, float],
) -> tuple[Upstream, requests.Response]:
    """Send to the least busy ready upstream; on a connection error try the next one.

    A connection error comes before the answer's headers, so the client has
    received nothing yet: a refused connection means the upstream never saw
    the request, and a reset one means it died (or closed an idle pooled
    connection) before answering. Generation has no side effects, so sending
    the request to another upstream loses nothing. A first reset is tried
    once more on the same upstream: an upstream closes a pooled connection
    idle past its keep-alive time, and a request sent on it in that instant
    is reset although the upstream is well (one upstream: a 502 otherwise).
    """
    tried: set[str] = set()
    reset: set[str] = set()
    while True:
        try:
            upstream = pool.acquire(exclude=tried)
        except Exception as error:
            raise UpstreamUnavailable("no inference server is ready") from error
        try:
            response = session.request(
                method,
                upstream.url + path,
                headers=headers,
                data=body,
                stream=True,
                timeout=timeouts,
                allow_redirects=False,
            )
            return upstream, response
        except requests.ConnectionError as error:  # ConnectTimeout is one too
            pool.release(upstream)
            if _never_connected(error):
                pool.mark_down(upstream)  # the health check brings it back
            elif upstream.url not in reset:
                log.info("upstream %s: %s; trying it again", upstream.url, error)
                reset.add(upstream.url)
                continue
            log.info("upstream %s: %s; trying another", upstream.url, error)
            tried.add(upstream.url)
        except requests.ReadTimeout as error:
            pool.release(upstream)
            raise UpstreamTimeout("the inference server did not answer in time") from error


def _never_connected(error: requests.RequestException) -> bool:
    if isinstance(error, requests.ConnectTimeout):
        return True
    reason = getattr(error.args[0], "reason", None) if error.args else None
    return isinstance(reason, urllib3.exceptions.NewConnectionError)


class UpstreamBrokeOff(ConnectionResetError):
    """The upstream's answer stopped before its end (it died, or shut down mid-stream).

    Raised from the body so that the server closes the client's connection
    without the last chunk: the client sees the answer cut, as a direct client
    would, never a clean but shortened end. A ConnectionResetError, because for
    the server that is what it is, a lost connection (gunicorn logs it at debug
    level, with no traceback; the warning here says which upstream).
    """


def upstream_release(
    pool: UpstreamPool, upstream: Upstream, response: requests.Response
) -> Callable[[], None]:
    """Closes the upstream's answer and frees the upstream, once, whichever caller comes first: the
    body's end, or the server closing an answer whose body it never read (HEAD, 204, 304), which
    never starts the body's generator and so never reaches its `finally`."""
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            response.close()
            pool.release(upstream)

    return release


def stream_body(
    upstream: Upstream, response: requests.Response, release: Callable[[], None]
) -> Iterator[bytes]:
    """The upstream's body, chunk by chunk as it arrives; `release` at the end or on hang-up."""
    raw = response.raw
    try:
        yield b""  # the status and headers go out now (gunicorn sends them on the first write)
        if raw.chunked:
            yield from raw.read_chunked(None, decode_content=False)
        else:
            while chunk := raw.read1(65536, decode_content=False):
                yield chunk
    except (urllib3.exceptions.HTTPError, OSError) as error:
        log.warning("upstream %s broke off a response: %s", upstream.url, error)
        raise UpstreamBrokeOff(errno.ECONNRESET, f"the upstream broke off: {error}") from error
    finally:
        # Also runs when the client hangs up (the server closes this generator): closing
        # the upstream connection tells the inference server to free the row.
        release()

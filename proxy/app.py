"""The proxy's WSGI app: check the JWT, forward to an inference server, stream the answer back."""

from __future__ import annotations

import gc
import http.cookiejar
import logging
import re
import time
import uuid
from collections.abc import Callable

import requests
from flask import Flask, Response, g, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException
from werkzeug.wsgi import ClosingIterator

from proxy.auth import AuthError, Caller, authenticate, needs_token
from proxy.config import ProxyConfig, load_secret
from proxy.cors import Cors
from proxy.errors import error_body
from proxy.forward import (
    UpstreamTimeout,
    UpstreamUnavailable,
    client_response_headers,
    send,
    stream_body,
    upstream_release,
    upstream_request_headers,
)
from proxy.stream_cost import streams_of
from proxy.team_gate import Refused
from proxy.teams import Teams
from proxy.upstreams import UpstreamPool

log = logging.getLogger("proxy")

METRICS_ELSEWHERE = (
    "/metrics is not served through the proxy: scrape each inference server directly, and the proxy's "
    "own on its probe port (--health-port)"
)

# The inference server's endpoints for its operator: a team's token must not load a file of the server's
# disk as an adapter, nor unload another team's (--allow-runtime-lora).
OPERATOR_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
OPERATOR_ONLY = "{path} is the operator's, not forwarded by the proxy: call the inference server directly"

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    response = jsonify(error_body(status, message))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def current_request_id() -> str:
    """This request's id: the client's X-Request-ID if it is sane, else a new one."""
    if "request_id" not in g:
        client_id = request.headers.get("X-Request-ID", "")
        g.request_id = client_id if SANE_REQUEST_ID.match(client_id) else uuid.uuid4().hex
    return g.request_id


def tag_response(response: Response) -> Response:
    """Every answer carries the id, the proxy's own too (/health, 413), as the server's do."""
    if "X-Request-ID" not in response.headers:
        response.headers["X-Request-ID"] = current_request_id()
    return response


def release_on_close(response: Response, release: Callable[[], None]) -> Response:
    """`release` runs when the server closes the answer: sent whole, or its client gone. Not through
    call_on_close, which werkzeug skips for a direct_passthrough answer (it hands the body over as is)."""
    if response.direct_passthrough:
        response.response = ClosingIterator(response.response, release)
    else:
        response.call_on_close(release)
    return response


def create_app(config: ProxyConfig | None = None, secret: str | None = None) -> Flask:
    config = config or ProxyConfig.from_env()
    secret = secret or load_secret()
    app = Flask(__name__, static_folder=None)  # /static/ is the chat page's, upstream
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    pool = UpstreamPool(
        list(config.upstreams), check_interval=config.check_interval, discover=config.discover
    )
    pool.check_all()
    pool.start_health_checks()
    app.extensions["upstreams"] = pool
    teams = Teams(config)
    app.extensions["teams"] = teams
    app.after_request(tag_response)

    @app.after_request
    def count_team_request(response: Response) -> Response:
        if "team" in g:  # a valid token: its team's answers, the proxy's refusals and errors too
            teams.metrics.count_request(g.team, response.status_code)
        return response

    session = requests.Session()
    # One session serves every client: a cookie an upstream sets for one must never go out with
    # another's request. The client's own Cookie header is forwarded as it is.
    session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    # Up to one pooled connection per client connection and upstream, so streams never queue for
    # sockets and none is opened only to be thrown away.
    adapter = requests.adapters.HTTPAdapter(pool_connections=64, pool_maxsize=config.max_connections)
    session.mount("http://", adapter)
    session.mount("https://", adapter)

    @app.get("/health")
    def health():
        return jsonify(status="ok")

    if config.health_port:
        probe_port = str(config.health_port)

        @app.before_request
        def probe_port_answers_health_and_metrics_only():
            # SERVER_PORT is the port of the listener the connection came in on, not the Host header.
            if request.environ.get("SERVER_PORT") != probe_port or request.path == "/health":
                return None
            if request.path == "/metrics":  # the proxy's own; on the traffic port, none
                return Response(generate_latest(teams.metrics.registry), content_type=CONTENT_TYPE_LATEST)
            return error_response(404, "this port answers /health and /metrics only")

    cors = Cors(config.allowed_origins)

    @app.before_request
    def answer_browsers_preflight():
        return cors.preflight(request)  # before the token check: a preflight carries none

    @app.after_request
    def let_allowed_origins_read(response: Response) -> Response:
        return cors.tag(response, request.headers.get("Origin"))

    @app.route("/", defaults={"path": ""}, methods=ALL_METHODS)
    @app.route("/<path:path>", methods=ALL_METHODS)
    def forward(path: str):
        started = time.monotonic()
        request_id = current_request_id()
        if not needs_token(request.method, request.path):
            return pass_on(None, started, request_id)  # a public path (the chat page): no token, no team
        caller: Caller | None = None
        try:
            caller = authenticate(
                request.headers.get("Authorization"), secret, request.headers.get("X-Api-Key")
            )
            g.team = caller.team_label
            # The body is read before admission (cached for pass_on): its prompts x n are the streams.
            ticket = teams.admit(caller, streams_of(request.path, request.get_data(cache=True)))
        except AuthError as error:
            who = f"team={caller.team_label} token={caller.token_label} " if caller else ""  # revoked
            log.info("401 %s%s %s: %s (request %s)", who, request.method, request.path, error, request_id)
            return error_response(401, str(error), {"WWW-Authenticate": "Bearer", "X-Request-ID": request_id})
        except Refused as refusal:
            log.info(
                "%d team=%s %s %s: %s (request %s)",
                refusal.status,
                caller.team_label,
                request.method,
                request.path,
                refusal.reason,
                request_id,
            )
            headers = {"X-Request-ID": request_id}
            if refusal.retry_after is not None:
                headers["Retry-After"] = str(refusal.retry_after)
            return error_response(refusal.status, refusal.message, headers)
        if request.path == "/metrics":
            # Forwarded, an inference server's would show every team's usage to any token.
            ticket.release()
            return error_response(404, METRICS_ELSEWHERE, {"X-Request-ID": request_id})
        if re.sub("/+", "/", request.path).rstrip("/") in OPERATOR_PATHS:  # however the path is spelled
            ticket.release()
            return error_response(403, OPERATOR_ONLY.format(path=request.path), {"X-Request-ID": request_id})
        try:
            response = pass_on(caller, started, request_id)
        except BaseException:
            ticket.release()
            raise
        return release_on_close(response, ticket.release)

    def pass_on(caller: Caller | None, started: float, request_id: str) -> Response:
        """The request sent upstream, and the upstream's answer streaming back (or the proxy's error).
        caller None: a public path, forwarded without a team."""
        body = request.get_data(cache=False)  # 413 past MAX_CONTENT_LENGTH
        team_id = caller.team_label if caller else None
        headers = upstream_request_headers(dict(request.headers), team_id, request_id)
        target = request.full_path if request.query_string else request.path
        try:
            upstream, response = send(
                pool,
                session,
                request.method,
                target,
                headers,
                body,
                (config.connect_timeout, config.read_timeout),
            )
        except UpstreamUnavailable as error:
            # The health thread finds an upstream that comes back within a check interval.
            retry_after = str(max(1, round(config.check_interval)))
            return error_response(502, str(error), {"X-Request-ID": request_id, "Retry-After": retry_after})
        except UpstreamTimeout as error:
            return error_response(504, str(error), {"X-Request-ID": request_id})
        log.info(
            "team=%s token=%s %s %s -> %s %d in %.0f ms (request %s)",
            team_id or "-",
            caller.token_label if caller else "-",
            request.method,
            request.path,
            upstream.url,
            response.status_code,
            (time.monotonic() - started) * 1000,
            request_id,
        )
        release = upstream_release(pool, upstream, response)
        answer = Response(
            stream_body(upstream, response, release),
            status=response.status_code,
            headers=client_response_headers(response.headers, request_id),
            direct_passthrough=True,
        )
        return release_on_close(answer, release)

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException):
        return error_response(error.code or 500, error.description or error.name)

    # What the app holds lives as long as it: out of the cycle collector's sight (docs/frontend.md).
    gc.freeze()
    return app

"""Browsers' cross-origin requests (CORS): a team's web app, at an origin of its own, calling the API.

A page at https://tools.example.com that sends `fetch(".../v1/chat/completions", {headers: {Authorization:
"Bearer ..."}})` to the proxy's origin is let through by the browser only if the proxy says that origin
may: first to the browser's preflight, an OPTIONS request that carries no token (so it is answered here,
before the token check), then on the answer itself. `--allowed-origins` (vLLM's option's name) lists the
origins that may, or `*` for any; none by default, and then nothing changes: a preflight needs a token
like any request, and the browser keeps the answer from the page.

The tokens are headers, never cookies, so a page can send one only if it holds it: allowing an origin
lets its pages use their own tokens, never a visitor's. So credentials are not allowed (no
Access-Control-Allow-Credentials), and the headers a preflight asks for are allowed as asked (the SDKs'
own, such as OpenAI's x-stainless-* and Anthropic's anthropic-version, beside Authorization).
"""

from __future__ import annotations

import json
import re

from flask import Request, Response

from proxy.errors import error_body

ANY = "*"
METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED = "X-Request-ID, Retry-After"  # what a page may read of an answer, besides the safelisted headers
MAX_AGE = "600"  # seconds a browser may keep a preflight's answer
ORIGIN = re.compile(r"^https?://[^/\s?#]+$")  # scheme://host[:port]: what a browser's Origin header holds
HEADER_NAMES = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$")


def check_origins(origins: tuple[str, ...]) -> None:
    """ValueError naming an entry that is neither `*` nor an origin (`https://host[:port]`, no path)."""
    for origin in origins:
        if origin != ANY and not ORIGIN.match(origin):
            raise ValueError(
                f"--allowed-origins {origin!r}: an origin is scheme://host[:port] with no path "
                "(https://tools.example.com), or * for any"
            )


class Cors:
    """What the proxy tells browsers about `origins` (--allowed-origins): () allows none."""

    def __init__(self, origins: tuple[str, ...]):
        check_origins(origins)
        self.any = ANY in origins
        self.origins = {origin.rstrip("/").lower() for origin in origins}

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.lower() in self.origins)

    def preflight(self, request: Request) -> Response | None:
        """The answer to a browser's preflight: 204 saying what the origin may send, or 403 naming an
        origin that may not; None for any other request, and for every request where none may."""
        if not self.origins or request.method != "OPTIONS":
            return None
        origin = request.headers.get("Origin")
        if origin is None or "Access-Control-Request-Method" not in request.headers:
            return None  # a plain OPTIONS request: forwarded, with its token, as any other
        if not self.allows(origin):
            message = f"the origin {origin} may not call this API from a browser (not in --allowed-origins)"
            return Response(json.dumps(error_body(403, message)), status=403, mimetype="application/json")
        answer = Response(status=204)
        answer.headers["Access-Control-Allow-Methods"] = METHODS
        asked = request.headers.get("Access-Control-Request-Headers", "")
        if asked and HEADER_NAMES.match(asked):
            answer.headers["Access-Control-Allow-Headers"] = asked
        answer.headers["Access-Control-Max-Age"] = MAX_AGE
        return answer

    def tag(self, response: Response, origin: str | None) -> Response:
        """`response` let through to a page of `origin`, where it may be."""
        if not self.origins:
            return response
        response.vary.add("Origin")  # the answer differs by origin: a cache must keep them apart
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
        return response

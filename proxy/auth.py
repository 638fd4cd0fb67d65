"""Who is calling: a JWT, HS256, signed with JWT_SECRET, naming a team and a token; sent as a Bearer
token, or alone in `x-api-key` as Anthropic's clients send their key."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

import jwt

REQUIRED_CLAIMS = ("team_id", "token_id")
# What a browser loads before it can have a token: the chat page, its files and the API's description
# (SPEC §4.4). They hold no data and start no generation; everything else needs a token. A file name
# has no slash and no leading dot, so no path that leaves /static/ can pass for one.
PUBLIC_PATH = re.compile(r"/|/openapi\.json|/static/[A-Za-z0-9_-]+\.[A-Za-z0-9]+")
PUBLIC_METHODS = frozenset({"GET", "HEAD"})


class AuthError(Exception):
    """The request carries no acceptable token; the message says why, never the token."""


@dataclass(frozen=True)
class Caller:
    team_id: str
    token_id: str

    @property
    def team_label(self) -> str:
        """The team as X-Team-ID carries it and the log prints it: UTF-8 percent-encoded past RFC 3986's
        unreserved characters ("team-a" stays as it is, "研究" is %E7%A0%94%E7%A9%B6), so that no team
        id can break a header (which takes Latin-1 without CR or LF) or forge a log line."""
        return quote(self.team_id, safe="")

    @property
    def token_label(self) -> str:
        return quote(self.token_id, safe="")


def needs_token(method: str, path: str) -> bool:
    return not (method in PUBLIC_METHODS and PUBLIC_PATH.fullmatch(path))


def authenticate(authorization: str | None, secret: str, api_key: str | None = None) -> Caller:
    """The caller of `Authorization: Bearer <token>`, or of the token alone as `x-api-key`, the header
    Anthropic's clients send their key in (when both come, Authorization is the one read)."""
    token = _token(authorization, api_key)
    try:
        # Only HS256: a token saying alg "none" or any other algorithm is refused.
        claims = jwt.decode(token, secret, algorithms=["HS256"], options={"require": list(REQUIRED_CLAIMS)})
    except jwt.ExpiredSignatureError:
        raise AuthError("the token has expired") from None
    except jwt.ImmatureSignatureError:
        raise AuthError("the token is not valid yet (its nbf or iat is in the future)") from None
    except jwt.MissingRequiredClaimError as error:
        raise AuthError(f"the token lacks the {error.claim!r} claim") from None
    except jwt.InvalidAlgorithmError:
        raise AuthError("the token must be signed with HS256") from None
    except jwt.InvalidSignatureError:
        raise AuthError("the token's signature is not valid") from None
    except jwt.InvalidTokenError:
        raise AuthError("the token is malformed") from None
    team_id, token_id = claims["team_id"], claims["token_id"]
    if not isinstance(team_id, str) or not team_id or not isinstance(token_id, str) or not token_id:
        raise AuthError("team_id and token_id must be non-empty strings")
    return Caller(team_id, token_id)


def _token(authorization: str | None, api_key: str | None) -> str:
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("the Authorization header must be 'Bearer <token>'")
        return token.strip()
    if api_key and api_key.strip():
        return api_key.strip()
    raise AuthError(
        "missing Authorization header: send 'Authorization: Bearer <token>' (or the token as x-api-key)"
    )

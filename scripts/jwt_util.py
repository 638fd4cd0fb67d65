#!/usr/bin/env python
"""Issue and read the proxy's team tokens (HS256 JWTs).

    scripts/jwt_util.py token --team TEAM [--token-id ID] [--hours H]     # what `make token TEAM=...` runs
    scripts/jwt_util.py --secret S encode '{"team_id": "t", "token_id": "x"}' [--exp SECONDS]
    scripts/jwt_util.py --secret S decode TOKEN
    scripts/jwt_util.py id TOKEN                                          # no secret needed

The secret comes from --secret, else JWT_SECRET (environment or .env, as the
proxy reads it). `token` mints a team's token with a fresh token id (the id
the proxy logs, and revokes), the token alone on standard output (for
`TOKEN=$(make token TEAM=...)`) and its team, id and expiry on standard
error; `decode` checks the signature and expiry, and prints the claims as
JSON; `id` prints a token's id without checking anything, to revoke a token
someone hands in, expired or signed with a secret since rotated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from datetime import UTC, datetime

import jwt
from dotenv import dotenv_values

REQUIRED_CLAIMS = ("team_id", "token_id")


def encode(secret: str, claims: dict, expires_in: int | None = None) -> str:
    missing = [claim for claim in REQUIRED_CLAIMS if not claims.get(claim)]
    if missing:
        raise ValueError(f"claims must include {', '.join(missing)}")
    claims = dict(claims)
    claims.setdefault("iat", int(time.time()))
    if expires_in is not None:
        claims["exp"] = int(time.time()) + expires_in
    return jwt.encode(claims, secret, algorithm="HS256")


def team_token(secret: str, team: str, token_id: str | None = None, hours: float = 24) -> str:
    """A token for one team, valid for `hours`; its id names this token alone unless one is given."""
    token_id = token_id or f"{team}-{uuid.uuid4().hex[:12]}"
    return encode(secret, {"team_id": team, "token_id": token_id}, round(hours * 3600))


def decode(secret: str, token: str) -> dict:
    return jwt.decode(token, secret, algorithms=["HS256"], options={"require": list(REQUIRED_CLAIMS)})


def token_id(token: str) -> str:
    """The id a token carries, read without its secret: nothing about it is verified."""
    claims = jwt.decode(token, options={"verify_signature": False})
    if not claims.get("token_id"):
        raise ValueError("the token carries no token_id")
    return claims["token_id"]


def describe(token: str) -> str:
    """What an operator keeps of a token they issue: its team, id (to revoke it) and expiry."""
    claims = jwt.decode(token, options={"verify_signature": False})
    expires = datetime.fromtimestamp(claims["exp"], UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"team {claims['team_id']}, token id {claims['token_id']}, expires {expires}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--secret", help="the HS256 secret (default: JWT_SECRET from the environment or .env)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    encoder = commands.add_parser("encode", help="print a token for these claims (a JSON object)")
    encoder.add_argument("claims")
    encoder.add_argument("--exp", type=int, metavar="SECONDS", help="expire this many seconds from now")
    minter = commands.add_parser("token", help="print a new token for a team")
    minter.add_argument("--team", required=True)
    minter.add_argument("--token-id", help="the id the proxy logs (default: the team and a random suffix)")
    minter.add_argument("--hours", type=float, default=24, help="how long it is valid (default: 24)")
    decoder = commands.add_parser("decode", help="verify a token and print its claims")
    decoder.add_argument("token")
    reader = commands.add_parser("id", help="print a token's id, unverified (to revoke it); no secret needed")
    reader.add_argument("token")
    args = parser.parse_args(argv)

    try:
        if args.command == "id":
            print(token_id(args.token))
            return 0
    except (ValueError, jwt.InvalidTokenError) as error:
        print(f"jwt_util: {error}", file=sys.stderr)
        return 1
    secret = args.secret or os.environ.get("JWT_SECRET") or dotenv_values(".env").get("JWT_SECRET")
    if not secret:
        parser.error("no secret: pass --secret or set JWT_SECRET")
    try:
        if args.command == "token":
            if args.hours <= 0:
                raise ValueError("--hours must be positive")
            token = team_token(secret, args.team, args.token_id, args.hours)
            print(token)
            print(describe(token), file=sys.stderr)
        elif args.command == "encode":
            claims = json.loads(args.claims)
            if not isinstance(claims, dict):
                raise ValueError("claims must be a JSON object")
            print(encode(secret, claims, args.exp))
        else:
            print(json.dumps(decode(secret, args.token), indent=2, sort_keys=True))
    except (ValueError, jwt.InvalidTokenError) as error:
        print(f"jwt_util: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

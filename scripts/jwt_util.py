#!/usr/bin/env python
"""Issue and read the proxy's team tokens (HS256 JWTs).

    scripts/jwt_util.py --secret S encode '{"team_id": "t", "token_id": "x"}' [--exp SECONDS]
    scripts/jwt_util.py --secret S decode TOKEN

The secret may also come from JWT_SECRET (environment or .env). `decode`
checks the signature and expiry, and prints the claims as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

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


def decode(secret: str, token: str) -> dict:
    return jwt.decode(token, secret, algorithms=["HS256"], options={"require": list(REQUIRED_CLAIMS)})


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
    decoder = commands.add_parser("decode", help="verify a token and print its claims")
    decoder.add_argument("token")
    args = parser.parse_args(argv)

    secret = args.secret or os.environ.get("JWT_SECRET") or dotenv_values(".env").get("JWT_SECRET")
    if not secret:
        parser.error("no secret: pass --secret or set JWT_SECRET")
    try:
        if args.command == "encode":
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

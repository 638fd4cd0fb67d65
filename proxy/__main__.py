"""`python -m proxy [--upstream URL ...] [--port N]`: the JWT proxy under gunicorn (SPEC §2, §6)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from proxy.config import DEFAULT_PORT, DEFAULT_UPSTREAM, ProxyConfig, load_secret
from proxy.cors import check_origins
from proxy.limits import parse_team_limits
from proxy.tls import server_context

GUNICORN_CONF = Path(__file__).resolve().parent / "gunicorn_conf.py"


def build_parser() -> argparse.ArgumentParser:
    """Every option of `python -m proxy` (docs/configuration.md lists each)."""
    parser = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    parser.add_argument(
        "--upstream",
        action="append",
        help=f"an inference server; repeat for replicas (default {DEFAULT_UPSTREAM})",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-body-bytes", type=int, default=ProxyConfig.max_body_bytes)
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=ProxyConfig.read_timeout,
        help="seconds without a byte from the upstream before 504",
    )
    parser.add_argument(
        "--check-interval",
        type=float,
        default=ProxyConfig.check_interval,
        help="seconds between /ready checks of each upstream",
    )
    parser.add_argument(
        "--discover",
        action="store_true",
        help="treat each upstream's host name as all the addresses it resolves to, looked up at every "
        "check (a Kubernetes headless Service)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=ProxyConfig.max_connections,
        help="client connections served at once, streams and idle ones alike; more wait to be accepted",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=ProxyConfig.header_timeout,
        help="seconds a connection has to send a request's line and headers (also the keep-alive idle time)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=ProxyConfig.body_timeout,
        help="seconds a request has to send its body after its headers (408 past that)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=ProxyConfig.health_port,
        help="a second port, plain HTTP, that answers only /health and the proxy's /metrics, outside "
        "--max-connections, for a liveness probe and Prometheus (default: none)",
    )
    parser.add_argument(
        "--revoked-tokens",
        metavar="PATH",
        help="a file of revoked token_ids, one a line, # for comments; read again when it changes "
        "(default: none)",
    )
    parser.add_argument(
        "--team-limits",
        metavar="PATH",
        help="a TOML file of per-team limits on concurrent requests and requests per minute; read again "
        "when it changes (default: no limits)",
    )
    parser.add_argument(
        "--certfile",
        metavar="PATH",
        help="a PEM certificate (chain): TLS on the traffic port, with --keyfile",
    )
    parser.add_argument("--keyfile", metavar="PATH", help="the certificate's PEM private key, unencrypted")
    parser.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="origins whose web pages browsers let call the API with a team's token (CORS), as "
        "https://tools.example.com, or * for any (vLLM's option's name; default: none)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> ProxyConfig:
    args = build_parser().parse_args(argv)
    return ProxyConfig(
        upstreams=tuple(args.upstream or [DEFAULT_UPSTREAM]),
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        read_timeout=args.read_timeout,
        check_interval=args.check_interval,
        discover=args.discover,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        health_port=args.health_port,
        revoked_tokens=args.revoked_tokens,
        team_limits=args.team_limits,
        certfile=args.certfile,
        keyfile=args.keyfile,
        allowed_origins=tuple(args.allowed_origins or ()),
    )


def check_files(config: ProxyConfig) -> None:
    """Raise, with a message for the operator, on a file the worker could not use (not on one missing
    from --revoked-tokens or --team-limits: that is none yet, and the worker warns about it)."""
    config.check_tls()
    check_origins(config.allowed_origins)
    if config.certfile:
        try:
            server_context(config.certfile, config.keyfile)
        except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
            raise ValueError(f"--certfile {config.certfile} --keyfile {config.keyfile}: {error}") from None
    if config.team_limits and os.path.exists(config.team_limits):
        try:
            with open(config.team_limits, encoding="utf-8") as file:
                parse_team_limits(file.read())
        except (OSError, ValueError) as error:
            raise ValueError(f"--team-limits {config.team_limits}: {error}") from None


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        load_secret()  # refuse to start here, with a clear message, rather than in the worker
        check_files(config)
    except (SystemExit, ValueError) as error:
        print(f"proxy: {error}", file=sys.stderr)
        sys.exit(2)
    os.environ.update(config.to_env())
    os.execv(sys.executable, [sys.executable, "-m", "gunicorn", "--config", str(GUNICORN_CONF)])


if __name__ == "__main__":
    main()

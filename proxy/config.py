"""The proxy's settings, from `python -m proxy` options or PROXY_* environment variables.

JWT_SECRET comes from the environment or a `.env` file and has no default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from dotenv import dotenv_values

log = logging.getLogger("proxy")

DEFAULT_PORT = 8080
DEFAULT_UPSTREAM = "http://127.0.0.1:8000"
MIN_SECRET_BYTES = 32


class MissingSecret(SystemExit):
    pass


def load_secret() -> str:
    """JWT_SECRET from the environment, else from .env; refuse to run without one."""
    secret = os.environ.get("JWT_SECRET") or dotenv_values(".env").get("JWT_SECRET")
    if not secret:
        raise MissingSecret(
            "JWT_SECRET is not set: put it in the environment or in .env "
            "(for example: echo JWT_SECRET=$(openssl rand -hex 32) >> .env)"
        )
    if len(secret.encode()) < MIN_SECRET_BYTES:
        log.warning(
            "JWT_SECRET is %d bytes; use at least %d for HS256", len(secret.encode()), MIN_SECRET_BYTES
        )
    return secret


@dataclass(frozen=True)
class ProxyConfig:
    upstreams: tuple[str, ...] = (DEFAULT_UPSTREAM,)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_body_bytes: int = 1024 * 1024
    connect_timeout: float = 5.0
    # Seconds without a byte from the upstream: a long non-streamed answer is silent until it is done.
    read_timeout: float = 600.0
    check_interval: float = 2.0
    discover: bool = False  # each upstream host name stands for all its addresses (Kubernetes)
    # Slow or idle clients (docs/deploy.md, "Slow clients"): each connection is a greenlet, so holding
    # one costs memory, not a thread. A connection must send a request's line and headers within
    # header_timeout of opening (or of its previous answer), and its body within body_timeout of them.
    max_connections: int = 4000  # at once, streams included; past that, connections wait to be accepted
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    # A second port that answers only /health, for the liveness probe: its connections are counted
    # apart, so it answers while max_connections are in use. 0: none.
    health_port: int = 0
    # Files an operator edits while the proxy runs (read again when they change); None: none.
    revoked_tokens: str | None = None  # token_ids, one a line (proxy/revoked.py)
    team_limits: str | None = None  # TOML (proxy/limits.py)
    # TLS on the traffic port: a PEM certificate (chain) and its unencrypted key; None: plain HTTP.
    certfile: str | None = None
    keyfile: str | None = None
    # Origins whose pages browsers let call the API (proxy/cors.py), "*" for any; (): none
    allowed_origins: tuple[str, ...] = ()

    def to_env(self) -> dict[str, str]:
        return {
            "PROXY_UPSTREAMS": " ".join(self.upstreams),
            "PROXY_HOST": self.host,
            "PROXY_PORT": str(self.port),
            "PROXY_MAX_BODY_BYTES": str(self.max_body_bytes),
            "PROXY_CONNECT_TIMEOUT": str(self.connect_timeout),
            "PROXY_READ_TIMEOUT": str(self.read_timeout),
            "PROXY_CHECK_INTERVAL": str(self.check_interval),
            "PROXY_DISCOVER": "1" if self.discover else "0",
            "PROXY_MAX_CONNECTIONS": str(self.max_connections),
            "PROXY_HEADER_TIMEOUT": str(self.header_timeout),
            "PROXY_BODY_TIMEOUT": str(self.body_timeout),
            "PROXY_HEALTH_PORT": str(self.health_port),
            "PROXY_REVOKED_TOKENS": self.revoked_tokens or "",
            "PROXY_TEAM_LIMITS": self.team_limits or "",
            "PROXY_CERTFILE": self.certfile or "",
            "PROXY_KEYFILE": self.keyfile or "",
            "PROXY_ALLOWED_ORIGINS": " ".join(self.allowed_origins),
        }

    @classmethod
    def from_env(cls) -> ProxyConfig:
        env = os.environ
        default = cls()
        return cls(
            upstreams=tuple(env.get("PROXY_UPSTREAMS", DEFAULT_UPSTREAM).split()),
            host=env.get("PROXY_HOST", default.host),
            port=int(env.get("PROXY_PORT", default.port)),
            max_body_bytes=int(env.get("PROXY_MAX_BODY_BYTES", default.max_body_bytes)),
            connect_timeout=float(env.get("PROXY_CONNECT_TIMEOUT", default.connect_timeout)),
            read_timeout=float(env.get("PROXY_READ_TIMEOUT", default.read_timeout)),
            check_interval=float(env.get("PROXY_CHECK_INTERVAL", default.check_interval)),
            discover=env.get("PROXY_DISCOVER", "0") == "1",
            max_connections=int(env.get("PROXY_MAX_CONNECTIONS", default.max_connections)),
            header_timeout=float(env.get("PROXY_HEADER_TIMEOUT", default.header_timeout)),
            body_timeout=float(env.get("PROXY_BODY_TIMEOUT", default.body_timeout)),
            health_port=int(env.get("PROXY_HEALTH_PORT", default.health_port)),
            revoked_tokens=env.get("PROXY_REVOKED_TOKENS") or None,
            team_limits=env.get("PROXY_TEAM_LIMITS") or None,
            certfile=env.get("PROXY_CERTFILE") or None,
            keyfile=env.get("PROXY_KEYFILE") or None,
            allowed_origins=tuple(env.get("PROXY_ALLOWED_ORIGINS", "").split()),
        )

    def check_tls(self) -> None:
        """Both files or neither (ValueError otherwise)."""
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("--certfile and --keyfile go together: give both for TLS, or neither")

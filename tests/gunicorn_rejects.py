"""Requests gunicorn itself rejects, before any app sees them, and a raw exchange to send them as they are.

Both servers' tests (tests/frontend/test_worker_e2e.py, tests/proxy/test_gunicorn_errors.py) check that
these are answered in JSON (gunicorn_json_errors.py).
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import pytest

REJECTED = pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),  # request line over 4,094 bytes
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),  # a field over 8,190
        (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
        (b"NONSENSE\r\n\r\n", 400),  # no method, path and version
    ],
    ids=["line-too-long", "header-too-large", "too-many-headers", "malformed-line"],
)


def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are and read the answer to the end (gunicorn closes after its errors)."""
    parts = urlparse(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, body

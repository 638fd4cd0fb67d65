"""TLS for the proxy's traffic port (`--certfile`, `--keyfile`): bearer tokens never cross a network in
clear (docs/deploy.md, "TLS").

The worker wraps each connection of the traffic port itself, after gevent has patched `ssl`, so that
the handshake has the header deadline (a client that opens a connection and never says hello is closed
like one that never sends its headers) and the probe port stays plain HTTP for the cluster's probes.
What it loads is the master's copy of the last good pair (proxy/served_pair.py).
"""

from __future__ import annotations

import ssl


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """TLS 1.2 or later with the standard library's server defaults; HTTP/1.1 only (no HTTP/2 here)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile, keyfile)
    context.set_alpn_protocols(["http/1.1"])
    return context


def load_problem(certfile: str, keyfile: str) -> str | None:
    """Why the pair does not load (a file missing, not PEM, a key that is not the certificate's), or
    None."""
    try:
        server_context(certfile, keyfile)
    except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
        return str(error)
    return None

"""TLS for the proxy's traffic port (`--certfile`, `--keyfile`): bearer tokens never cross a network in
clear (docs/deploy.md, "TLS").

The worker wraps each connection of the traffic port itself, after gevent has patched `ssl`, so that
the handshake has the header deadline (a client that opens a connection and never says hello is closed
like one that never sends its headers) and the probe port stays plain HTTP for the cluster's probes.
What it loads is the master's copy of the last good pair (proxy/served_pair.py).
"""

from __future__ import annotations

import ssl

# Plenty for a TLS 1.2 or 1.3 handshake, which takes two or three flights each way.
HANDSHAKE_ROUNDS = 8


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


def client_objection(certfile: str, keyfile: str) -> str | None:
    """What a client that trusts this very certificate says of it now ("certificate has expired",
    "certificate is not yet valid"), or None. A handshake in memory: OpenSSL's own checks, with no
    parser of certificates here (the proxy's image has no `cryptography`)."""
    client = ssl.create_default_context(cafile=certfile)
    client.check_hostname = False  # the names are the operator's business, the dates are checked here
    client.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the server's own certificate as the anchor
    try:
        handshake_in_memory(client, server_context(certfile, keyfile))
    except ssl.SSLCertVerificationError as error:
        return error.verify_message
    return None


def handshake_in_memory(client: ssl.SSLContext, server: ssl.SSLContext) -> None:
    """A TLS handshake between the two contexts through buffers; raises what either side raises."""
    to_client, to_server = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_end = client.wrap_bio(to_client, to_server)
    server_end = server.wrap_bio(to_server, to_client, server_side=True)
    for _ in range(HANDSHAKE_ROUNDS):
        done = True
        for end in (client_end, server_end):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                done = False
        if done:
            return
    raise ssl.SSLError(f"the handshake did not finish in {HANDSHAKE_ROUNDS} rounds")

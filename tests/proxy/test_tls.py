"""The proxy terminates TLS itself (issue 19, item 9): `--certfile` and `--keyfile` on the traffic port,
a self-signed certificate made here, real tokens, a real stream; the probe port stays plain HTTP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests

from tests.proxy.conftest import bearer, running_proxy, start_refused
from tests.server_fixture import free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


SUBJECT = ["-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
# `openssl req` cannot date a certificate in the past; `openssl ca` can, with a database of its own.
EXPIRED_CA_CONFIG = """
[ca]
default_ca = expired
[expired]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = anything
copy_extensions = copy
[anything]
commonName = supplied
"""


def make_certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, valid for a day, and its key."""
    cert, key = folder / f"{name}-cert.pem", folder / f"{name}-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *SUBJECT]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


def make_expired_certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """The same, valid only in January 2020."""
    cert, key, request = folder / f"{name}-cert.pem", folder / f"{name}-key.pem", folder / f"{name}.csr"
    authority = folder / f"{name}-ca"
    authority.mkdir()
    (authority / "ca.cnf").write_text(EXPIRED_CA_CONFIG)
    (authority / "index.txt").write_text("")
    (authority / "serial").write_text("01\n")
    subprocess.run(
        ["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", *SUBJECT]
        + ["-keyout", str(key), "-out", str(request)],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["openssl", "ca", "-batch", "-notext", "-config", "ca.cnf", "-selfsign", "-keyfile", str(key)]
        + ["-in", str(request), "-startdate", "20200101000000Z", "-enddate", "20200201000000Z"]
        + ["-out", str(cert)],
        cwd=authority,
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"), "first")


@pytest.fixture(scope="module")
def tls_proxy(mock_server, certificate):
    cert, key = certificate
    probe_port = free_port()
    args = ("--certfile", str(cert), "--keyfile", str(key), "--health-port", str(probe_port))
    args += ("--header-timeout", "2")
    with running_proxy(mock_server.url, args=args, tls_cert=cert) as proxy:
        proxy.probe_url = f"http://127.0.0.1:{probe_port}"
        yield proxy


def test_https_with_a_token_streams_through(tls_proxy, certificate):
    cert, _ = certificate
    models = requests.get(f"{tls_proxy.url}/v1/models", headers=bearer(), verify=str(cert), timeout=10)
    assert models.status_code == 200 and models.json()["data"]
    with requests.post(
        f"{tls_proxy.url}/predictions/mock",
        json={"text": "hi", "max_tokens": 10, "stream": True},
        headers=bearer(),
        verify=str(cert),
        stream=True,
        timeout=10,
    ) as answer:
        chunks = [chunk for chunk in answer.iter_content(chunk_size=None) if chunk]
    assert answer.status_code == 200
    assert len(b"".join(chunks).split()) == 10 and len(chunks) > 1  # as generated, not buffered
    refused = requests.get(f"{tls_proxy.url}/v1/models", verify=str(cert), timeout=10)
    assert refused.status_code == 401


def test_plain_http_to_the_tls_port_gets_nothing_and_the_probe_port_stays_plain(tls_proxy, certificate):
    cert, _ = certificate
    plain = tls_proxy.url.replace("https://", "http://")
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{plain}/v1/models", headers=bearer(), timeout=10)
    with pytest.raises(requests.exceptions.SSLError):  # a certificate nobody vouched for
        requests.get(f"{tls_proxy.url}/health", timeout=10)
    assert requests.get(f"{tls_proxy.probe_url}/health", timeout=10).json() == {"status": "ok"}
    assert requests.get(f"{tls_proxy.url}/health", verify=str(cert), timeout=10).status_code == 200


def test_a_connection_that_never_says_hello_is_closed_at_the_header_deadline(tls_proxy, certificate):
    cert, _ = certificate
    port = int(tls_proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
        started = time.monotonic()
        # Its handshake waits in a greenlet of its own: the others go on meanwhile.
        assert requests.get(f"{tls_proxy.url}/health", verify=str(cert), timeout=1).status_code == 200
        assert silent.recv(1) == b""  # closed by the proxy, not by this timeout
        waited = time.monotonic() - started
    assert 1.5 <= waited < 5


def test_what_gunicorn_rejects_is_answered_in_json_over_tls_too(tls_proxy, certificate):
    cert, _ = certificate
    context = ssl.create_default_context(cafile=str(cert))
    port = int(tls_proxy.url.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as connection,
    ):
        connection.sendall(b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 414 ")
    assert json.loads(body)["status_code"] == 414


@pytest.mark.parametrize(
    "args, message",
    [
        (["--certfile", "cert.pem"], "--certfile and --keyfile go together"),
        (["--certfile", "missing.pem", "--keyfile", "missing.key"], "--certfile missing.pem"),
    ],
)
def test_the_proxy_refuses_to_start_without_a_usable_certificate_and_key(args, message, tmp_path):
    assert message in start_refused(*args, cwd=tmp_path)


def served_certificate(url: str) -> bytes:
    """The certificate the proxy shows in its handshake (DER), whatever it is."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    port = int(url.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw) as connection,
    ):
        return connection.getpeercert(binary_form=True)


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def hang_up(proxy) -> None:
    """The documented renewal step: SIGHUP to gunicorn's master; returns once its worker was replaced."""
    master = psutil.Process(proxy.process.pid)  # `python -m proxy` execs gunicorn: this is the master
    (worker,) = master.children()
    os.kill(master.pid, signal.SIGHUP)
    worker.wait(timeout=20)


def assert_serves_steadily(proxy, trusted: Path, seconds: float = 3.0) -> None:
    """HTTPS answers with `trusted` as the certificate, for `seconds`, from one worker that stays."""
    master = psutil.Process(proxy.process.pid)
    workers = set()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        health = requests.get(f"{proxy.url}/health", verify=str(trusted), timeout=3)
        models = requests.get(f"{proxy.url}/v1/models", headers=bearer(), verify=str(trusted), timeout=3)
        assert health.status_code == 200 and models.status_code == 200
        workers.update(child.pid for child in master.children())
        time.sleep(0.3)
    assert len(workers) == 1, f"workers came and went: {workers}\n{proxy.log()[-4000:]}"


def test_a_botched_renewal_leaves_the_last_good_pair_serving_and_a_good_one_is_taken(
    mock_server, certificate, tmp_path
):
    first_cert, first_key = certificate
    renewed_cert, renewed_key = make_certificate(tmp_path, "renewed")
    expired_cert, expired_key = make_expired_certificate(tmp_path, "expired")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"  # the operator's files
    shutil.copyfile(first_cert, cert)
    shutil.copyfile(first_key, key)
    args = ("--certfile", str(cert), "--keyfile", str(key))
    with running_proxy(mock_server.url, args=args, tls_cert=first_cert) as proxy:
        # The new certificate is in place, its key is not: they do not match.
        shutil.copyfile(renewed_cert, cert)
        hang_up(proxy)
        assert_serves_steadily(proxy, first_cert)  # before the fix: no worker stayed up to answer
        assert served_certificate(proxy.url) == der(first_cert)
        assert "KEY_VALUES_MISMATCH" in proxy.log() and "the last good pair" in proxy.log()

        # A pair that matches but expired long ago is no renewal either.
        shutil.copyfile(expired_cert, cert)
        shutil.copyfile(expired_key, key)
        hang_up(proxy)
        assert_serves_steadily(proxy, first_cert)
        assert "certificate has expired" in proxy.log()

        # The renewal done right: the new pair from the next hang-up on.
        shutil.copyfile(renewed_cert, cert)
        shutil.copyfile(renewed_key, key)
        hang_up(proxy)
        assert_serves_steadily(proxy, renewed_cert)
        assert served_certificate(proxy.url) == der(renewed_cert)


def test_an_expired_certificate_at_start_serves_with_a_warning(mock_server, tmp_path):
    cert, key = make_expired_certificate(tmp_path, "expired")
    args = ("--certfile", str(cert), "--keyfile", str(key))
    with running_proxy(mock_server.url, args=args, tls_cert=cert, trust_tls_cert=False) as proxy:
        with pytest.raises(requests.exceptions.SSLError, match="certificate has expired"):
            requests.get(f"{proxy.url}/health", verify=str(cert), timeout=10)
        assert served_certificate(proxy.url) == der(cert)  # served: there is no better one
        assert "certificate has expired" in proxy.log()

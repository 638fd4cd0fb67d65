"""The inference replicas behind the proxy, and which one takes the next request.

Each request goes to the ready upstream with the fewest requests in flight. A
health thread asks every upstream's /ready; one that fails (or refuses a
connection) is skipped until it answers again.

With `discover`, each configured URL stands for every address its host name
resolves to, looked up again at every check: pointed at a Kubernetes headless
Service, the proxy follows the replicas as they come and go.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from dataclasses import dataclass

import requests

log = logging.getLogger("proxy")


@dataclass
class Upstream:
    url: str
    ready: bool = True  # optimistic until the first check: a cold proxy should not refuse work
    answering: bool = True  # /ready answered at all (503 while its model loads): it can say why itself
    in_flight: int = 0


class NoUpstreamReady(Exception):
    pass


def resolve_replicas(url: str) -> list[str]:
    """One URL per address the URL's host resolves to (none if it does not resolve)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    addresses = sorted({info[4][0] for info in infos})
    return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}" for a in addresses]


class UpstreamPool:
    def __init__(
        self, urls: list[str], check_interval: float = 2.0, check_timeout: float = 2.0, discover: bool = False
    ):
        self.configured = [url.rstrip("/") for url in urls]
        self.discover = discover
        self.upstreams = [Upstream(url) for url in self._current_urls()]
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._checker: threading.Thread | None = None

    def start_health_checks(self) -> None:
        self._checker = threading.Thread(target=self._check_forever, name="upstream-health", daemon=True)
        self._checker.start()

    def stop(self) -> None:
        self._stopped.set()

    def acquire(self, exclude: set[str] = frozenset()) -> Upstream:
        """The least busy ready upstream, counted as busy until `release()`.

        With none ready, one that still answers (loading its model, or
        restarting a backend) takes the request: its own 503 and Retry-After
        tell the client more than the proxy could.
        """
        if not self._ready_ones(exclude):
            # All skipped: one may have recovered since the last check, so look now
            # rather than refuse requests until the next round.
            self.check_all()
        with self._lock:
            candidates = self._ready_ones(exclude) or [
                u for u in self.upstreams if u.answering and u.url not in exclude
            ]
            if not candidates:
                raise NoUpstreamReady
            upstream = min(candidates, key=lambda u: u.in_flight)
            upstream.in_flight += 1
            return upstream

    def _ready_ones(self, exclude: set[str]) -> list[Upstream]:
        return [u for u in self.upstreams if u.ready and u.url not in exclude]

    def release(self, upstream: Upstream) -> None:
        with self._lock:
            upstream.in_flight -= 1

    def mark_down(self, upstream: Upstream) -> None:
        if upstream.ready:
            log.warning("upstream %s is down; skipping it until /ready answers", upstream.url)
        upstream.ready = upstream.answering = False

    def _current_urls(self) -> list[str]:
        if not self.discover:
            return self.configured
        return [replica for url in self.configured for replica in resolve_replicas(url)]

    def refresh(self) -> None:
        """With discovery, follow the replicas: keep known ones (and their counts), add new ones."""
        if not self.discover:
            return
        urls = self._current_urls()
        with self._lock:
            known = {upstream.url: upstream for upstream in self.upstreams}
            self.upstreams = [known.get(url) or Upstream(url) for url in urls]
        added = set(urls) - set(known)
        if added:
            log.info("discovered upstreams: %s", ", ".join(sorted(added)))

    def check_all(self) -> None:
        self.refresh()
        for upstream in list(self.upstreams):
            try:
                ready = requests.get(f"{upstream.url}/ready", timeout=self.check_timeout).status_code == 200
                answering = True
            except requests.RequestException:
                ready = answering = False
            if ready != upstream.ready:
                log.info("upstream %s is %s", upstream.url, "ready" if ready else "not ready")
            upstream.ready, upstream.answering = ready, answering

    def _check_forever(self) -> None:
        while not self._stopped.is_set():
            self.check_all()
            self._stopped.wait(self.check_interval)

"""The proxy's Prometheus metrics: each team's requests, refusals and requests in flight.

They are served at /metrics on the probe port (`--health-port`), with no token: a port for the cluster's
probes and Prometheus, not in the Service. On the traffic port /metrics is a 404: an inference
server's, forwarded, would show every team's usage to any token. Tokens by team are counted where
they are known exactly, by the inference servers (`inference_team_prompt_tokens_total`,
`inference_team_completion_tokens_total`, from X-Team-ID), scraped directly.

A team label is the team as X-Team-ID carries it (percent-encoded, so any claim makes a safe label),
cut to MAX_TEAM_LABEL characters; team ids come from tokens only the operator can sign, so there are
as many label values as teams the operator made.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

MAX_TEAM_LABEL = 128


def team_label(team: str) -> str:
    return team[:MAX_TEAM_LABEL]


def status_class(status: int) -> str:
    return f"{status // 100}xx"


class ProxyMetrics:
    def __init__(self, in_flight: Callable[[], dict[str, int]]):
        """`in_flight`: each team's requests in flight now (TeamGate.in_flight), read at scrape time."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "proxy_team_requests",
            "Requests with a valid token, by team and status class (the proxy's refusals included)",
            ["team", "status"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "proxy_team_rejected",
            "Requests refused by the proxy, by team and reason (revoked, rate, concurrency, streams)",
            ["team", "reason"],
            registry=self.registry,
        )
        self.registry.register(_InFlight(in_flight))

    def count_request(self, team: str, status: int) -> None:
        self.requests.labels(team=team_label(team), status=status_class(status)).inc()

    def count_rejection(self, team: str, reason: str) -> None:
        self.rejected.labels(team=team_label(team), reason=reason).inc()


class _InFlight:
    """proxy_team_requests_in_flight, read from the gate when scraped, so it is never stale."""

    def __init__(self, in_flight: Callable[[], dict[str, int]]):
        self.in_flight = in_flight

    def collect(self):
        family = GaugeMetricFamily(
            "proxy_team_requests_in_flight",
            "Requests of each team in flight through the proxy (answer not yet sent whole)",
            labels=["team"],
        )
        by_label: dict[str, int] = {}
        for team, count in self.in_flight().items():
            by_label[team_label(team)] = by_label.get(team_label(team), 0) + count
        for label, count in sorted(by_label.items()):
            family.add_metric([label], count)
        yield family

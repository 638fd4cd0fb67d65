"""The Prometheus metrics of one app (SPEC §4.3).

Each app has its own CollectorRegistry, so that tests building several apps in
one process do not collide on metric names; under gunicorn there is one app.

Tokens are also counted by team, the team being the X-Team-ID header that the
proxy sets from the caller's token (it drops any the client sends). It is
trusted because only the proxy reaches this server (SPEC §6). Requests
without one (straight to this server) count in the totals only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds. TTFT spans a queue wait and a prefill; token gaps are one decode step.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Tokens of one request: 1, 2, 5 of each power of ten, as vLLM's
TOKEN_COUNT_BUCKETS = tuple(step * 10**power for power in range(6) for step in (1, 2, 5))
# What the proxy's X-Team-ID can hold (RFC 3986's unreserved characters, percent-encoding the rest),
# cut to the proxy's own label length (proxy/metrics.py): a label that matches the proxy's.
TEAM_HEADER = re.compile(r"[A-Za-z0-9._~%-]+")
MAX_TEAM_LABEL = 128


def team_of(headers: Mapping[str, str]) -> str | None:
    """The team label of a request's X-Team-ID; None without one, or with one the proxy cannot send."""
    team = headers.get("X-Team-ID")
    return team[:MAX_TEAM_LABEL] if team and TEAM_HEADER.fullmatch(team) else None


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inference_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.time_to_first_token = Histogram(
            "inference_time_to_first_token_seconds",
            "From admission by the frontend to the first generated text",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "inference_request_queue_time_seconds",
            "From a request's coming to the backend to its row: the wait for a free row",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "inference_inter_token_latency_seconds",
            "Time between generated tokens of one request",
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "inference_end_to_end_latency_seconds",
            "From admission by the frontend to the end of the request",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "inference_request_prompt_tokens",
            "Prompt tokens of each backend request, as it ends",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "inference_request_generation_tokens",
            "Tokens generated for each backend request, as it ends",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("inference_queue_depth", "Requests waiting for a row", registry=r)
        self.active_rows = Gauge("inference_active_rows", "Rows generating for a request", registry=r)
        self.prompt_tokens = Counter("inference_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generated_tokens = Counter("inference_generated_tokens", "Tokens generated", registry=r)
        self.cached_prompt_tokens = Counter(
            "inference_prompt_tokens_cached",
            "Prompt tokens not computed: their keys and values were already in the cache (prefix reuse)",
            registry=r,
        )
        # vLLM's spec_decode counters by their meaning: the acceptance rate is accepted / draft.
        self.draft_tokens = Counter(
            "inference_spec_decode_draft_tokens",
            "Draft tokens speculative decoding (prompt lookup or a draft model) proposed and checked",
            registry=r,
        )
        self.accepted_draft_tokens = Counter(
            "inference_spec_decode_accepted_tokens",
            "Draft tokens that stood: tokens made without a step of their own",
            registry=r,
        )
        self.team_prompt_tokens = Counter(
            "inference_team_prompt_tokens",
            "Prompt tokens of the requests that ended, by team (X-Team-ID), as their usage reports them",
            ["team"],
            registry=r,
        )
        self.team_completion_tokens = Counter(
            "inference_team_completion_tokens",
            "Tokens generated for the requests that ended, by team (X-Team-ID), as their usage reports them",
            ["team"],
            registry=r,
        )
        self.finished_requests = Counter(
            "inference_requests_finished",
            "Backend requests ended, by why: stop (an end token or stop string), length (max_tokens or the "
            "context), error, or abort (the client went away, or the request was cancelled, first)",
            ["finished_reason"],
            registry=r,
        )
        self.backend_ready = Gauge(
            "inference_backend_ready", "1 when the backend serves requests", registry=r
        )
        self.backend_restarts = Counter(
            "inference_backend_restarts", "Backend processes restarted after dying", registry=r
        )

    def count_team_usage(self, team: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        if team is not None:
            self.team_prompt_tokens.labels(team=team).inc(prompt_tokens)
            self.team_completion_tokens.labels(team=team).inc(completion_tokens)

    def watch_rows(self, active: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read active rows and queue depth from the router at scrape time, so they are never stale."""
        self.active_rows.set_function(active)
        self.queue_depth.set_function(waiting)

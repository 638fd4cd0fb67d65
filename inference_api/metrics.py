"""The Prometheus metrics of one app (SPEC §4.3).

Each app has its own CollectorRegistry, so that tests building several apps in
one process do not collide on metric names; under gunicorn there is one app.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds. TTFT spans a queue wait and a prefill; token gaps are one decode step.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


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
        self.queue_depth = Gauge("inference_queue_depth", "Requests waiting for a row", registry=r)
        self.active_rows = Gauge("inference_active_rows", "Rows generating for a request", registry=r)
        self.prompt_tokens = Counter("inference_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generated_tokens = Counter("inference_generated_tokens", "Tokens generated", registry=r)
        self.cached_prompt_tokens = Counter(
            "inference_prompt_tokens_cached",
            "Prompt tokens not computed: their keys and values were already in the cache (prefix reuse)",
            registry=r,
        )
        self.backend_ready = Gauge(
            "inference_backend_ready", "1 when the backend serves requests", registry=r
        )
        self.backend_restarts = Counter(
            "inference_backend_restarts", "Backend processes restarted after dying", registry=r
        )

    def watch_rows(self, active: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read active rows and queue depth from the router at scrape time, so they are never stale."""
        self.active_rows.set_function(active)
        self.queue_depth.set_function(waiting)

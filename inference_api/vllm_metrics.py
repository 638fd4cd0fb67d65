"""vLLM's metric names beside this server's own, read from them at each scrape: what was written for vLLM
reads this server unchanged, its Grafana dashboard, autoscalers on `vllm:num_requests_waiting`, and the
Gateway API Inference Extension's endpoint picker, which sends each request to the server with the fewest
waiting and the least KV cache in use (`vllm:kv_cache_usage_perc`).

Every series carries vLLM's `model_name` label, the served model's first name; there is none until a
model has loaded. The KV cache is one slot of the whole context a row (SPEC §5), so the share in use is
the share of rows busy, and no request is ever preempted. vLLM counts its prefix cache's queries and hits
in tokens: the prompt tokens submitted, and those whose keys and values were reused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inference_api.metrics import Metrics
from inference_api.router import Router


class VllmMetrics(Collector):
    def __init__(self, metrics: Metrics, router: Router):
        self._router = router
        m = metrics
        self._names = (  # this server's metric, and vLLM's names for the same figure
            (m.active_rows, ("vllm:num_requests_running",)),
            (m.queue_depth, ("vllm:num_requests_waiting",)),
            (m.prompt_tokens, ("vllm:prompt_tokens", "vllm:prefix_cache_queries")),
            (m.generated_tokens, ("vllm:generation_tokens",)),
            (m.cached_prompt_tokens, ("vllm:prefix_cache_hits",)),
            (m.draft_tokens, ("vllm:spec_decode_num_draft_tokens",)),
            (m.accepted_draft_tokens, ("vllm:spec_decode_num_accepted_tokens",)),
            (m.finished_requests, ("vllm:request_success",)),
            (m.time_to_first_token, ("vllm:time_to_first_token_seconds",)),
            (m.request_queue_time, ("vllm:request_queue_time_seconds",)),
            (m.inter_token_latency, ("vllm:inter_token_latency_seconds",)),
            (m.request_latency, ("vllm:e2e_request_latency_seconds",)),
            (m.request_prompt_tokens, ("vllm:request_prompt_tokens",)),
            (m.request_generation_tokens, ("vllm:request_generation_tokens",)),
        )

    def collect(self) -> Iterator[Metric]:
        serving = self._router.serving
        if serving is None:
            return
        model = {"model_name": serving.model_name}
        for metric, names in self._names:
            for family in metric.collect():
                for name in names:
                    yield renamed(family, name, model)
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV cache in use, 0 to 1: the rows busy", labels=["model_name"]
        )
        usage.add_metric([serving.model_name], self._router.active_rows() / serving.backend.rows)
        yield usage
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions",
            "Requests preempted: none, a row keeps its slot to the end",
            labels=["model_name"],
        )
        preemptions.add_metric([serving.model_name], 0)
        yield preemptions
        backend = self._router.backend_config
        if serving.backend.adapters or backend.runtime_lora:
            yield self._lora_requests(backend.max_loras or len(serving.backend.adapters))

    def _lora_requests(self, most: int) -> Metric:
        """vLLM's vllm:lora_requests_info: which adapters' requests are in rows and which wait, as the
        endpoint picker's LoRA affinity reads them (a request goes where its adapter already runs). Its
        value is the time, as vLLM's; max_lora is --max-loras, else every adapter loaded (all stay
        resident)."""
        running, waiting = self._router.adapters_in_use()
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters of the running and the waiting requests",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        info.add_metric([str(most), ",".join(waiting), ",".join(running)], time.time())
        return info


def renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    """The family under `name`, each sample with `labels` added (a sample keeps its suffix: `_total`,
    `_bucket`, `_created`...)."""
    copy = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        suffix = sample.name[len(family.name) :]
        copy.add_sample(name + suffix, {**sample.labels, **labels}, sample.value, sample.timestamp)
    return copy

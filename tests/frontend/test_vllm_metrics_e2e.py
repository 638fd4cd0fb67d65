"""/metrics under vLLM's names too (inference_api/vllm_metrics.py), as its dashboards, autoscalers and the
Gateway API Inference Extension's endpoint picker read them: each the same figure as this server's own
metric, labelled with the served model's name, parsed by prometheus_client's own parser."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from backend.mock import mock_text
from tests.server_fixture import RunningServer, running_server

NAME = "team-model"  # --served-model-name: vLLM's model_name label is the name clients call it by
ROWS = 4
ADAPTERS = ("sql", "chat")  # --lora-modules: the mock answers them as the model, without loading them


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    options = f"--mock --rows {ROWS} --mock-tokens-per-second 200 --served-model-name {NAME}".split()
    adapters = [f"{name}=/adapters/{name}" for name in ADAPTERS]
    runtime = ["--allow-runtime-lora", "--max-loras", "3"]
    with running_server(*options, "--lora-modules", *adapters, *runtime) as running:
        yield running


def samples(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by its name and its labels, as Prometheus reads them."""
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def vllm(found: dict, name: str, **labels: str) -> float:
    return found[(name, tuple(sorted({**labels, "model_name": NAME}.items())))]


def own(found: dict, name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def completion(server: RunningServer, **fields) -> requests.Response:
    body = {"model": NAME, "prompt": "hello there", "max_tokens": 8, **fields}
    return requests.post(f"{server.url}/v1/completions", json=body, timeout=30)


@contextlib.contextmanager
def long_stream(server: RunningServer, model: str = NAME) -> Iterator[None]:
    """A stream of 2,000 tokens (10 s), once its first event has come: its row is busy until the block
    ends, and the client hangs up. Its lines' iterator is kept to the end: dropped after the first line,
    it closed the connection (urllib3 closes it when its reading generator exits early), and the row
    was freed at the server's next write, racing the test's look at /metrics."""
    body = {"model": model, "prompt": "a long one", "max_tokens": 2000, "stream": True}
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=30) as stream:
        lines = stream.iter_lines()
        next(lines)
        yield
        del lines


def test_a_busy_row_is_vllms_running_request_and_its_share_of_the_kv_cache(server):
    """One long stream holds a row: running 1, none waiting, a quarter of the KV cache (one slot of four)
    in use; none once it ends."""
    with long_stream(server):
        found = samples(server)
        assert vllm(found, "vllm:num_requests_running") == own(found, "inference_active_rows") == 1
        assert vllm(found, "vllm:num_requests_waiting") == own(found, "inference_queue_depth") == 0
        assert vllm(found, "vllm:kv_cache_usage_perc") == 1 / ROWS
    wait_for(lambda: vllm(samples(server), "vllm:num_requests_running") == 0)
    assert vllm(samples(server), "vllm:kv_cache_usage_perc") == 0


def test_tokens_latencies_and_finished_requests_are_the_servers_own_figures(server):
    text = mock_text(tuple(b"hello there"), 8)
    before = samples(server)
    assert completion(server).json()["choices"][0]["finish_reason"] == "length"
    after = samples(server)
    for name, tokens in (
        ("vllm:request_prompt_tokens", len(b"hello there")),
        ("vllm:request_generation_tokens", 8),
    ):
        assert vllm(after, f"{name}_count") - vllm(before, f"{name}_count") == 1
        assert vllm(after, f"{name}_sum") - vllm(before, f"{name}_sum") == tokens
    assert completion(server, stop=[text[3:6]]).json()["choices"][0]["finish_reason"] == "stop"
    aborted = samples(server).get(("inference_requests_finished_total", (("finished_reason", "abort"),)), 0)
    with long_stream(server):
        pass  # the client hangs up
    wait_for(
        lambda: own(samples(server), "inference_requests_finished_total", finished_reason="abort") > aborted
    )

    found = samples(server)
    for reason in ("length", "stop", "abort"):
        counted = own(found, "inference_requests_finished_total", finished_reason=reason)
        assert vllm(found, "vllm:request_success_total", finished_reason=reason) == counted >= 1
    pairs = {
        "vllm:prompt_tokens_total": "inference_prompt_tokens_total",
        "vllm:prefix_cache_queries_total": "inference_prompt_tokens_total",
        "vllm:generation_tokens_total": "inference_generated_tokens_total",
        "vllm:prefix_cache_hits_total": "inference_prompt_tokens_cached_total",
        "vllm:spec_decode_num_draft_tokens_total": "inference_spec_decode_draft_tokens_total",
        "vllm:time_to_first_token_seconds_count": "inference_time_to_first_token_seconds_count",
        "vllm:request_queue_time_seconds_count": "inference_request_queue_time_seconds_count",
        "vllm:request_queue_time_seconds_sum": "inference_request_queue_time_seconds_sum",
        "vllm:inter_token_latency_seconds_sum": "inference_inter_token_latency_seconds_sum",
        "vllm:e2e_request_latency_seconds_count": "inference_end_to_end_latency_seconds_count",
        "vllm:request_prompt_tokens_sum": "inference_request_prompt_tokens_sum",
        "vllm:request_generation_tokens_count": "inference_request_generation_tokens_count",
    }
    for theirs, ours in pairs.items():
        assert vllm(found, theirs) == own(found, ours), theirs
    assert own(found, "inference_prompt_tokens_total") >= 3 * len("hello")
    assert own(found, "inference_generated_tokens_total") >= 8 + 1
    assert vllm(found, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == own(
        found, "inference_time_to_first_token_seconds_bucket", le="+Inf"
    )
    assert vllm(found, "vllm:num_preemptions_total") == 0


def test_a_request_that_waits_for_a_row_is_vllms_queue_time(server):
    """Every row busy with a long stream: a fifth request waits, counted as waiting, until the streams'
    clients hang up; its wait, a second or more, is its queue time (the others' took none to speak of)."""
    before = samples(server)
    with contextlib.ExitStack() as streams, ThreadPoolExecutor(1) as pool:
        for _ in range(ROWS):
            streams.enter_context(long_stream(server))
        waiting = pool.submit(completion, server, max_tokens=2)
        wait_for(lambda: vllm(samples(server), "vllm:num_requests_waiting") == 1)
        time.sleep(1.0)
        streams.close()  # the clients hang up: their rows free at the server's next write
        assert waiting.result().status_code == 200
    wait_for(
        lambda: (
            vllm(samples(server), "vllm:request_queue_time_seconds_count")
            - vllm(before, "vllm:request_queue_time_seconds_count")
            == ROWS + 1
        )
    )
    after = samples(server)
    waited = vllm(after, "vllm:request_queue_time_seconds_sum") - vllm(
        before, "vllm:request_queue_time_seconds_sum"
    )
    assert waited >= 1.0
    quick = own(after, "inference_request_queue_time_seconds_bucket", le="0.25") - own(
        before, "inference_request_queue_time_seconds_bucket", le="0.25"
    )
    assert quick == ROWS  # the streams took their rows at once; the fifth waited past 0.25 s


def lora_info(server: RunningServer) -> tuple[dict[str, str], float]:
    """vllm:lora_requests_info's one sample: its labels and its value."""
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info")
    (sample,) = family.samples
    return sample.labels, sample.value


def test_the_adapters_of_the_running_and_the_waiting_requests_are_vllms_lora_info(server):
    """The endpoint picker's LoRA affinity reads which adapters run where: each adapter once, the
    model's own requests in neither list, max_lora every adapter loaded, the value the time."""
    labels, value = lora_info(server)
    assert labels == {"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(value - time.time()) < 60
    with contextlib.ExitStack() as streams, ThreadPoolExecutor(1) as pool:
        for model in ("sql", "sql", "chat", NAME):  # every row busy
            streams.enter_context(long_stream(server, model))
        waiting = pool.submit(completion, server, model="sql", max_tokens=2)
        wait_for(lambda: lora_info(server)[0]["waiting_lora_adapters"] == "sql")
        assert lora_info(server)[0]["running_lora_adapters"] == "chat,sql"
        streams.close()
        assert waiting.result().status_code == 200
    wait_for(lambda: lora_info(server)[0]["running_lora_adapters"] == "")


def test_adapters_load_and_unload_while_running_up_to_max_loras(server):
    """The mock loads and unloads adapters by name, as the engine does, for the frontend's tests."""
    load = {"lora_name": "docs", "lora_path": "/adapters/docs"}
    assert requests.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=10).status_code == 200
    assert completion(server, model="docs", max_tokens=2).status_code == 200
    more = {"lora_name": "more", "lora_path": "/adapters/more"}
    past = requests.post(f"{server.url}/v1/load_lora_adapter", json=more, timeout=10)
    assert past.status_code == 400 and "the most --max-loras allows" in past.json()["error"]["message"]
    unload = requests.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=10)
    assert unload.status_code == 200  # one loaded at start, unloaded as well
    models = [entry["id"] for entry in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
    assert models == [NAME, "chat", "docs"] and lora_info(server)[0]["max_lora"] == "3"
    assert completion(server, model="sql", max_tokens=2).status_code == 404
    assert requests.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=10).status_code == 400
    # A backend restarted after a crash serves the adapters as they were changed, not as at start.
    old_pid = server.backend_pid()
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: restarted(server, old_pid), timeout=60)
    models = [entry["id"] for entry in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
    assert models == [NAME, "chat", "docs"]


def restarted(server: RunningServer, old_pid: int) -> bool:
    """A new backend answers."""
    try:
        return server.backend_pid() != old_pid and completion(server).status_code == 200
    except (AssertionError, psutil.Error):  # no backend process at this moment, or one just gone
        return False

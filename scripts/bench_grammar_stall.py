#!/usr/bin/env python
"""How much a request with a big JSON schema stalls another client's stream, and what a usual schema's
request waits for its grammar.

    .venv/bin/python scripts/bench_grammar_stall.py [--schema enum|any-of] [--requests 3] [--tree DIR]

Starts an inference server on the default model (4 rows), streams one long completion and records the
time between its events: while a second client sends the server's first request with a grammar (a usual
schema, for which an older server made llguidance's tokenizer), alone, then while that client sends
--requests chat completions one after another, each with a `response_format` schema that takes
llguidance about a second to compile (a 50,000-value enum, or an `anyOf` of 2,000 objects). Reports the
stream's gap median, p99 and maximum in each phase and how long each big-schema request took; then the
median time, over 10 requests, to the first token of a request with a usual schema (the server otherwise
idle). --tree runs the server from another checkout, for a before and after measured by the same client.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_embedding_stall import describe, stream_gaps  # noqa: E402
from bench_proxy import ROOT, percentile, start  # noqa: E402

USUAL = {  # a tool call's arguments, as agents send them
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}


def big_schema(kind: str) -> dict:
    if kind == "enum":
        return {"enum": [f"value-{i}" for i in range(50_000)]}
    return {"anyOf": [one_key(f"k{i}", i) for i in range(2000)]}


def one_key(key: str, value: int) -> dict:
    return {"type": "object", "properties": {key: {"const": value}}, "required": [key]}


def constrained(url: str, model: str, schema: dict, max_tokens: int) -> tuple[int, float]:
    """The status and seconds of one chat completion whose answer follows `schema`."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": max_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }
    started = time.perf_counter()
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    return response.status_code, time.perf_counter() - started


def big_requests(url: str, model: str, schema: dict, count: int) -> list[tuple[int, float]]:
    """`count` big-schema requests, one after another: each one's status and seconds."""
    return [constrained(url, model, schema, 4) for _ in range(count)]


def beside_a_stream(url: str, model: str, requests_of: Callable[[], list]) -> tuple[list[float], list]:
    """A stream's gaps while `requests_of` sends its requests, and what they returned."""
    stop, gaps = threading.Event(), []

    def streaming() -> None:
        while not stop.is_set():
            gaps.extend(stream_gaps(url, model, 1500, stop))

    streamer = threading.Thread(target=streaming)
    streamer.start()
    time.sleep(2)  # the stream is decoding
    try:
        returned = requests_of()
        time.sleep(1)  # the stream goes on past the last of them
    finally:
        stop.set()
        streamer.join()
    return gaps, returned


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schema", choices=["enum", "any-of"], default="enum")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout the server runs from")
    args = parser.parse_args()
    schema, count = big_schema(args.schema), args.requests

    server, url = start("inference_api", ["--rows", "4"], "/ready", {}, root=args.tree)
    try:
        model = requests.get(f"{url}/ready", timeout=10).json()["model"]
        stream_gaps(url, model, 8)  # warm up
        time.sleep(2)  # what a server does as it starts is done
        first, _ = beside_a_stream(url, model, lambda: [constrained(url, model, USUAL, 1)])
        idle = stream_gaps(url, model, 150)
        during, took = beside_a_stream(url, model, lambda: big_requests(url, model, schema, count))
        usual = [constrained(url, model, USUAL, 1)[1] for _ in range(10)]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)

    print(f"\nserver from {args.tree}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print("big-schema requests (status, seconds): " + ", ".join(f"{s} {t:.2f}" for s, t in took))
    print(f"a usual schema's request of one token: median {statistics.median(usual) * 1000:.0f} ms\n")
    print("| the stream | gap p50 (ms) | p99 (ms) | max (ms) |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| alone | {describe(idle)} |")
    print(f"| during the server's first grammar (a usual schema) | {describe(first)} |")
    print(f"| during the big-schema requests | {describe(during)} |")
    print(f"\nmax gap during them / idle p99: {max(during) / percentile(idle, 0.99):.2f}x")


if __name__ == "__main__":
    main()

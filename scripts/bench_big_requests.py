#!/usr/bin/env python
"""What requests at the edge of what the server takes cost another client's stream.

    .venv/bin/python scripts/bench_big_requests.py [--only NAME] [--tree DIR] [-- SERVER OPTIONS]

Starts an inference server on the default model, streams one long completion, and beside it sends each
kind of request below in turn, each as big as the server lets it be (a 1 MiB body, 32 embedding inputs,
a 50,000-value enum): some are refused, over the model's context, which the server can only tell once it
has tokenized them. Reports, for each, the stream's gap median, p99 and maximum while it ran, and the
request's status and seconds; first the stream alone. --tree runs the server from another checkout, for
a before and after measured by the same client.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_embedding_stall import describe, stream_gaps  # noqa: E402
from bench_grammar_stall import beside_a_stream  # noqa: E402
from bench_proxy import ROOT, start  # noqa: E402

MEGABYTE_OF_WORDS = "word " * 200_000  # 1 MB: the request body's limit holds it and a little JSON


def kinds(model: str) -> dict[str, tuple[str, dict]]:
    """Each kind of request: its path and body."""
    chat = {"role": "user", "content": MEGABYTE_OF_WORDS}
    hello = [{"role": "user", "content": "hi"}]
    fitting = "the cat sat on the mat and " * 230  # 1,900 tokens: the context is 2,048
    enum = {"enum": [f"value-{i}" for i in range(50_000)]}
    return {
        "a short chat (for scale)": ("/v1/chat/completions", {"messages": hello}),
        "a 1,900-token prompt (its prefill)": ("/v1/completions", {"prompt": fitting}),
        "a 1,900-token prompt, prompt_logprobs 20": (
            "/v1/completions",
            {"prompt": fitting, "prompt_logprobs": 20},
        ),
        "a 1 MB prompt (completions)": ("/v1/completions", {"prompt": MEGABYTE_OF_WORDS}),
        "a 1 MB message (chat)": ("/v1/chat/completions", {"messages": [chat]}),
        "a 1 MB message (Anthropic's)": ("/v1/messages", {"messages": [chat]}),
        "a 1 MB text to /tokenize": ("/tokenize", {"prompt": MEGABYTE_OF_WORDS}),
        "32 embedding inputs of 30,000 characters": ("/v1/embeddings", {"input": ["word " * 6000] * 32}),
        "a 50,000-value enum schema": (
            "/v1/chat/completions",
            {
                "messages": hello,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": enum}},
            },
        ),
    }


def sender(url: str, model: str, path: str, body: dict) -> Callable[[], list[tuple[int, float]]]:
    def send() -> list[tuple[int, float]]:
        started = time.perf_counter()
        full = {"model": model} | body
        if path != "/tokenize":
            full["max_tokens"] = 4
        response = requests.post(f"{url}{path}", json=full, timeout=600)
        return [(response.status_code, time.perf_counter() - started)]

    return send


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="only the kinds whose name holds this")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout the server runs from")
    parser.add_argument("server_options", nargs="*", help="after --: inference_api's options")
    args = parser.parse_args()

    server, url = start("inference_api", args.server_options, "/ready", {}, root=args.tree)
    rows = []
    try:
        model = requests.get(f"{url}/ready", timeout=10).json()["model"]
        stream_gaps(url, model, 8)  # warm up
        time.sleep(2)  # what a server does as it starts is done
        alone = stream_gaps(url, model, 150)
        for name, (path, body) in kinds(model).items():
            if args.only and args.only not in name:
                continue
            gaps, sent = beside_a_stream(url, model, sender(url, model, path, body))
            status, seconds = sent[0]
            rows.append(f"| {name} | {describe(gaps)} | {status} | {seconds:.2f} |")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)

    machine = platform.processor() or platform.machine()
    print(f"\nserver from {args.tree}; {machine}, {os.cpu_count()} cores\n")
    print("| beside the stream | gap p50 (ms) | p99 (ms) | max (ms) | status | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| nothing | {describe(alone)} | | |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Long prompts among streams: what a 2,000-token prefill does to the others' inter-token latency.

    .venv/bin/python scripts/bench_long_prompts.py [--seconds 40] [--streams 31] [--every 3]
                                                   [--model M] [--dtype D] [--quantize Q]

Starts the server twice, one after the other: with `--max-prefill-tokens
2048` (a long prompt prefilled whole in one step, as before chunked
prefill) and as it starts by default (chunks sized by the measured step
times, backend/engine/prefill_budget.py); with --chunk N a third time, in fixed
chunks of N (`--max-prefill-tokens N`). Each time, --streams
clients stream /v1/completions without pause (256 tokens, ignore_eos)
while one more client sends a prompt of about 2,000 tokens every --every
seconds (8 tokens back). Reports the streams' inter-token latency (p50,
p99, max) and the long prompts' time to their answer, and writes them
into docs/performance.md between its long-prompts markers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import (  # noqa: E402
    Level,
    add_model_options,
    free_port,
    machine,
    percentile,
    server_command,
    start,
    stop,
    stream_one,
    write_report,
)

LONG_PROMPT_WORDS = 1100  # about 2,000 tokens of SmolLM2's tokenizer with the words below
START, END = "<!-- long-prompts:start -->", "<!-- long-prompts:end -->"


def long_prompt(i: int) -> str:
    """Different each time (no two alike), about 2,000 tokens."""
    return " ".join(
        f"item{(i * 7919 + n) % 10007}" if n % 5 == 0 else "and" for n in range(LONG_PROMPT_WORDS)
    )


def run_load(url: str, model: str, streams: int, seconds: float, every: float) -> tuple[Level, list[float]]:
    level, lock = Level(streams), threading.Lock()
    deadline = time.monotonic() + seconds
    long_latencies: list[float] = []

    def streamer() -> None:
        while time.monotonic() < deadline:
            stream_one(url, model, 256, level, lock)

    def long_sender() -> None:
        i = 0
        while time.monotonic() < deadline:
            started = time.monotonic()
            body = {"model": model, "prompt": long_prompt(i), "max_tokens": 8, "temperature": 0}
            requests.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
            long_latencies.append(time.monotonic() - started)
            i += 1
            time.sleep(max(0.0, every - (time.monotonic() - started)))

    threads = [threading.Thread(target=streamer) for _ in range(streams)]
    for thread in threads:
        thread.start()
    time.sleep(2)  # the streams are under way before the first long prompt
    sender = threading.Thread(target=long_sender)
    sender.start()
    for thread in [*threads, sender]:
        thread.join()
    return level, long_latencies


def measure(args, max_prefill_tokens: int | None) -> tuple[Level, list[float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = server_command(args, port, max_seq_len=2048)
    if max_prefill_tokens is not None:
        command += ["--max-prefill-tokens", str(max_prefill_tokens)]
    server = start(command, f"{url}/ready")
    try:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        return run_load(url, model, args.streams, args.seconds, args.every)
    finally:
        stop(server)


def report(args, results: dict[str, tuple[Level, list[float]]]) -> str:
    lines = [
        f"`scripts/bench_long_prompts.py` on {machine()};",
        f"{args.streams} streams of 256 tokens without pause while a prompt of about 2,000 tokens",
        f"arrives every {args.every:g} s, {args.seconds:g} s a run;",
        f"dtype {args.dtype}, quantize {args.quantize}; written {time.strftime('%Y-%m-%d')}.",
        "",
        "| prefill | streams' ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) | p99 / p50 | ITL mean (ms) "
        "| long prompts answered | their latency p50 (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (level, latencies) in results.items():
        p50, p99 = percentile(level.between_tokens, 0.5), percentile(level.between_tokens, 0.99)
        lines.append(
            f"| {name} | {p50 * 1000:.0f} | {p99 * 1000:.0f} | {max(level.between_tokens) * 1000:.0f} | "
            f"{p99 / p50:.1f} | {statistics.mean(level.between_tokens) * 1000:.0f} | {len(latencies)} | "
            f"{percentile(latencies, 0.5) * 1000:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=31)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--chunk", type=int, help="also a run in fixed chunks of this many tokens")
    add_model_options(parser)
    args = parser.parse_args()
    results = {
        "whole (`--max-prefill-tokens 2048`)": measure(args, 2048),
        "chunks sized by step times (default)": measure(args, None),
    }
    if args.chunk:
        results[f"fixed chunks of {args.chunk}"] = measure(args, args.chunk)
    text = report(args, results)
    write_report(args.out, text, START, END)
    print(text)


if __name__ == "__main__":
    main()

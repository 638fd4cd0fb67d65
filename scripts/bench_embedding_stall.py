#!/usr/bin/env python
"""How much an embeddings request stalls another client's stream: its gaps between tokens, idle and
while /v1/embeddings runs (or /v1/rerank, with --rerank-model).

    .venv/bin/python scripts/bench_embedding_stall.py [--inputs 32] [--input-tokens 900] [--tree DIR]
                                                      [--rerank-model DIR [--random-reranker]]

Starts an inference server on the default model, streams one long completion and records the time
between its events; first alone, then while a second client sends one /v1/embeddings request of
--inputs inputs of about --input-tokens tokens each. Reports the stream's inter-token gap median,
p99 and maximum in both phases, and how long the embeddings took (issue 35's goal: the p99 during
the embeddings within 2x the idle one). --tree runs the server from another checkout, for a before
and after measured by the same client. With --rerank-model the server also loads that cross-encoder,
and the second client sends one /v1/rerank request of --inputs documents instead; --random-reranker
first writes there a random one of ms-marco-MiniLM-L-6-v2's shape (6 layers of 384, 512 positions),
whose tokenizer spells words letter by letter: its time is a real one's, its scores are noise.
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
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import ROOT, percentile, start  # noqa: E402

WORDS = ["the", "history", "of", "ships", "and", "harbours", "along", "the", "northern", "coast"]


def stream_gaps(url: str, model: str, tokens: int, stop: threading.Event | None = None) -> list[float]:
    """Seconds between the events of one streamed completion, after its first."""
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": tokens, "stream": True}
    body["ignore_eos"] = True
    gaps, last = [], None
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop is not None and stop.is_set():
                break
    return gaps


def embed(url: str, model: str, inputs: int, words: int) -> tuple[float, int]:
    """Seconds one embeddings request took, and its prompt tokens."""
    texts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) + f" {i}" for i in range(inputs)]
    started = time.perf_counter()
    response = requests.post(f"{url}/v1/embeddings", json={"model": model, "input": texts}, timeout=1800)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()["usage"]["prompt_tokens"]


def rerank(url: str, inputs: int, words: int) -> tuple[float, int]:
    """Seconds one rerank request of `inputs` documents took, and its pairs' tokens."""
    documents = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) for i in range(inputs)]
    started = time.perf_counter()
    body = {"query": "where were the ships built?", "documents": documents, "return_documents": False}
    response = requests.post(f"{url}/v1/rerank", json=body, timeout=1800)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()["usage"]["prompt_tokens"]


def write_random_reranker(directory: Path) -> None:
    """A random cross-encoder of ms-marco-MiniLM-L-6-v2's shape, whose tokenizer spells words by letter."""
    from random_bert import write_random_bert
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
    )
    write_random_bert(directory, config, reranker=True)


def describe(gaps: list[float]) -> str:
    return (
        f"{statistics.median(gaps) * 1000:.0f} | {percentile(gaps, 0.99) * 1000:.0f} | {max(gaps) * 1000:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=900, help="about this many tokens an input")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout the server runs from")
    parser.add_argument("--rerank-model", type=Path, help="send /v1/rerank to this cross-encoder instead")
    parser.add_argument("--random-reranker", action="store_true", help="first write a random one there")
    args = parser.parse_args()
    options = ["--rows", "4"]
    if args.rerank_model is not None:
        if args.random_reranker:
            write_random_reranker(args.rerank_model)
        options += ["--rerank-model", str(args.rerank_model.resolve())]

    server, url = start("inference_api", options, "/ready", {}, root=args.tree)
    try:
        model = requests.get(f"{url}/ready", timeout=10).json()["model"]
        stream_gaps(url, model, 8)  # warm up
        idle = stream_gaps(url, model, 150)
        stop, during, took = threading.Event(), [], []

        def streaming() -> None:
            while not stop.is_set():  # streams of 1,500 tokens, one after another, within the context
                during.extend(stream_gaps(url, model, 1500, stop))

        streamer = threading.Thread(target=streaming)
        streamer.start()
        time.sleep(2)  # the stream is decoding
        if args.rerank_model is None:
            took.append(embed(url, model, args.inputs, args.input_tokens * 10 // 11))  # 1.1 tokens a word
        else:  # a word of the random reranker's is its letters, about 6 tokens
            took.append(rerank(url, args.inputs, args.input_tokens // 6))
        stop.set()
        streamer.join()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)

    print(f"\nserver from {args.tree}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    seconds, tokens = took[0]
    average = tokens / args.inputs
    what = "embeddings" if args.rerank_model is None else "rerank"
    print(f"{what}: {args.inputs} inputs of {average:.0f} tokens on average, {seconds:.1f} s\n")
    print("| the stream | gap p50 (ms) | p99 (ms) | max (ms) |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| alone | {describe(idle)} |")
    print(f"| during the {what} | {describe(during)} |")
    print(f"\np99 during the {what} / idle p99: {percentile(during, 0.99) / percentile(idle, 0.99):.2f}x")


if __name__ == "__main__":
    main()

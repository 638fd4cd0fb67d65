#!/usr/bin/env python
"""This server and llama-server up at once, one request to each in turn: one stream's tokens per second,
and a fresh prompt's first token.

    .venv/bin/python scripts/bench_side_by_side.py --llama-server PATH [--model FILE] [--rounds 6]

scripts/benchmark.py measures each server alone, one after the other, minutes apart; on a shared
2-core machine one stream's speed moved by a fifth between such runs, more than the code did
(docs/performance.md, 2026-11-28). Here both servers meet the same moment: each round sends one
streamed request of --tokens tokens to each (the same prompt and sampling as benchmark.py, llama-server's
own defaults sent to both), then a fresh prompt of --prompt-words words of scripts/perplexity_text.txt to
each (a different passage every time, so that neither reuses a cached prefix) for its first token.
Prints each round and the medians, with the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import (  # noqa: E402
    PROMPT,
    SAMPLING,
    add_model_options,
    free_port,
    llama_server_command,
    machine,
    server_command,
    start,
    stop,
    text_arrivals,
)

TEXT = ROOT / "scripts" / "perplexity_text.txt"


def stream_rate(url: str, model: str, tokens: int) -> float:
    """Tokens per second of one streamed request: its text chunks after the first, over the time since it."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, **SAMPLING}
    body |= {"stream": True, "ignore_eos": True}
    arrivals = text_arrivals(url, body)
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def first_token_seconds(url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streamed one-token request to its first event."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, **SAMPLING, "stream": True}
    started = time.perf_counter()
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                return time.perf_counter() - started
    raise RuntimeError(f"{url} sent no event")


def passages(words: int, count: int) -> list[str]:
    """`count` different passages of `words` words of the text."""
    text = TEXT.read_text().split()
    if words * count > len(text):
        raise SystemExit(f"the text has {len(text)} words: fewer rounds or --prompt-words")
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-server", metavar="PATH", required=True, help="llama.cpp's server binary")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=200, help="tokens of each streamed request")
    parser.add_argument("--prompt-words", type=int, default=250, help="words of each fresh prompt")
    add_model_options(parser)
    args = parser.parse_args()

    prompts = iter(passages(args.prompt_words, 2 * args.rounds))
    ours_port, llama_port = free_port(), free_port()
    urls = {"this server": f"http://127.0.0.1:{ours_port}", "llama-server": f"http://127.0.0.1:{llama_port}"}
    print("starting both servers...", flush=True)
    servers = [start(server_command(args, ours_port), f"{urls['this server']}/ready")]
    try:
        command = llama_server_command(args.llama_server, args.model, llama_port, rows=32)
        servers.append(start(command, f"{urls['llama-server']}/health"))
        model = requests.get(f"{urls['this server']}/v1/models", timeout=10).json()["data"][0]["id"]
        rates = {name: [] for name in urls}
        first_tokens = {name: [] for name in urls}
        for round_ in range(args.rounds):
            for name, url in urls.items():
                rates[name].append(stream_rate(url, model, args.tokens))
                first_tokens[name].append(first_token_seconds(url, model, next(prompts)))
                print(
                    f"round {round_} {name}: {rates[name][-1]:.1f} tokens/s, "
                    f"first token of a fresh prompt {first_tokens[name][-1]:.2f} s",
                    flush=True,
                )
    finally:
        for server in servers:
            stop(server)
    ours, llama = (statistics.median(rates[name]) for name in urls)
    ours_first, llama_first = (statistics.median(first_tokens[name]) for name in urls)
    print(
        f"\n{machine()}; {model}, {args.rounds} rounds, {args.tokens}-token streams, "
        f"{args.prompt_words}-word fresh prompts, both servers up at once:\n"
        f"one stream: {ours:.1f} against llama-server's {llama:.1f} tokens/s ({ours / llama:.2f}x); "
        f"a fresh prompt's first token: {ours_first:.2f} against {llama_first:.2f} s (medians)"
    )


if __name__ == "__main__":
    main()

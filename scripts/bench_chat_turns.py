#!/usr/bin/env python
"""Multi-turn chats sharing a system prompt: what prefix reuse saves in prompt tokens and first-token time.

    .venv/bin/python scripts/bench_chat_turns.py [--conversations 16] [--turns 8] [--answer-tokens 64]
                                                 [--model M] [--dtype D] [--quantize Q]

Starts the server twice, one after the other: with `--no-prefix-reuse` and
with reuse (the default). Each time, --conversations clients hold a chat of
--turns turns at once through /v1/chat/completions: a system prompt of
about 400 tokens shared by all, then each turn a new user message and an
answer of --answer-tokens tokens (streamed, ignore_eos) that goes back into
the history. Reports the prompt tokens the server computed (usage's
prompt_tokens less its cached_tokens) and the time to first token at each
turn, and writes them into docs/performance.md between its chat-turns
markers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import add_model_options, free_port, machine, server_command, start, stop, write_report  # noqa: E402

START, END = "<!-- chat-turns:start -->", "<!-- chat-turns:end -->"
SYSTEM = (
    "You are the assistant of a hardware shop. Answer briefly and politely, name products by their "
    "catalogue number, never promise delivery dates, and suggest a safer tool when a customer "
    "describes a risky job. "
) * 10  # about 390 tokens, with the chat template about 400


def chat(url: str, model: str, conversation: int, turns: int, answer_tokens: int, record) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"Customer {conversation}, question {turn}: which drill?"}
        )
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": answer_tokens,
            "temperature": 0.7,
            "seed": conversation * 100 + turn,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started, first, text, usage = time.perf_counter(), None, [], None
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    if choice["delta"].get("content"):
                        first = first or time.perf_counter()
                        text.append(choice["delta"]["content"])
        messages.append({"role": "assistant", "content": "".join(text)})
        computed = usage["prompt_tokens"] - usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        record(turn, first - started, usage["prompt_tokens"], computed)


def measure(args, reuse: bool) -> dict[int, list[tuple[float, int, int]]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = server_command(args, port, max_seq_len=2048)
    command += [] if reuse else ["--no-prefix-reuse"]
    server = start(command, f"{url}/ready")
    by_turn: dict[int, list[tuple[float, int, int]]] = {}
    lock = threading.Lock()

    def record(turn: int, ttft: float, prompt: int, computed: int) -> None:
        with lock:
            by_turn.setdefault(turn, []).append((ttft, prompt, computed))

    try:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        threads = [
            threading.Thread(target=chat, args=(url, model, c, args.turns, args.answer_tokens, record))
            for c in range(args.conversations)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop(server)
    return by_turn


def report(args, results: dict[str, dict[int, list[tuple[float, int, int]]]]) -> str:
    lines = [
        f"`scripts/bench_chat_turns.py` on {machine()};",
        f"{args.conversations} chats of {args.turns} turns at once, a shared system prompt of about",
        f"400 tokens, answers of {args.answer_tokens} tokens; dtype {args.dtype}, quantize {args.quantize};",
        f"written {time.strftime('%Y-%m-%d')}.",
        "",
        "| prefix reuse | prompt tokens sent | computed | TTFT p50, turn 1 (ms) | turn "
        f"{args.turns} (ms) | turn {args.turns} / turn 1 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, by_turn in results.items():
        sent = sum(p for turn in by_turn.values() for _, p, _ in turn)
        computed = sum(c for turn in by_turn.values() for _, _, c in turn)
        first = statistics.median(t for t, _, _ in by_turn[0])
        last = statistics.median(t for t, _, _ in by_turn[args.turns - 1])
        lines.append(
            f"| {name} | {sent} | {computed} ({computed / sent:.0%}) | {first * 1000:.0f} | "
            f"{last * 1000:.0f} | {last / first:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--answer-tokens", type=int, default=64)
    add_model_options(parser)
    args = parser.parse_args()
    results = {
        "off (`--no-prefix-reuse`)": measure(args, reuse=False),
        "on (default)": measure(args, reuse=True),
    }
    text = report(args, results)
    write_report(args.out, text, START, END)
    print(text)


if __name__ == "__main__":
    main()

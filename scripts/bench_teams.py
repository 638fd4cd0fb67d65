#!/usr/bin/env python
"""One team floods a shared server; another team's time to first token, idle and during the flood.

    .venv/bin/python scripts/bench_teams.py [--flood 48] [--chat-streams 4] [--requests 8] [--tree DIR]

Starts an inference server on the default model (32 rows, a queue of 64) and the proxy in front of it.
First the "chat" team alone: --chat-streams clients, each sending --requests short streamed
completions back to back (16 tokens); then the same while the "flood" team keeps --flood clients busy,
each sending 250-token completions back to back, more than the rows hold. Reports the chat team's time
to the first event (median, p90, p99), idle and flooded, and their ratio (issue 35's goal: the p99 within
2x the idle one). --tree runs the server from another checkout (an earlier commit), for a before and
after measured by the same client.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.sharedctypes
import multiprocessing.synchronize
import os
import platform
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jwt
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import ROOT, SECRET, percentile, start  # noqa: E402

Counted = multiprocessing.sharedctypes.Synchronized  # a multiprocessing.Value

CHAT_TOKENS = 16
FLOOD_TOKENS = 250


def bearer(team: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + jwt.encode({"team_id": team, "token_id": team}, SECRET, "HS256")}


def first_event(
    url: str, model: str, headers: dict[str, str], prompt: str, tokens: int, events: Counted | None = None
) -> float:
    """Seconds to the first event of one streamed completion (read to its end), each event counted in
    `events` if given."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    started, first = time.perf_counter(), None
    with requests.post(f"{url}/v1/completions", json=body, headers=headers, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                if first is None:
                    first = time.perf_counter() - started
                if events is not None:
                    with events.get_lock():
                        events.value += 1
    return first


def chat_round(url: str, model: str, streams: int, requests_each: int) -> list[float]:
    headers = bearer("chat")

    def client(i: int) -> list[float]:
        prompt = f"Question {i}: name a colour of the sea."
        return [first_event(url, model, headers, prompt, CHAT_TOKENS) for _ in range(requests_each)]

    with ThreadPoolExecutor(streams) as pool:
        return [t for times in pool.map(client, range(streams)) for t in times]


def flood(
    url: str, model: str, clients: int, stop: multiprocessing.synchronize.Event, events: Counted
) -> multiprocessing.Process:
    """`clients` threads sending long completions back to back until `stop` is set, counting their events
    in `events`, in a process of their own: in this one, their reading of 28 streams took the
    interpreter's lock from the chat team's clients, whose first events then waited on the client, not
    on the server."""
    process = multiprocessing.Process(
        target=flood_clients, args=(url, model, clients, stop, events), daemon=True
    )
    process.start()
    return process


def flood_clients(
    url: str, model: str, clients: int, stop: multiprocessing.synchronize.Event, events: Counted
) -> None:
    headers = bearer("flood")

    def client(i: int) -> None:
        prompt = f"Story {i}: tell me about the history of ships."
        while not stop.is_set():
            try:
                first_event(url, model, headers, prompt, FLOOD_TOKENS, events)
            except requests.RequestException:
                time.sleep(0.5)  # a 503 past the queue: the flood goes on

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))


def metric(server_url: str, name: str) -> float:
    for line in requests.get(f"{server_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flood", type=int, default=48, help="the flooding team's concurrent clients")
    parser.add_argument("--chat-streams", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="requests each chat client sends")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout the server runs from")
    args = parser.parse_args()

    server_args = ["--rows", "32", "--max-queue", "64"]
    server, server_url = start("inference_api", server_args, "/ready", {}, root=args.tree)
    proxy, proxy_url = start("proxy", ["--upstream", server_url], "/ready", bearer("chat"))
    stop, events = multiprocessing.Event(), multiprocessing.Value("q", 0)
    try:
        model = requests.get(f"{server_url}/ready", timeout=10).json()["model"]
        # Warm up: the first requests after start-up took 70-90 ms more on their way in and out (one run
        # traced), more than a whole idle round's p99 of steps.
        chat_round(proxy_url, model, args.chat_streams, 4)
        idle = chat_round(proxy_url, model, args.chat_streams, args.requests)
        flooding = flood(proxy_url, model, args.flood, stop, events)
        deadline = time.monotonic() + 120
        # Until the flood holds every row it may and queues more (28 of 32 rows while the chat team,
        # seen a moment ago, counts as present).
        while metric(server_url, "inference_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        started, events_before = time.monotonic(), events.value
        flooded = chat_round(proxy_url, model, args.chat_streams, args.requests)
        flood_rate = (events.value - events_before) / (time.monotonic() - started)
        rows_during = metric(server_url, "inference_active_rows")
    finally:
        stop.set()
        for process in (proxy, server):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)
    flooding.join(timeout=120)
    if flooding.is_alive():
        flooding.kill()

    print(f"\nserver from {args.tree}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(
        f"chat: {args.chat_streams} streams x {args.requests} requests of {CHAT_TOKENS} tokens; "
        f"flood: {args.flood} clients of {FLOOD_TOKENS} tokens ({rows_during:.0f} rows active at the end)\n"
    )
    print("| chat team | first event p50 (ms) | p90 (ms) | p99 (ms) |")
    print("| --- | ---: | ---: | ---: |")
    for name, times in (("idle server", idle), ("during the flood", flooded)):
        shown = [statistics.median(times), percentile(times, 0.9), percentile(times, 0.99)]
        print(f"| {name} | " + " | ".join(f"{seconds * 1000:.0f}" for seconds in shown) + " |")
    print(f"\np99 during the flood / idle p99: {percentile(flooded, 0.99) / percentile(idle, 0.99):.2f}x")
    print(f"the flood's events meanwhile: {flood_rate:.0f} a second")


if __name__ == "__main__":
    main()

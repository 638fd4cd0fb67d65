#!/usr/bin/env python
"""What the frontend carries: its worker's CPU time a token, with no model behind it.

    .venv/bin/python scripts/bench_frontend.py [--streams 32] [--tokens 256] [--rate 300] [--rounds 3]
        [--against ROOT]

Starts the server on the mock backend (--rate tokens a second a row, --streams rows) and has --streams
clients stream /v1/completions of exactly --tokens tokens, two requests each, a round at a time.
Reports the tokens a second delivered (the server's own count) and the gunicorn worker's CPU time
(psutil, user and system) a token. A GPU's decode steps make thousands of tokens a second, and each
crosses the worker: its time a token bounds what HTTP can carry (docs/performance.md, "The frontend at
thousands of tokens a second"). With --against, the same rounds on another checkout's server too
(another commit's, for a before and after), the two in turn.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.bench_proxy import ROOT, round_of, start  # noqa: E402


def worker_seconds(worker: psutil.Process) -> float:
    times = worker.cpu_times()
    return times.user + times.system


def one_round(url: str, worker: psutil.Process, args: argparse.Namespace) -> tuple[float, float]:
    """Tokens a second delivered, and the worker's CPU microseconds a token, over one round."""
    before = worker_seconds(worker)
    throughput, _ = round_of(url, "mock", args.streams, args.tokens, {}, url)
    tokens = args.streams * 2 * args.tokens
    return throughput, (worker_seconds(worker) - before) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rate", type=float, default=300.0, help="mock tokens per second per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout's root, measured in turn")
    args = parser.parse_args()

    roots = {"this checkout": ROOT} | ({str(args.against): args.against.resolve()} if args.against else {})
    server_args = ["--mock", "--mock-tokens-per-second", str(args.rate), "--rows", str(args.streams)]
    servers = {name: start("inference_api", server_args, "/ready", {}, root) for name, root in roots.items()}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in roots}
    try:
        workers = {name: psutil.Process(process.pid).children()[0] for name, (process, _) in servers.items()}
        for _, url in servers.values():
            round_of(url, "mock", args.streams, 4, {}, url)  # warm up
        for _ in range(args.rounds):
            for name, (_, url) in servers.items():
                results[name].append(one_round(url, workers[name], args))
    finally:
        for process, _ in servers.values():
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)

    offered = args.rate * args.streams
    print(f"\n{args.streams} streams of {args.tokens} tokens, 2 requests each, {args.rounds} rounds in turn;")
    print(f"the mock backend offering {offered:,.0f} tokens/s ({args.rate:g} a row)")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, the clients on them too\n")
    print("| server | tokens/s delivered | worker CPU a token (us) |")
    print("| --- | --- | --- |")
    for name, rounds in results.items():
        throughputs = ", ".join(f"{throughput:,.0f}" for throughput, _ in rounds)
        costs = ", ".join(f"{cost:.0f}" for _, cost in rounds)
        print(f"| {name} | {throughputs} | {costs} (median {statistics.median(c for _, c in rounds):.0f}) |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""What the JWT proxy costs: throughput and time to first token, direct and through it, side by side.

    .venv/bin/python scripts/bench_proxy.py [--streams 32] [--rounds 3] [--tokens 64] [--rate 100] [--model M]

Starts an inference server (the mock backend at --rate tokens per second per
row, or a real model with --model, "default" for the default one) and a proxy
in front of it, then alternates rounds of --streams concurrent streaming
clients straight to the server and through the proxy, each streaming
completions of exactly --tokens tokens from /v1/completions. Reports
generated tokens per second (from the server's own counter), and the median
and p99 time to the first event.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jwt
import requests

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-secret-" + "x" * 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    module: str, args: list[str], ready_path: str, headers: dict[str, str], root: Path = ROOT
) -> tuple[subprocess.Popen, str]:
    """`python -m module` from the checkout `root` (another commit's, for a before and after)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(root), JWT_SECRET=SECRET)
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--port", str(port), *args],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if requests.get(url + ready_path, headers=headers, timeout=2).status_code == 200:
                return process, url
        except requests.ConnectionError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"python -m {module} did not become ready")


def one_stream(url: str, model: str, tokens: int, headers: dict[str, str]) -> float:
    """Time to first event of one streamed completion of exactly `tokens` tokens (EOS ignored)."""
    started = time.perf_counter()
    body = {
        "model": model,
        "prompt": "Tell me a long story about the sea.",
        "max_tokens": tokens,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
    }
    first = None
    with requests.post(f"{url}/v1/completions", json=body, headers=headers, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - started
    return first


def round_of(
    url: str, model: str, streams: int, tokens: int, headers: dict[str, str], server_url: str
) -> tuple[float, list[float]]:
    """`streams` clients, each sending two requests back to back; tokens/s and first-chunk times (the
    tokens counted on the inference server's /metrics, which the proxy does not forward)."""
    before = generated_tokens(server_url)
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        firsts = list(pool.map(lambda _: one_stream(url, model, tokens, headers), range(streams * 2)))
    elapsed = time.perf_counter() - started
    return (generated_tokens(server_url) - before) / elapsed, firsts


def generated_tokens(url: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("inference_generated_tokens_total "):
            return float(line.split()[1])
    raise RuntimeError("no inference_generated_tokens_total in /metrics")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rate", type=float, default=100.0, help="mock tokens per second per row")
    parser.add_argument("--model", help='a real model ("default" for the default one) instead of the mock')
    args = parser.parse_args()

    auth = {"Authorization": "Bearer " + jwt.encode({"team_id": "bench", "token_id": "b"}, SECRET, "HS256")}
    rows = max(args.streams)
    server_args = ["--rows", str(rows), "--max-queue", str(rows * 2)]
    if args.model is None:
        server_args += ["--mock", "--mock-tokens-per-second", str(args.rate)]
    elif args.model != "default":
        server_args += ["--model", args.model]
    server, server_url = start("inference_api", server_args, "/ready", {})
    proxy, proxy_url = start("proxy", ["--upstream", server_url], "/ready", auth)
    try:
        model = requests.get(f"{server_url}/ready", timeout=10).json()["model"]
        round_of(server_url, model, rows, 4, {}, server_url)  # warm both paths up
        round_of(proxy_url, model, rows, 4, auth, server_url)
        results: dict[tuple[int, str], tuple[list, list]] = {}
        for streams in args.streams:
            for _ in range(args.rounds):
                for name, url, headers in (("direct", server_url, {}), ("proxy", proxy_url, auth)):
                    throughput, firsts = round_of(url, model, streams, args.tokens, headers, server_url)
                    throughputs, all_firsts = results.setdefault((streams, name), ([], []))
                    throughputs.append(throughput)
                    all_firsts.extend(firsts)
    finally:
        for process in (proxy, server):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)

    backend = (
        f"mock backend at {args.rate:g} tokens/s per row" if args.model is None else f"model {args.model}"
    )
    print(f"\nstreams of {args.tokens} tokens, {args.rounds} rounds each, {backend}")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print("| streams | path | tokens/s | first chunk p50 (ms) | first chunk p99 (ms) | proxy cost |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    for (streams, name), (throughputs, firsts) in results.items():
        cost = ""
        if name == "proxy":
            direct_throughputs, direct_firsts = results[(streams, "direct")]
            share = (1 - statistics.mean(throughputs) / statistics.mean(direct_throughputs)) * 100
            delay = (statistics.median(firsts) - statistics.median(direct_firsts)) * 1000
            cost = f"{share:.1f}% throughput, {delay:+.1f} ms first chunk"
        median, p99 = statistics.median(firsts) * 1000, percentile(firsts, 0.99) * 1000
        print(
            f"| {streams} | {name} | {statistics.mean(throughputs):.0f} | {median:.1f} | {p99:.1f} | {cost} |"
        )


if __name__ == "__main__":
    main()

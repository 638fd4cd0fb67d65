#!/usr/bin/env python
"""Speculative decoding, measured: with it and without, through HTTP, side by side.

    .venv/bin/python scripts/bench_speculative.py [--rounds 3] [--streams 32] [--llama-server PATH]
        [--draft-model PATH [--exact]]

1. Starts `python -m inference_api` in the default mode (speculative decoding on where it pays) and
   sends greedy chat requests of two kinds, one at a time, alternating with and without speculation
   (`speculative: false` on the same server, so both meet the same machine at the same moment):
   - edit: rewrite a 300-token Python file with one name changed, whose answer repeats most of it;
   - free: a short story, whose text rarely repeats itself.
   Reports each kind's tokens per second (completion tokens over the request's time, first token
   included) and the ratio, and the draft tokens that stood (/metrics). Each a third way too, with a
   `prediction` (OpenAI's Predicted Outputs): the edit with the file, as an editor's client sends it;
   the story with its own greedy text, got first (a prediction right to the token, found nowhere in
   the prompt: how far one stream goes when every draft stands).
2. At --streams concurrent clients, each sending free-writing requests back to back for a fixed time,
   with and without speculation: the step is full there, and speculation must not slow it. Then the
   edit at --edit-streams clients, each of the three ways: a step of a few rows, where a draft costs
   more of it than at one stream, and a row with a prediction starts with a better record.
3. With --llama-server, llama.cpp's server on the same GGUF file, with its n-gram speculation
   (`--spec-type ngram-simple`, the same lookup and draft lengths) and without, on the same requests.

Drafts come from prompt lookup, or with --draft-model from that model's guesses; --exact serves the
default model in float32 (`--dtype float32 --quantize none`), which its own 4-bit file can draft for.

Prints a markdown block for docs/performance.md, with the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.model.source import resolve_model  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CODE = '''import math


class Circle:
    """A circle in the plane, by its centre and radius."""

    def __init__(self, x: float, y: float, radius: float):
        if radius <= 0:
            raise ValueError(f"the radius must be positive, got {radius}")
        self.x = x
        self.y = y
        self.radius = radius

    def area(self) -> float:
        return math.pi * self.radius**2

    def perimeter(self) -> float:
        return 2 * math.pi * self.radius

    def contains(self, x: float, y: float) -> bool:
        return (x - self.x) ** 2 + (y - self.y) ** 2 <= self.radius**2

    def scaled(self, factor: float) -> "Circle":
        return Circle(self.x, self.y, self.radius * factor)


def total_area(circles: list[Circle]) -> float:
    return sum(circle.area() for circle in circles)


def largest(circles: list[Circle]) -> Circle:
    if not circles:
        raise ValueError("no circles")
    return max(circles, key=lambda circle: circle.radius)
'''
REQUESTS = {
    "edit": "Rewrite this Python file with the class Circle renamed to Disc. Output the whole file and "
    "nothing else.\n\n" + CODE,
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
MAX_TOKENS = {"edit": 400, "free": 256}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(command: list[str], url: str, log: Path, ready: str = "/ready"):
    """A server process until the block ends; ready once `ready` answers 200 (llama-server's /health
    answers 503 while it loads)."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise SystemExit(f"{command[0]} exited: see {log}")
                try:
                    if requests.get(f"{url}{ready}", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(1)
            yield
        finally:
            process.terminate()
            process.wait(timeout=60)


def chat(url: str, kind: str, extra: dict) -> tuple[int, float]:
    """One greedy chat request: its completion tokens and seconds."""
    tokens, seconds, _ = answer(url, kind, extra)
    return tokens, seconds


def answer(url: str, kind: str, extra: dict) -> tuple[int, float, str]:
    """One greedy chat request: its completion tokens, seconds and text."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": REQUESTS[kind]}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS[kind],
        **extra,
    }
    started = time.perf_counter()
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    seconds, answered = time.perf_counter() - started, response.json()
    return answered["usage"]["completion_tokens"], seconds, answered["choices"][0]["message"]["content"]


def predictions(url: str) -> Callable[[str], dict]:
    """Each kind's `prediction` field: the file for the edit, the story's own greedy text for the story."""
    texts = {"edit": CODE, "free": answer(url, "free", {"speculative": False})[2]}
    return lambda kind: {"prediction": {"type": "content", "content": texts[kind]}}


def one_stream(
    url: str, variants: dict[str, dict | Callable[[str], dict]], rounds: int
) -> dict[tuple[str, str], list[float]]:
    """Tokens per second of each (kind, variant), the variants alternating request by request; a variant
    that is a function gives each kind's fields."""
    speeds: dict[tuple[str, str], list[float]] = {}
    for kind in REQUESTS:
        extras = {name: extra(kind) if callable(extra) else extra for name, extra in variants.items()}
        chat(url, kind, next(iter(extras.values())))  # the prompt's first prefill off the clock
        for _ in range(rounds):
            for variant, extra in extras.items():
                tokens, seconds = chat(url, kind, extra)
                speeds.setdefault((kind, variant), []).append(tokens / seconds)
    return speeds


def many_streams(
    url: str,
    variants: dict[str, dict],
    streams: int,
    seconds: float,
    kind: str = "free",
    max_tokens: int = 64,
) -> dict[str, float]:
    """Tokens per second of `streams` clients sending requests of a kind back to back, for each
    variant: the variants take turns, twice, half the time each, so that neither meets the machine's
    quieter or busier minute alone."""
    tokens = dict.fromkeys(variants, 0)
    spent = dict.fromkeys(variants, 0.0)
    for _ in range(2):
        for variant, extra in variants.items():
            done, stop = [0] * streams, time.monotonic() + seconds / 2

            def client(i: int, extra: dict = extra, done: list = done, stop: float = stop) -> None:
                while time.monotonic() < stop:
                    done[i] += chat(url, kind, {**extra, "max_tokens": max_tokens})[0]

            started = time.monotonic()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            tokens[variant] += sum(done)
            spent[variant] += time.monotonic() - started
    return {variant: tokens[variant] / spent[variant] for variant in variants}


def drafts(url: str) -> tuple[float, float]:
    text = requests.get(f"{url}/metrics", timeout=10).text

    def value(name: str) -> float:
        return float(re.search(rf"^{name}_total (\S+)$", text, re.MULTILINE).group(1))

    return value("inference_spec_decode_draft_tokens"), value("inference_spec_decode_accepted_tokens")


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table, numbers right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


# llama-server's own n-gram speculation with the lookup and draft lengths ours has.
LLAMA_NGRAM = [
    "--spec-type",
    "ngram-simple",
    "--spec-ngram-simple-size-n",
    "3",
    "--spec-ngram-simple-size-m",
    "8",
]


def measure_llama(binary: str, rounds: int, streams: int, seconds: float) -> dict[str, tuple[dict, float]]:
    """llama-server on the default model's GGUF file, its speculation off and on: one stream's speeds and
    the full step's tokens per second of each."""
    source = resolve_model(None)
    gguf = str(Path(source.location) / source.gguf_file)
    measured = {}
    for name, spec in (("off", []), ("on", LLAMA_NGRAM)):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [binary, "--model", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", "32"]
        command += ["--ctx-size", str(32 * 2048), "--cont-batching", *spec]
        with serving(command, url, Path(f"/tmp/bench_speculative_llama_{name}.log"), ready="/health"):
            speeds = one_stream(url, {name: {}}, rounds)
            measured[name] = (speeds, many_streams(url, {name: {}}, streams, seconds)[name])
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--edit-streams", type=int, default=8, help="clients of the edit, all at once")
    parser.add_argument(
        "--stream-seconds", type=float, default=60, help="at --streams and --edit-streams, for each variant"
    )
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary, for the same requests")
    parser.add_argument("--draft-model", help="our server drafts with this model instead of prompt lookup")
    parser.add_argument(
        "--exact", action="store_true", help="serve the default model in float32, unquantized"
    )
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    lines = [f"Machine: {platform.processor() or platform.machine()}, {cores} cores", ""]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "inference_api", "--port", str(port), "--rows", "32"]
    command += ["--draft-model", args.draft_model] if args.draft_model else []
    command += ["--dtype", "float32", "--quantize", "none"] if args.exact else []
    served = f"{'float32' if args.exact else 'the default mode'}, drafts from " + (
        f"the draft model {Path(args.draft_model).name}" if args.draft_model else "prompt lookup"
    )
    lines += [f"Served: {served}.", ""]
    with serving(command, url, Path("/tmp/bench_speculative_server.log")):
        before = drafts(url)
        variants = {"on": {}, "off": {"speculative": False}, "predicted": predictions(url)}
        ours = one_stream(url, variants, args.rounds)
        drafted, accepted = (a - b for a, b in zip(drafts(url), before, strict=True))
        before = drafts(url)
        full = many_streams(url, {"off": {"speculative": False}, "on": {}}, args.streams, args.stream_seconds)
        full_on, full_off = full["on"], full["off"]
        full_drafted, full_accepted = (a - b for a, b in zip(drafts(url), before, strict=True))
        edits = {"off": variants["off"], "on": variants["on"], "predicted": variants["predicted"]("edit")}
        edit_speeds = many_streams(
            url, edits, args.edit_streams, args.stream_seconds, "edit", MAX_TOKENS["edit"]
        )
    rows = []
    for kind in REQUESTS:
        on, off, predicted = (median(ours[kind, variant]) for variant in ("on", "off", "predicted"))
        ratios = [f"{on / off:.2f}x", f"{predicted:.1f}", f"{predicted / off:.2f}x"]
        rows.append([kind, "1", f"{off:.1f}", f"{on:.1f}", *ratios])
    full_ratio = f"{full_on / full_off:.2f}x"
    rows.append(
        ["free, 64 tokens", str(args.streams), f"{full_off:.1f}", f"{full_on:.1f}", full_ratio, "-", "-"]
    )
    off, on, predicted = (edit_speeds[variant] for variant in ("off", "on", "predicted"))
    ratios = [f"{on / off:.2f}x", f"{predicted:.1f}", f"{predicted / off:.2f}x"]
    rows.append(["edit", str(args.edit_streams), f"{off:.1f}", f"{on:.1f}", *ratios])
    header = ["request", "streams", "plain tok/s", "with drafts", "ratio", "with a prediction", "ratio"]
    lines += table(header, rows)
    share = accepted / max(drafted, 1)
    lines += ["", f"Draft tokens at one stream: {drafted:.0f} checked, {accepted:.0f} stood ({share:.0%})."]
    lines += [f"At {args.streams} streams: {full_drafted:.0f} checked, {full_accepted:.0f} stood."]

    if args.llama_server:
        llama = measure_llama(args.llama_server, args.rounds, args.streams, args.stream_seconds)
        (off_speeds, off_full), (on_speeds, on_full) = llama["off"], llama["on"]
        rows = []
        for kind in REQUESTS:
            off, on = median(off_speeds[kind, "off"]), median(on_speeds[kind, "on"])
            ratio = median(ours[kind, "on"]) / on
            rows.append([kind, "1", f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x", f"{ratio:.2f}x"])
        full = [
            f"{off_full:.1f}",
            f"{on_full:.1f}",
            f"{on_full / off_full:.2f}x",
            f"{full_on / on_full:.2f}x",
        ]
        rows.append(["free, 64 tokens", str(args.streams), *full])
        lines += [
            "",
            "llama-server, same file and requests, its `ngram-simple` speculation (n 3, 8 drafts):",
            "",
        ]
        header = [
            "request",
            "streams",
            "plain tok/s",
            "with ngram-simple",
            "ratio",
            "ours with drafts over it",
        ]
        lines += table(header, rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The server under streaming load, against its own ceiling and a naive server, in one run.

    .venv/bin/python scripts/benchmark.py [--concurrency 1 8 32 64] [--tokens 64] [--url URL]
                                          [--model M] [--dtype D] [--quantize Q] [--no-naive] [--memory]
                                          [--llama-server PATH]

1. Starts `python -m inference_api` (or uses --url) and runs closed-loop
   clients at each concurrency: every client streams /v1/completions of
   exactly --tokens tokens (ignore_eos) and sends the next request when one
   ends. Reports generated tokens per second, time to first token and
   inter-token latency (p50, p99).
2. With --memory, sends 1,000 short requests and compares the server's
   resident memory (API worker and backend) after the first 100 and after all.
3. The raw ceiling: the engine in this process, no HTTP, decoding full
   batches of 32 rows over the positions the requests decode (--tokens steps
   after the same prompt), measured just before and just after the server's
   32 streams (the engine idle while the server runs); the server's
   efficiency is its tokens/s at 32 streams over their mean.
4. The baseline: scripts/naive_server.py (`model.generate`, one request at a
   time) at concurrency 1 and 32.
5. Writes docs/performance.md (a table, the machine) and PNG plots beside it.

Each part runs alone on the machine (servers are stopped before the next),
so that they do not compete for the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.engine.engine import Engine  # noqa: E402
from backend.messages import BackendConfig, SamplingParams, Submit  # noqa: E402
from backend.model.loader import load_model  # noqa: E402
from backend.model.source import resolve_model  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
# How every request samples, on every server: llama-server's own defaults (top_k 40, min_p 0.05) sent
# explicitly, so that both servers draw from the same distribution. Without them llama-server cut each
# row to its best 40 tokens where this server drew from the whole nucleus: on a random-weight model's
# flat rows about 47,000 tokens, 76 ms of a 200 ms 32-row step (docs/performance.md, 2026-11-28).
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
CEILING_SAMPLES = 3  # the engine's ceiling, sampled on each side of the server's 32 streams
# What an evaluation harness or a careful client adds to every request: the run "with logprobs and
# penalties" sends these, to measure what they cost against the plain run.
SCORED_FIELDS = {"logprobs": 5, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
# The run "with a JSON schema" constrains every request to it (structured outputs): the story is a
# string at least 400 characters long, so that an answer runs to its 64 tokens as the plain run's do
# (an answer that closed its object early would end early and measure admissions, not decoding). The
# runs count tokens as the text chunks received all the same.
STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "minLength": 400},
    },
    "required": ["title", "story"],
    "additionalProperties": False,
}
CONSTRAINED_FIELDS = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}
}


@dataclass
class Level:
    """What the clients saw at one concurrency."""

    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    first_token: list[float] = field(default_factory=list)
    between_tokens: list[float] = field(default_factory=list)
    # The server's own means over the level, in seconds, by histogram (`server_means`); empty where the
    # server has no such /metrics (another server, or one behind --url that does not export them).
    server_means: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


# The server's histograms of where a first token's time goes (inference_api/metrics.py).
FIRST_TOKEN_HISTOGRAMS = ("inference_time_to_first_token_seconds", "inference_request_queue_time_seconds")


def histogram_totals(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of FIRST_TOKEN_HISTOGRAMS in the server's /metrics; {} where it has none."""
    try:
        response = requests.get(f"{url}/metrics", timeout=10)
    except requests.RequestException:
        return {}
    if response.status_code != 200:
        return {}
    totals = {}
    for family in text_string_to_metric_families(response.text):
        if family.name in FIRST_TOKEN_HISTOGRAMS:
            samples = {sample.name: sample.value for sample in family.samples}
            totals[family.name] = (samples[family.name + "_sum"], samples[family.name + "_count"])
    return totals


def server_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Each histogram's mean over what it observed between two `histogram_totals`."""
    means = {}
    for name, (total, count) in after.items():
        earlier_total, earlier_count = before.get(name, (0.0, 0.0))
        if count > earlier_count:
            means[name] = (total - earlier_total) / (count - earlier_count)
    return means


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], ready_url: str, log: Path | None = None) -> subprocess.Popen:
    """A server process, ready; its output to `log` where given (else nowhere)."""
    # The checkout first, then whatever path was set (a GPU machine's carried packages: scripts/gpu_check.sh).
    path = [str(ROOT), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    output = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed once the child has it)
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
        start_new_session=True,
    )
    if log:
        output.close()  # the child holds its own copy
    deadline = time.monotonic() + 900  # --compile compiles at start-up: minutes on a small CPU
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if requests.get(ready_url, timeout=2).status_code == 200:
                return process
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{' '.join(command)} did not become ready")


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def stream_one(
    url: str, model: str, tokens: int, level: Level, lock: threading.Lock, extra: dict | None = None
) -> None:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        **SAMPLING,
        "stream": True,
        "ignore_eos": True,
        **(extra or {}),
    }
    started = time.perf_counter()
    arrivals = text_arrivals(url, body)
    with lock:
        level.tokens += len(arrivals)  # a chunk a token, for these requests (no stop sequences)
        level.first_token.append(arrivals[0] - started)
        level.between_tokens.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))


def text_arrivals(url: str, body: dict) -> list[float]:
    """When each text chunk of a streamed `/v1/completions` request arrived (time.perf_counter)."""
    arrivals = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            # Only chunks that carry text count: servers differ in empty opening and closing chunks.
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    return arrivals


def closed_loop(
    url: str,
    model: str,
    concurrency: int,
    requests_each: int,
    tokens: int,
    bar: tqdm,
    spread: float = 0.0,
    extra: dict | None = None,
) -> Level:
    """`concurrency` clients, each sending its next request as soon as the last one ends.

    With `spread`, client i starts i/concurrency of `spread` seconds late, so
    that arrivals are spread out in time as real traffic's are, instead of
    coming in bursts of `concurrency` prompts when equal-length requests end
    together. Set it to one request's duration and they stay spread.
    """
    level, lock = Level(concurrency), threading.Lock()

    def client(delay: float) -> None:
        time.sleep(delay)
        for i in range(requests_each):
            # Spread clients' first requests meet a machine still filling up: not counted.
            stream_one(url, model, tokens, Level(0) if spread and i == 0 else level, lock, extra)
            bar.update(1)

    threads = [threading.Thread(target=client, args=(i * spread / concurrency,)) for i in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    level.seconds = time.perf_counter() - started
    return level


def resident_memory(pid: int) -> int:
    """RSS of the server's worker and backend (gunicorn's master excluded: it holds nothing)."""
    children = psutil.Process(pid).children(recursive=True)
    return sum(p.memory_info().rss for p in children if "resource_tracker" not in " ".join(p.cmdline()))


def memory_after_requests(url: str, model: str, pid: int) -> tuple[int, int]:
    """RSS after 100 requests and after 1,000, 32 at a time, short answers."""
    level, lock = Level(32), threading.Lock()
    sizes = []
    with tqdm(total=1000, desc="memory: 1000 requests", unit="req") as bar:
        for batch in (100, 900):
            threads = []
            for _ in range(batch):
                threads.append(threading.Thread(target=stream_one, args=(url, model, 4, level, lock)))
                threads[-1].start()
                if len(threads) >= 32:
                    threads.pop(0).join()
                    bar.update(1)
            for thread in threads:
                thread.join()
                bar.update(1)
            sizes.append(resident_memory(pid))
    return sizes[0], sizes[1]


class Ceiling:
    """The engine in this process decoding full batches of `rows` rows: no HTTP, no queues, no prefill.

    Loaded once and sampled just before and just after the server's 32 streams: on a shared 2-core
    machine one sample of 64 steps moves by a tenth or more from the next (481 to 611 tokens/s in eight
    in a row), and a single sample taken minutes after the server made the same server anywhere from 64%
    to 102% of it (docs/performance.md)."""

    def __init__(self, model: str | None, dtype: str, quantize: str, rows: int = 32):
        loaded = load_model(
            BackendConfig(model=model, dtype=dtype, quantize=quantize, rows=rows, max_seq_len=512)
        )
        self.rows = rows
        self.engine = Engine(loaded.model, loaded.tokenizer, rows=rows, max_seq_len=512)
        self.engine.warm_up()
        self.prompt = tuple(loaded.tokenizer(PROMPT).input_ids)
        self.measured: list[float] = []

    def measure(self, steps: int, samples: int) -> None:
        """`samples` measurements of the tokens per second over the `steps` decode steps a request of
        `steps` tokens makes: attention reads more positions with each, so fewer (20, until 2026-11-25)
        measured a ceiling no request could reach."""
        for _ in range(samples):
            self.measured.append(self._sample(steps))

    def _sample(self, steps: int) -> float:
        params = SamplingParams(**SAMPLING, max_tokens=steps + 2, ignore_eos=True)
        for i in range(self.rows):
            self.engine.submit(Submit(f"ceiling-{len(self.measured)}-{i}", self.prompt, params))
        while self.engine.waiting:
            self.engine.step()
        self.engine.step()
        started = time.perf_counter()
        for _ in tqdm(range(steps), desc=f"ceiling: {self.rows} rows, engine alone", unit="step"):
            self.engine.step()
        tokens_per_second = self.rows * steps / (time.perf_counter() - started)
        while self.engine.has_work:  # the rows' last token, then free for the next sample
            self.engine.step()
        return tokens_per_second


def machine() -> str:
    cpu = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    accelerator = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores{accelerator}; torch {torch.__version__}"


def llama_server_command(binary: str, model: str | None, port: int, rows: int) -> list[str]:
    """llama.cpp's server on the same GGUF file: `rows` parallel slots, continuous batching."""
    source = resolve_model(model)
    if not source.is_gguf:
        raise SystemExit("--llama-server needs a GGUF model (the default is one)")
    return [
        binary,
        "--model",
        str(Path(source.location) / source.gguf_file),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(rows),
        "--ctx-size",
        str(rows * 512),  # 512 positions a slot, as the server's rows have
        "--cont-batching",
    ]


@dataclass
class Results:
    """Everything one run measured."""

    levels: list[Level]
    ceilings: list[float] = field(default_factory=list)  # the engine's samples, around the 32 streams
    spread: Level | None = None
    scored: Level | None = None  # 32 streams, every request with SCORED_FIELDS
    constrained: Level | None = None  # 32 streams, every request with CONSTRAINED_FIELDS
    naive: list[Level] = field(default_factory=list)
    llama: list[Level] = field(default_factory=list)
    memory: tuple[int, int] | None = None

    @property
    def ceiling(self) -> float:
        return sum(self.ceilings) / len(self.ceilings)

    def at(self, concurrency: int, which: str = "levels") -> Level | None:
        return next((lv for lv in getattr(self, which) if lv.concurrency == concurrency), None)


def plot(results: Results, directory: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [level.concurrency for level in results.levels]
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, levels, style in (
        ("server", results.levels, "o-"),
        ("naive server", results.naive, "s--"),
        ("llama.cpp server", results.llama, "d-."),
    ):
        if levels:
            axis.plot(
                [lv.concurrency for lv in levels], [lv.tokens_per_second for lv in levels], style, label=name
            )
    axis.axhline(results.ceiling, color="grey", linestyle=":", label="engine ceiling (32 rows)")
    axis.set_ylim(
        0, 1.1 * max([results.ceiling] + [lv.tokens_per_second for lv in results.levels + results.llama])
    )
    axis.set(xlabel="concurrent streams", ylabel="generated tokens / s", xscale="log", title="Throughput")
    axis.set_xticks(xs, [str(x) for x in xs])
    axis.legend()
    figure.tight_layout()
    figure.savefig(directory / "performance-throughput.png", dpi=100)
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, values in (("time to first token", "first_token"), ("inter-token latency", "between_tokens")):
        for q, style in ((0.5, "o-"), (0.99, "^--")):
            ys = [percentile(getattr(lv, values), q) * 1000 for lv in results.levels]
            axis.plot(xs, ys, style, label=f"{name} p{int(q * 100)}")
    axis.set(xlabel="concurrent streams", ylabel="ms", xscale="log", yscale="log", title="Latency")
    axis.set_xticks(xs, [str(x) for x in xs])
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / "performance-latency.png", dpi=100)
    return ["performance-throughput.png", "performance-latency.png"]


def table(rows: list[tuple[str, Level]]) -> list[str]:
    lines = [
        "| concurrent streams | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, lv in rows:
        ttft = [percentile(lv.first_token, q) * 1000 for q in (0.5, 0.99)]
        itl = [percentile(lv.between_tokens, q) * 1000 for q in (0.5, 0.99)]
        figures = [f"{lv.tokens_per_second:.1f}" if lv.seconds else "-", *(f"{ms:.0f}" for ms in ttft + itl)]
        lines.append(f"| {label} | " + " | ".join(figures) + " |")
    return lines


def time_to_first_token_bound(results: Results) -> list[str]:
    """SPEC §7: TTFT at 32 streams within about idle + one prefill + two decode steps.

    The idle TTFT is itself about one prefill (plus HTTP), so the bound is
    taken as twice the idle figure plus two inter-token gaps at 32 streams.
    """
    idle, loaded = results.at(1), results.at(32)
    if not (idle and loaded and results.spread):
        return []
    idle_ms = percentile(idle.first_token, 0.5) * 1000
    step_ms = percentile(loaded.between_tokens, 0.5) * 1000
    bound = 2 * idle_ms + 2 * step_ms
    spread = [percentile(results.spread.first_token, q) * 1000 for q in (0.5, 0.99)]
    return [
        f"TTFT bound at 32 streams (idle {idle_ms:.0f} ms + one prefill, about the idle figure again, "
        f"+ two decode steps of {step_ms:.0f} ms): {bound:.0f} ms; with arrivals spread out, "
        f"p50 {spread[0]:.0f} ms and p99 {spread[1]:.0f} ms.",
    ]


def where_first_tokens_wait(level: Level) -> list[str]:
    """The server's own account of a first token's time at this level (/metrics), beside the clients'."""
    first, queued = (level.server_means.get(name) for name in FIRST_TOKEN_HISTOGRAMS)
    if first is None or queued is None:
        return []
    return [
        f"Its first tokens by its own /metrics at {level.concurrency} streams: {first * 1000:.0f} ms on "
        f"average from the frontend's admission, {queued * 1000:.0f} ms of it waiting for a row "
        f"(the clients' TTFT p50 {percentile(level.first_token, 0.5) * 1000:.0f} ms)."
    ]


def report(args, model: str, results: Results, plots: list[str]) -> str:
    lines = [
        f"`scripts/benchmark.py` on {machine()};",
        f"model {model}, dtype {args.dtype}, quantize {args.quantize}"
        f"{', --compile' if getattr(args, 'compile', False) else ''}, "
        f"server torch threads {args.torch_threads or 'default'};",
        f"closed-loop streaming clients, {args.tokens} generated tokens per request (`ignore_eos`),",
        f"{args.requests} requests per client; written {time.strftime('%Y-%m-%d')}.",
        "",
        *table([(str(lv.concurrency), lv) for lv in results.levels]),
    ]
    if results.spread:
        lines += table([("32, arrivals spread out", results.spread)])[2:]
    if results.scored:
        lines += table([("32, logprobs 5 and penalties", results.scored)])[2:]
    if results.constrained:
        lines += table([("32, a JSON schema", results.constrained)])[2:]
    at_32 = results.at(32)
    lines += [
        "",
        f"Engine ceiling (32 full rows decoding the requests' {args.tokens} positions, no HTTP, same run):"
        f" {results.ceiling:.1f} tokens/s"
        + (
            f", the mean of {len(results.ceilings)} samples of {args.tokens} steps, half just before and"
            f" half just after the server's 32 streams ({', '.join(f'{c:.0f}' for c in results.ceilings)})."
            if at_32
            else f", the mean of {len(results.ceilings)} samples of {args.tokens} steps."
        ),
    ]
    if at_32:
        lines.append(f"Server at 32 streams: {at_32.tokens_per_second / results.ceiling:.0%} of the ceiling.")
        lines += where_first_tokens_wait(at_32)
    if at_32 and results.scored:
        lines.append(
            f"32 streams with `{json.dumps(SCORED_FIELDS)}` on every request: "
            f"{results.scored.tokens_per_second / at_32.tokens_per_second:.0%} of the plain run's tokens/s."
        )
    if at_32 and results.constrained:
        lines.append(
            f"32 streams with `response_format` a JSON schema (`{json.dumps(STORY_SCHEMA)}`) on every "
            f"request: {results.constrained.tokens_per_second / at_32.tokens_per_second:.0%} of the "
            "plain run's tokens/s."
        )
    lines += time_to_first_token_bound(results)
    for name, which in (
        ("Naive server (`model.generate`, one at a time)", "naive"),
        ("llama-server", "llama"),
    ):
        for lv in getattr(results, which):
            line = f"{name} at {lv.concurrency} streams: {lv.tokens_per_second:.1f} tokens/s"
            ours = results.at(lv.concurrency)
            if ours:
                line += f"; the server does {ours.tokens_per_second / lv.tokens_per_second:.2f}x that"
            lines.append(line + ".")
    if results.llama:
        lines += ["", "llama-server, same clients, same run:", ""]
        lines += table([(str(lv.concurrency), lv) for lv in results.llama])
        lines.append("")
    if results.memory:
        first, last = results.memory
        lines.append(
            "Resident memory (API worker + backend; 32 rows of 512 positions, `--max-seq-len 512`): "
            f"{first / 2**20:.0f} MiB after 100 requests, "
            f"{last / 2**20:.0f} MiB after 1,000 ({(last - first) / first:+.1%})."
        )
    lines += [""] + [f"![{name}]({name})" for name in plots] + [""]
    return "\n".join(lines)


START, END = "<!-- benchmark:start -->", "<!-- benchmark:end -->"


def write_report(path: Path, text: str, start: str = START, end: str = END) -> None:
    """Replace the measured part of the page, between its markers, keeping what people wrote around it
    (a page without them gets the block at its end). The other benchmarks pass their own markers."""
    block = f"{start}\n{text}\n{end}"
    page = path.read_text() if path.exists() else ""
    begins = page.find(start)
    ends = page.find(end, begins) if begins >= 0 else -1  # the end after the start, not a stray one
    if ends >= 0:
        page = page[:begins] + block + page[ends + len(end) :]
    else:
        page = (page + "\n" if page else "") + block + "\n"
    path.write_text(page)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options of the served model and of the page the results go to, as every benchmark takes them."""
    parser.add_argument("--model", default=None, help="path or hub id (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--compile", action="store_true", help="serve with --compile (compiled decode steps)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "performance.md")


def server_command(args, port: int, max_seq_len: int = 512) -> list[str]:
    """`python -m inference_api` with 32 rows and the model options of `args` (the other benchmarks
    use it too, with their own extra options)."""
    command = [
        sys.executable,
        "-m",
        "inference_api",
        "--port",
        str(port),
        "--rows",
        "32",
        "--max-queue",
        "64",
    ]
    command += ["--dtype", args.dtype, "--quantize", args.quantize, "--max-seq-len", str(max_seq_len)]
    if args.model:
        command += ["--model", args.model]
    if getattr(args, "torch_threads", None):
        command += ["--torch-threads", str(args.torch_threads)]
    if getattr(args, "compile", False):
        command.append("--compile")
    return command


def measure_server(args, url: str, model: str, pid: int | None, ceiling: Ceiling) -> Results:
    """The closed-loop levels (32 streams between two measurements of the engine's ceiling), then 32
    streams with spread-out arrivals, then (optionally) memory."""
    results = Results(levels=[])
    # Warm up at the most streams measured: a GPU's first steps of each size pay one-off costs.
    closed_loop(url, model, max(args.concurrency), 1, 8, tqdm(disable=True))
    total = sum(c * args.requests for c in args.concurrency)
    with tqdm(total=total, desc="server", unit="req") as bar:
        for concurrency in args.concurrency:
            bar.set_postfix(concurrency=concurrency)
            if concurrency == 32:
                ceiling.measure(args.tokens, CEILING_SAMPLES)
            before = histogram_totals(url)
            results.levels.append(closed_loop(url, model, concurrency, args.requests, args.tokens, bar))
            results.levels[-1].server_means = server_means(before, histogram_totals(url))
            if concurrency == 32:
                ceiling.measure(args.tokens, CEILING_SAMPLES)
    at_32 = results.at(32)
    if at_32:
        with tqdm(
            total=32 * args.requests, desc="server: 32 streams, logprobs and penalties", unit="req"
        ) as bar:
            results.scored = closed_loop(url, model, 32, args.requests, args.tokens, bar, extra=SCORED_FIELDS)
        with tqdm(total=32 * args.requests, desc="server: 32 streams, a JSON schema", unit="req") as bar:
            results.constrained = closed_loop(
                url, model, 32, args.requests, args.tokens, bar, extra=CONSTRAINED_FIELDS
            )
        one_request = at_32.seconds / args.requests
        spread = args.spread_requests
        with tqdm(total=32 * spread, desc="server: 32 streams, arrivals spread out", unit="req") as bar:
            results.spread = closed_loop(url, model, 32, spread, args.tokens, bar, spread=one_request)
        results.spread.seconds = 0.0  # its clients start late on purpose: no throughput figure
    if args.memory and pid is not None:
        results.memory = memory_after_requests(url, model, pid)
    return results


def measure_other(name: str, command: list[str], ready_url: str, url: str, model: str, levels, tokens: int):
    """Closed-loop levels, one request per client, against another server started alone."""
    process = start(command, ready_url)
    try:
        with tqdm(total=sum(levels), desc=name, unit="req") as bar:
            return [closed_loop(url, model, c, 1, tokens, bar) for c in levels]
    finally:
        stop(process)


def more_than_one(value: str) -> int:
    """--spread-requests: each spread client's first request meets a server still filling up and is not
    counted (closed_loop), so one request a client would measure nothing."""
    number = int(value)
    if number < 2:
        raise argparse.ArgumentTypeError(f"{number}: at least 2, as each client's first is not counted")
    return number


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    parser.add_argument(
        "--spread-requests",
        type=more_than_one,
        default=3,
        help="requests per client, 32 with arrivals spread out (each client's first is not counted)",
    )
    parser.add_argument("--url", help="benchmark a running server instead of starting one")
    add_model_options(parser)
    parser.add_argument("--torch-threads", type=int, help="the server's CPU threads for the model")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive-server baseline")
    parser.add_argument("--memory", action="store_true", help="also check memory over 1,000 requests")
    parser.add_argument("--llama-server", metavar="PATH", help="also run llama.cpp's llama-server binary")
    parser.add_argument("--server-log", type=Path, help="the started server's output, to this file")
    parser.add_argument("--no-plots", action="store_true", help="the table alone (no matplotlib needed)")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before the measuring, not after it

    ceiling = Ceiling(args.model, args.dtype, args.quantize)  # idle while the server runs
    server, url = None, args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        print("starting the server...", flush=True)
        server = start(server_command(args, port), f"{url}/ready", args.server_log)
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    try:
        results = measure_server(args, url, model, server.pid if server else None, ceiling)
    finally:
        if server is not None:
            stop(server)

    if not ceiling.measured:  # no level of 32 streams: measured alone
        ceiling.measure(args.tokens, 2 * CEILING_SAMPLES)
    results.ceilings = ceiling.measured
    del ceiling  # its model's memory back before the naive server and llama-server load theirs
    if not args.no_naive:
        port = free_port()
        command = [sys.executable, str(ROOT / "scripts" / "naive_server.py"), "--port", str(port)]
        command += ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
        naive_url = f"http://127.0.0.1:{port}"
        levels = [c for c in (1, 32) if c in args.concurrency]
        results.naive = measure_other(
            "naive server", command, f"{naive_url}/ready", naive_url, model, levels, args.tokens
        )
    if args.llama_server:
        port = free_port()
        llama_url = f"http://127.0.0.1:{port}"
        command = llama_server_command(args.llama_server, args.model, port, rows=32)
        results.llama = measure_other(
            "llama-server", command, f"{llama_url}/health", llama_url, model, args.concurrency, args.tokens
        )

    plots = [] if args.no_plots else plot(results, args.out.parent)
    text = report(args, model, results, plots)
    write_report(args.out, text)
    print(text)
    print(
        json.dumps(
            {
                "ceiling": results.ceiling,
                "ceilings": results.ceilings,
                "levels": {lv.concurrency: lv.tokens_per_second for lv in results.levels},
            }
        )
    )


if __name__ == "__main__":
    main()

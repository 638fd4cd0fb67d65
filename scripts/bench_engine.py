#!/usr/bin/env python
r"""Time the engine alone (no HTTP, no queues) against `model.generate` one request at a time.

    .venv/bin/python scripts/bench_engine.py [--model M | --random 1b|8b] [--dtype D] [--max-tokens N]
        [--prompt-tokens N] [--rows 1 8 32] [--speculative-tokens N] [--compile | --graphs [--profile]]

On a GPU, issue 13's table in one command (a random 8B Llama, 128-token prompts, 256 new tokens,
each row count eager and as CUDA graphs, with kernels and host waits a step):

    .venv/bin/python scripts/bench_engine.py --random 8b --prompt-tokens 128 --max-tokens 256 \
        --rows 1 32 --graphs --profile

For each number of active rows it submits that many requests of the same
length (EOS ignored, so every row decodes exactly --max-tokens tokens), steps
the engine until all finish, and reports generated tokens per second and the
mean decode step time (the steps while every row decodes). Decode steps over
long context: `--prompt-tokens 2000 --max-tokens 256 --speculative-tokens 0`
(the rows get room for both; without drafts, since prompt lookup finds them in
the repeated prompts). The baseline is `model.generate` on one request at a
time, the way a naive server would run. Prints a markdown table and the
machine it ran on.

It also measures the device's memory bandwidth (a large copy) and gives the
floor of a full step: every weight and the KV cache the step attends over,
read once, at that bandwidth. Decoding a small batch is bound by reading the
weights, so the measured step over that floor says how much is left to gain.
For the GPU benchmark's 1B Llama of random weights, see scripts/random_llama.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import math
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.engine.engine import Engine  # noqa: E402
from backend.layers.row_cache import KVShape, pick_cache_dtype  # noqa: E402
from backend.messages import BackendConfig, SamplingParams, Submit  # noqa: E402
from backend.model.loader import LoadedModel, load_model, pick_device, pick_dtype  # noqa: E402
from backend.quant.fp8_linear import Fp8Layer  # noqa: E402
from backend.quant.quantize import QUANTIZE_MODES, quantize_model  # noqa: E402
from backend.quant.quantized_linear import WeightOnlyLinear  # noqa: E402
from scripts.random_llama import SHAPES, default_tokenizer, random_llama  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "List some good habits for writing clean Python code.",
    "What were the main causes of the French Revolution?",
]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{cpu}, {os.cpu_count()} cores"
    return f"{device}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def memory_bandwidth(device: torch.device, size: int = 2**30) -> float:
    """Bytes per second a large on-device copy moves (each byte read once and written once), best of five."""
    if device.type == "cpu":
        size = 2**28  # still far beyond the caches, and quick on a small machine
    source = torch.ones(size // 4, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_bytes(model: PreTrainedModel, rows: int, span: int, cache_dtype: torch.dtype) -> tuple[int, int]:
    """Bytes a decode step of `rows` rows must read: the weights it multiplies by and the keys and
    values of those rows over `span` positions.

    A quantized layer reads its packed weights below its dense threshold and its dense (or int8)
    copy from there; the input embedding only gathers rows, so it counts only where the head multiplies by it.
    """
    embedding_module = model.get_input_embeddings()
    read: dict[int, int] = {}  # by storage: a head tied to the embedding counts once
    for module in model.modules():
        if module is embedding_module:
            continue
        tensors = list(module.parameters(recurse=False))
        if isinstance(module, WeightOnlyLinear):
            buffers = dict(module.named_buffers(recurse=False))  # those set to None are left out
            many_rows = [buffers.pop(name) for name in module.many_rows_buffers if name in buffers]
            tensors += many_rows if many_rows and rows >= module.dense_from_rows else buffers.values()
        elif isinstance(module, Fp8Layer):  # its weights and scales are buffers, kept as their bits
            tensors += list(module.buffers(recurse=False))
        read.update({t.data_ptr(): t.numel() * t.element_size() for t in tensors})
    return sum(read.values()), KVShape.of(model.config).bytes(rows, span, cache_dtype)


def time_engine(
    engine: Engine, prompts: list[list[int]], active: int, max_tokens: int
) -> tuple[float, float]:
    """Tokens per second (prefill included) and mean decode step (s) with `active` rows decoding together:
    the steps after every row's first token, when no prompt is left to prefill (a long prompt's takes
    several steps; NaN where they never all decode at once: long prompts and few --max-tokens)."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=max_tokens, ignore_eos=True)
    for i in range(active):
        engine.submit(Submit(f"bench-{i}", tuple(prompts[i % len(prompts)]), params))
    generated, step_times, all_decoding = 0, [], False
    start = time.perf_counter()
    while engine.has_work:
        rows = engine.active_rows
        all_decoding = all_decoding or (len(rows) == active and all(row.generated for row in rows))
        step_start = time.perf_counter()
        pieces = engine.step()
        if all_decoding:
            step_times.append(time.perf_counter() - step_start)
        generated += sum(p.completion_tokens for p in pieces if p.finished)
    elapsed = time.perf_counter() - start
    return generated / elapsed, statistics.mean(
        step_times
    ) if step_times else math.nan  # rows never all at once


def time_generate(model, prompts: list[list[int]], requests: int, max_tokens: int) -> float:
    """Tokens per second of `model.generate`, one request after another."""
    generated = 0
    start = time.perf_counter()
    for i in range(requests):
        input_ids = torch.tensor([prompts[i % len(prompts)]], device=model.device)
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=0.8,
            top_k=40,
            top_p=0.9,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=model.generation_config.eos_token_id,
        )
        generated += output.shape[1] - input_ids.shape[1]
    return generated / (time.perf_counter() - start)


def time_static_generate(model, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    """Tokens per second of transformers' own `generate` over a static batch with its static KV cache
    (`cache_implementation="static"`, which transformers compiles on a GPU), greedy: what a user would
    pick instead of a server. The second of two runs: the first compiles."""
    shortest = min(len(prompt) for prompt in prompts)
    rows = [prompts[i % len(prompts)][:shortest] for i in range(batch)]
    input_ids = torch.tensor(rows, device=model.device)
    elapsed = 0.0
    for _ in range(2):
        synchronize(model.device)
        start = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            cache_implementation="static",
            pad_token_id=model.generation_config.eos_token_id,
        )
        synchronize(model.device)
        elapsed = time.perf_counter() - start
    return batch * max_tokens / elapsed


def greedy_tokens(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (the rows' own token lists)."""
    outputs: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.submit(Submit(f"greedy-{i}", tuple(prompt), params))
    while engine.has_work:
        for row in engine.active_rows:
            outputs[row.request.request_id] = row.generated  # the list itself: later tokens land in it
        engine.step()
    return [outputs[f"greedy-{i}"] for i in range(len(prompts))]


def departure(reference: list[list[int]], other: list[list[int]]) -> str:
    """How far greedy text from a quantized model follows float32's: tokens until the first difference."""
    same = []
    for ref, out in zip(reference, other, strict=True):
        n = next(
            (i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), min(len(ref), len(out))
        )
        same.append(n)
    identical = sum(n == len(ref) for n, ref in zip(same, reference, strict=True))
    return (
        f"greedy tokens identical to float32 until the first difference: mean {sum(same) / len(same):.1f} "
        f"of {len(reference[0])}; {identical} of {len(reference)} prompts identical throughout"
    )


def print_floor(loaded: LoadedModel, engine: Engine, rows: int, span: int, step: float) -> None:
    """The measured full step against reading its weights and KV cache once at the device's bandwidth."""
    bandwidth = memory_bandwidth(engine.device)
    weights, kv = step_bytes(loaded.model, rows, span, engine.runner.cache.layers[0].keys.dtype)
    floor = (weights + kv) / bandwidth
    print(
        f"\nBandwidth floor of a {rows}-row step: weights {weights / 1e9:.2f} GB"
        f" + KV cache {kv / 1e6:.1f} MB "
        f"(positions up to {span}) at {bandwidth / 1e9:.1f} GB/s (measured copy) = {milliseconds(floor)} ms; "
        f"measured step {milliseconds(step)} ms, {step / floor:.2f}x the floor."
    )


def milliseconds(seconds: float) -> str:
    """Seconds in ms, to three decimals or three significant digits, whichever shows more: a tiny model's
    floor (its head and embedding in blocks, 0.006 ms) to three decimals alone moved its ratio by 10%."""
    ms = seconds * 1000
    decimals = 3 if ms <= 0 else max(3, 2 - math.floor(math.log10(ms)))
    return f"{ms:.{decimals}f}"


def compare_engines(args: argparse.Namespace, option: str, name: str) -> None:
    """Decode steps eager and with an engine option (compile_decode: `--compile`; cuda_graphs), on one
    loaded model, each row count timed on each in turn; then the floor and, with --profile, the
    kernels and host waits of a step of each. With graphs on a GPU, a third engine runs them without
    launching a step before the last one's tokens are read (engine/ahead.py), as before that was done."""
    loaded = bench_model(args)
    engines = {}
    for label, on in (("eager", False), (name, True), ("not ahead", True)):
        started = time.perf_counter()
        engine = Engine(
            loaded.model,
            loaded.tokenizer,
            max(args.rows),
            row_length(args),
            loaded.name,
            speculative_tokens=args.speculative_tokens,
            **{option: on},
        )
        if label == "not ahead":
            if option != "cuda_graphs" or not engine.runner.decodes_in_graphs:
                continue
            engine.steps_ahead = False
        engine.warm_up()
        engines[label] = engine
        print(f"{label} engine ready in {time.perf_counter() - started:.1f} s")
    prompts = bench_prompts(loaded, args.prompt_tokens)
    print(f"\n{loaded.name}, {loaded.model.dtype}, {args.max_tokens} tokens per request; {machine()}\n")
    others = [label for label in engines if label != "eager"]
    columns = [f"{label} tokens/s" for label in engines] + [f"{label} step (ms)" for label in engines]
    columns += [f"{label}/eager" for label in others]
    print("| active rows | " + " | ".join(columns) + " |")
    print("| ---: " * (1 + len(columns)) + "|")
    for active in args.rows:
        runs = {label: [] for label in engines}
        for _ in range(3):  # in turn, so that a noisy neighbour hits each alike
            for label, engine in engines.items():
                runs[label].append(time_engine(engine, prompts, active, args.max_tokens))
        best = {label: max(runs[label]) for label in engines}
        cells = [f"{tps:.1f}" for tps, _ in best.values()] + [
            f"{step * 1000:.1f}" for _, step in best.values()
        ]
        cells += [f"{best[label][0] / best['eager'][0]:.2f}x" for label in others]
        print(f"| {active} | " + " | ".join(cells) + " |")
    span = max(len(p) for p in prompts) + args.max_tokens // 2
    print_floor(loaded, engines[name], args.rows[-1], span, best[name][1])
    if args.transformers_static is not None:
        for batch in args.transformers_static or args.rows:
            static = time_static_generate(loaded.model, prompts, batch, args.max_tokens)
            print(f"transformers' generate, static cache, a batch of {batch}: {static:.1f} tokens/s")
    if args.profile:
        for label, engine in engines.items():
            print(f"{label}: {profile_step(engine, prompts, args.rows[-1])}")
    if args.first_tokens:
        print_first_tokens(engines[name], prompts)


# Prompt lengths no step of the benchmark has run before (its prompts are --prompt-tokens long).
FRESH_LENGTHS = (37, 61, 93, 130, 201)


def first_token_seconds(engine: Engine, prompt: list[int]) -> float:
    """The time from submitting `prompt` alone to its first token's piece (the engine idle before)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    engine.submit(Submit(f"first-{time.perf_counter_ns()}", tuple(prompt), params))
    while engine.has_work:
        engine.step()
    return time.perf_counter() - started


def print_first_tokens(engine: Engine, prompts: list[list[int]]) -> None:
    """Each fresh prompt length's first token alone, the first time a step of that length runs and then
    again: where the first is much slower, the device builds something for each new shape (a GPU's
    attention or matrix-product plans), which every request of a new length would wait for. Each prompt
    starts at its own place in the benchmark's tokens, so that the prefix cache holds none of it."""
    tokens = [token for prompt in prompts for token in prompt]
    print("\n| prompt tokens | first token, first time (ms) | again (ms) |\n| ---: | ---: | ---: |")
    for i, length in enumerate(FRESH_LENGTHS):
        first, again = (
            first_token_seconds(engine, (tokens[start:] + tokens)[:length])
            for start in (2 * i + 1, 2 * i + 2)
        )
        print(f"| {length} | {first * 1000:.1f} | {again * 1000:.1f} |")


def profile_step(engine: Engine, prompts: list[list[int]], active: int, steps: int = 10) -> str:
    """What one decode step of `active` rows launches (torch.profiler over `steps` steps): kernels
    on a GPU, else PyTorch operations on the CPU; the host's waits for the GPU; on a GPU, how much of
    the step the GPU was busy and the kernels that took most of it; then where the host's Python
    spent a step (cProfile), the functions that took most of it."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=3 * steps + 8, ignore_eos=True)
    for i in range(active):
        engine.submit(Submit(f"profile-{i}", tuple(prompts[i % len(prompts)]), params))
    while any(not row.prefilled for row in engine.active_rows) or engine.waiting:
        engine.step()
    engine.step()  # every row decoding from here on
    gpu = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    synchronize(engine.device)
    started = time.perf_counter()
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
    wall = (time.perf_counter() - started) / steps
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        engine.step()
    host.disable()
    events = profiler.events()
    while engine.has_work:
        engine.step()
    if gpu:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        # What the host launches: kernels one by one, or a graph's whole step in one call.
        launches = sum(1 for e in events if "LaunchKernel" in e.name or "GraphLaunch" in e.name)
        waits = sum(1 for e in events if "Synchronize" in e.name or e.name == "cudaMemcpy")
        busy: dict[str, float] = {}
        for kernel in kernels:
            busy[kernel.name] = busy.get(kernel.name, 0.0) + kernel.time_range.elapsed_us() / 1000 / steps
        summary = (
            f"{len(kernels) / steps:.0f} kernels from {launches / steps:.0f} launches and "
            f"{waits / steps:.1f} host waits a {active}-row step; " + busy_summary(busy, wall * 1000)
        )
    else:
        operations = sum(1 for e in events if e.name.startswith("aten::"))
        summary = f"{operations / steps:.0f} PyTorch operations (aten) a {active}-row step"
    return summary + host_profile(host, steps)


# What a CUDA kernel's name says it does, first match wins (flash and memory-efficient attention's kernels
# are CUTLASS's too); "other" are elementwise operations and reductions (norms, rotations, activations).
KERNEL_KINDS = (
    ("attention", ("fmha", "flash", "attention", "attn")),
    ("matrix products", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "triton_tem")),
    ("sampling", ("sort", "topk", "radix", "softmax", "multinomial", "cumsum", "scan", "distribution")),
    ("compiled (triton)", ("triton_",)),  # --compile's fused kernels, whose names say "_to_copy" too
    ("copies", ("memcpy", "memset", "copy", "catarray", "index", "scatter", "gather")),
)


def busy_summary(busy: dict[str, float], step_ms: float) -> str:
    """A step's GPU time from its kernels' (ms a step, by kernel name): in all, by kind, and the
    kernels that took most of it."""
    top = sorted(busy.items(), key=lambda item: -item[1])[:6]
    kinds = kernel_kinds(busy)
    return (
        f"the GPU busy {sum(busy.values()):.2f} ms of a {step_ms:.2f} ms step (profiled); by kind: "
        + "; ".join(f"{kind} {ms:.3f} ms ({count} kernel names)" for kind, ms, count in kinds)
        + "; most time: "
        + "; ".join(f"{name[:60]} {ms:.3f} ms" for name, ms in top)
    )


def kernel_kinds(busy: dict[str, float]) -> list[tuple[str, float, int]]:
    """The GPU's busy time of a step by what its kernels do (KERNEL_KINDS): (kind, ms, how many kernels
    by name), most first, so that a step's time over the weight-read floor says whether its products are
    slow or the time goes around them."""
    kinds: dict[str, list[float]] = {}
    for name, ms in busy.items():
        lowered = name.lower()
        kind = next((kind for kind, words in KERNEL_KINDS if any(w in lowered for w in words)), "other")
        kinds.setdefault(kind, []).append(ms)
    return sorted(((kind, sum(times), len(times)) for kind, times in kinds.items()), key=lambda k: -k[1])


def host_profile(host: cProfile.Profile, steps: int) -> str:
    """Where the host's Python spent `steps` steps: the functions that took most by their own time, then
    by their time with what they called (which step of the engine's takes it), and the time a step."""
    stats = pstats.Stats(host)
    report = f"\n  host, {steps} steps: {stats.total_tt / steps * 1000:.2f} ms a step in Python (cProfile)"
    for order, count in (("tottime", 12), ("cumulative", 30)):
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats(order).print_stats(count)
        lines = [line for line in text.getvalue().splitlines() if line.strip()][-(count + 1) :]
        report += f"\n  by {order}:\n    " + "\n    ".join(lines)
    return report


def bench_config(args: argparse.Namespace) -> BackendConfig:
    return BackendConfig(
        model=args.model,
        dtype=args.dtype,
        quantize=args.quantize,
        rows=max(args.rows),
        max_seq_len=row_length(args),
    )


def row_length(args: argparse.Namespace) -> int:
    """The rows' length: 512, or room for --prompt-tokens and --max-tokens in 512s (longer prompts were
    refused by the engine, and the benchmark timed nothing)."""
    needed = (args.prompt_tokens or 0) + args.max_tokens
    return max(512, -(-needed // 512) * 512)


def bench_prompts(loaded: LoadedModel, tokens: int | None) -> list[list[int]]:
    """The benchmark's prompts, each repeated to `tokens` tokens where that is given."""
    prompts = [loaded.tokenizer(text).input_ids for text in PROMPTS]
    if tokens:
        prompts = [(prompt * (tokens // len(prompt) + 1))[:tokens] for prompt in prompts]
    return prompts


def bench_model(args: argparse.Namespace) -> LoadedModel:
    """The model to time: --model's (or the default) as the server loads it, or with --random a Llama
    of random weights of that shape built in this process (scripts/random_llama.py), on the device
    and in the dtype the server would pick, quantized at load if --quantize says int4, int8 or fp8."""
    if not args.random:
        return load_model(bench_config(args))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else default_tokenizer()
    device = pick_device("auto")
    dtype = pick_dtype(args.dtype, device)
    model = random_llama(args.random, tokenizer, dtype, device)
    name = f"random Llama {args.random}"
    if args.quantize in QUANTIZE_MODES:
        quantize_model(model, args.quantize)
        name += f" ({args.quantize} weights)"
    cache_dtype = pick_cache_dtype("auto", dtype, device)
    return LoadedModel(name, model, tokenizer, "", row_length(args), cache_dtype)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="path or hub id (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompts repeated to this length")
    parser.add_argument(
        "--random",
        choices=sorted(SHAPES),
        help="instead of --model, a Llama of random weights of that shape, built in this process "
        "(scripts/random_llama.py; bfloat16 on a GPU by default)",
    )
    parser.add_argument(
        "--tokenizer",
        help="with --random: a tokenizer directory (default: the default model's, from its package)",
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        help="draft tokens a row and step, as the server's option (default: the engine's; 0 is off, "
        "which a decode step over long repeated prompts wants: prompt lookup finds its drafts there)",
    )
    parser.add_argument("--baseline-requests", type=int, default=4)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="instead: the same engine with compiled decode steps (--compile) against it eager, each row "
        "count timed on both in turn",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="instead: the engine with decode steps as CUDA graphs (the GPU default) against it eager, each "
        "row count timed on both in turn",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="with --compile or --graphs: kernels (GPU) or operations (CPU) a step, and host waits",
    )
    parser.add_argument(
        "--first-tokens",
        action="store_true",
        help="with --compile or --graphs: then the first token of prompts of lengths not run before, each "
        "alone, the first time and again",
    )
    parser.add_argument(
        "--transformers-static",
        type=int,
        nargs="*",
        metavar="BATCH",
        help="with --compile or --graphs: also transformers' generate over a static batch of each of these "
        "sizes (default: each row count) with its static cache (compiled on a GPU), greedy",
    )
    args = parser.parse_args()
    # How the loader served each layer (quantized, in blocks, FP8 products...), on standard error
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.compile or args.graphs:
        option, name = ("compile_decode", "compiled") if args.compile else ("cuda_graphs", "graphs")
        compare_engines(args, option, name)
        return

    loaded = bench_model(args)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        rows=max(args.rows),
        max_seq_len=row_length(args),
        name=loaded.name,
        speculative_tokens=args.speculative_tokens,
    )
    engine.warm_up()
    prompts = bench_prompts(loaded, args.prompt_tokens)

    baseline = time_generate(loaded.model, prompts, args.baseline_requests, args.max_tokens)
    print(f"\n{loaded.name}, {engine.dtype}, {args.max_tokens} tokens per request; {machine()}\n")
    print("| active rows | tokens/s | decode step (ms) | vs generate one at a time |")
    print("| ---: | ---: | ---: | ---: |")
    if args.baseline_requests:  # --baseline-requests 0: the engine alone
        print(f"| generate, 1 request at a time | {baseline:.1f} | | 1.0x |")
    for active in args.rows:
        tokens_per_second, step = time_engine(engine, prompts, active, args.max_tokens)
        speedup = f"{tokens_per_second / baseline:.1f}x" if baseline else "-"
        print(f"| {active} | {tokens_per_second:.1f} | {step * 1000:.1f} | {speedup} |")
    mean_span = max(len(p) for p in prompts) + args.max_tokens // 2
    print_floor(loaded, engine, args.rows[-1], mean_span, step)
    if not args.random and not (args.dtype == "float32" and args.quantize == "none"):  # how far from exact
        exact = load_model(
            BackendConfig(
                model=args.model,
                dtype="float32",
                quantize="none",
                rows=len(PROMPTS),
                max_seq_len=row_length(args),
            )
        )
        reference = Engine(exact.model, exact.tokenizer, rows=len(PROMPTS), max_seq_len=row_length(args))
        ours = greedy_tokens(engine, prompts, args.max_tokens)
        print("\n" + departure(greedy_tokens(reference, prompts, args.max_tokens), ours))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""LoRA adapters, measured: what serving them costs the model's own rows, and what an adapter's rows
decode at, side by side in one process.

    .venv/bin/python scripts/bench_lora.py [--rows 1 8 32] [--rounds 2] [--rank 16] [--adapters 4]
    .venv/bin/python scripts/bench_lora.py --pauses-only [--rank 64] [--adapters 8]

Loads the default model three times in the default mode: alone; ready for adapters while it runs
(--allow-runtime-lora: every linear layer wrapped) with none loaded; and ready with --adapters LoRA
adapters of every linear layer (written here by PEFT, random, of --rank) loaded as the server loads
them while it runs, each load timed (the pause every stream takes), and one more loaded and unloaded.
Then, for each number of rows, greedy decoding of 64 tokens a row (the same 40-token prompt,
speculation off), in turns so that each meets the machine at the same moments:
- the model alone;
- the model ready for adapters, none loaded, its own rows;
- the model with adapters loaded, its own rows (no adapter's in the step);
- every row one adapter's;
- the rows shared among the adapters and the model (a step of several adapters' segments).
Reports the engine's tokens per second (each row's tokens over the wall time of the batch) and each
against the model alone, as a markdown block for docs/performance.md, with the machine.
--pauses-only: no decoding; the --adapters adapters loaded one after another, then unloaded in the
same order, each load and unload timed (every stream's pause, which grows with the adapters loaded).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.engine.engine import Engine  # noqa: E402
from backend.messages import BackendConfig, SamplingParams, Submit  # noqa: E402

TOKENS = 64
PROMPT = tuple(range(1000, 1040))


def write_adapters(config, directory: Path, count: int, rank: int) -> list[tuple[str, str]]:
    """`count` random adapters of every linear layer of a model of this config, as PEFT saves them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = []
    for i in range(count):
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
        peft_model = get_peft_model(AutoModelForCausalLM.from_config(config), lora)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.01)
        peft_model.save_pretrained(directory / f"adapter{i}")
        adapters.append((f"adapter{i}", str(directory / f"adapter{i}")))
    return adapters


def decode(engine: Engine, adapters: list[str]) -> float:
    """Tokens per second of one batch: a row for each entry of `adapters` ("" for the model's own)."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, speculative=False)
    for i, adapter in enumerate(adapters):
        engine.submit(Submit(f"r{i}", PROMPT, params, adapter=adapter))
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
    return len(adapters) * TOKENS / (time.perf_counter() - started)


def timed(change, *arguments) -> float:
    """Milliseconds an adapter's load or unload takes (the engine steps none meanwhile)."""
    started = time.perf_counter()
    change(*arguments)
    return (time.perf_counter() - started) * 1000


def pauses(count: int, rank: int) -> None:
    """Each of `count` adapters' load while serving, then each one's unload, in milliseconds."""
    served = Engine.load(BackendConfig(rows=8, runtime_lora=True))
    with tempfile.TemporaryDirectory() as directory:
        modules = write_adapters(served.model.config, Path(directory), count, rank)
        loads = [timed(served.load_adapter, name, path) for name, path in modules]
        unloads = [timed(served.unload_adapter, name) for name, _ in modules]  # no row has it: at once
    print(f"\n{count} LoRA adapters (rank {rank}, every linear layer) on the default model; {cpu_name()},")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("loading (the 1st to the last, ms): " + ", ".join(f"{ms:.0f}" for ms in loads))
    print("unloading (the 1st loaded to the last, ms): " + ", ".join(f"{ms:.0f}" for ms in unloads))


def cpu_name() -> str:
    """The CPU's model name, where Linux says it."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--pauses-only", action="store_true", help="time loads and unloads alone")
    args = parser.parse_args()
    if args.pauses_only:
        pauses(args.adapters, args.rank)
        return

    rows = max(args.rows)
    alone = Engine.load(BackendConfig(rows=rows))
    ready = Engine.load(BackendConfig(rows=rows, runtime_lora=True))
    served = Engine.load(BackendConfig(rows=rows, runtime_lora=True))
    with tempfile.TemporaryDirectory() as directory:
        modules = write_adapters(alone.model.config, Path(directory), args.adapters + 1, args.rank)
        loads = [timed(served.load_adapter, name, path) for name, path in modules]
        unload = timed(served.unload_adapter, modules[-1][0])  # no row has it: its weights go at once
    names = [name for name, _ in modules[:-1]]
    variants = {
        "model alone": lambda n: decode(alone, [""] * n),
        "ready for adapters, none loaded": lambda n: decode(ready, [""] * n),
        "adapters loaded, the model's rows": lambda n: decode(served, [""] * n),
        "one adapter's rows": lambda n: decode(served, [names[0]] * n),
        "rows shared among the adapters and the model": lambda n: decode(
            served, [([""] + names)[i % (len(names) + 1)] for i in range(n)]
        ),
    }
    results: dict[tuple[str, int], list[float]] = {}
    for count in args.rows:
        for _ in range(args.rounds):
            for name, run in variants.items():
                results.setdefault((name, count), []).append(run(count))

    print(f"\nLoRA adapters ({args.adapters}, rank {args.rank}, every linear layer) on the default model in")
    print(f"the default mode; {cpu_name()}, {torch.get_num_threads()} threads,")
    print(f"torch {torch.__version__}; greedy, {TOKENS} tokens a row, {args.rounds} rounds (median):\n")
    print("| rows | " + " | ".join(variants) + " |")
    print("| ---: |" + " ---: |" * len(variants))
    for count in args.rows:
        base = statistics.median(results[("model alone", count)])
        cells = []
        for name in variants:
            value = statistics.median(results[(name, count)])
            cells.append(f"{value:.0f}" + ("" if name == "model alone" else f" ({value / base:.2f}x)"))
        print(f"| {count} | " + " | ".join(cells) + " |")
    each = ", ".join(f"{ms:.0f}" for ms in loads)
    print(f"\nLoading an adapter while serving (the 1st to the {len(loads)}th): {each} ms;", end=" ")
    print(f"unloading one: {unload:.0f} ms")


if __name__ == "__main__":
    main()

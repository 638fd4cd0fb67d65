#!/usr/bin/env python
r"""How much memory a model takes while it loads, beside what the start-up check counts for it.

    .venv/bin/python scripts/load_memory.py --model FILE_OR_DIR [--quantize auto|none|int4|int8]
        [--dtype D] [--rows N] [--max-seq-len N] [--starts 2]

Each start loads the model as the backend does (`load_model`) in a process of its own, a thread reading
its anonymous memory (Linux's RssAnon: what no file backs, so not the pages of the safetensors it maps)
every 10 ms. The first start uses an empty cache directory, so a GGUF file is converted there; later
starts read its converted copy. Prints a markdown table: each start's peak, what it holds once loaded,
and the RAM the check required (backend/model/resources.py, with its headroom), with the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 1024**2
POLL_SECONDS = 0.01


def anonymous_bytes() -> int:
    """This process's resident memory that no file backs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status: this script reads Linux's accounting")


def one_start(args: argparse.Namespace) -> dict:
    """Load once, in this process: the peak and final anonymous bytes, and the RAM the check required."""
    from backend.messages import BackendConfig
    from backend.model import loader, resources

    required = []

    def checked(*positional, **named) -> resources.Needs:
        needs = check_resources(*positional, **named)
        required.append(resources.ram_needed(needs, named["device"].type == "cuda")[0])
        return needs

    check_resources, loader.check_resources = loader.check_resources, checked
    peak, done = [anonymous_bytes()], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_bytes())
            time.sleep(POLL_SECONDS)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    config = BackendConfig(
        model=args.model,
        quantize=args.quantize,
        dtype=args.dtype,
        rows=args.rows,
        max_seq_len=args.max_seq_len,
        cache_dir=args.cache_dir,
    )
    loaded = loader.load_model(config)
    done.set()
    watcher.join()
    loaded_bytes = anonymous_bytes()  # the model still held, as it serves
    peak[0] = max(peak[0], loaded_bytes)
    return {"model": loaded.name, "peak": peak[0], "loaded": loaded_bytes, "required": required[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a GGUF file, a model directory or a hub id")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--starts", type=int, default=2, help="the first converts a GGUF file")
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)  # set for each start's own process
    args = parser.parse_args()
    if args.cache_dir is not None:
        print(json.dumps(one_start(args)))
        return
    from scripts.bench_engine import machine

    rows = []
    with tempfile.TemporaryDirectory(prefix="load-memory-") as cache:
        for start in range(args.starts):
            options = {"--model": args.model, "--quantize": args.quantize, "--dtype": args.dtype}
            options |= {"--rows": args.rows, "--max-seq-len": args.max_seq_len, "--cache-dir": cache}
            command = [sys.executable, __file__, *(str(part) for pair in options.items() for part in pair)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"start {start + 1} failed:\n{result.stderr[-3000:]}")
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            model = figures["model"]
            name = f"{start + 1}" + (
                " (the conversion)" if start == 0 and args.model.endswith(".gguf") else ""
            )
            rows.append(
                f"| {name} | {figures['peak'] / MIB:,.0f} | {figures['loaded'] / MIB:,.0f} | "
                f"{figures['required'] / MIB:,.0f} |"
            )
    print(f"{model}: --quantize {args.quantize} --dtype {args.dtype}, {args.rows} rows of {args.max_seq_len}")
    print(f"machine: {machine()}\n")
    print("| start | peak anonymous memory, MiB | once loaded, MiB | the check required, MiB |")
    print("| --- | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

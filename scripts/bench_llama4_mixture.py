#!/usr/bin/env python
r"""Llama 4's mixture of experts routed (`Llama4Mixture`: each token through its chosen expert alone) against
transformers' module (every token through every expert, the unchosen ones' inputs zero), one layer's.

    .venv/bin/python scripts/bench_llama4_mixture.py [--tokens 1 8 256] [--experts 16] [--dtype bfloat16]

A mixture of Llama 4 Scout's shape (5120 wide, 16 experts of 8192, one chosen a token, a shared expert of
8192), random weights, float (`SlicedExperts`) as a GPU serves it without --quantize; for each number of
tokens (a decode step's rows, a prompt's chunk) the median time of a forward of each, taking turns, and
their ratio. Prints a markdown table and the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.quant.quantized_experts import Llama4Mixture, SlicedExperts  # noqa: E402
from scripts.bench_engine import machine  # noqa: E402


def median_seconds(block: torch.nn.Module, hidden: torch.Tensor, repeats: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            block(hidden)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 256])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config = Llama4TextConfig(
        hidden_size=5120, intermediate_size=8192, num_local_experts=args.experts, num_experts_per_tok=1
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        module = Llama4TextMoe(config).to(dtype).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.02)
    routed = Llama4Mixture(module, SlicedExperts(module.experts))
    rows = []
    for tokens in args.tokens:
        hidden = torch.randn(1, tokens, config.hidden_size, dtype=dtype)
        median_seconds(module, hidden, 1), median_seconds(routed, hidden, 1)  # first calls off the clock
        everyone = median_seconds(module, hidden, args.repeats)
        chosen = median_seconds(routed, hidden, args.repeats)
        rows.append(f"| {tokens} | {everyone * 1e3:.1f} | {chosen * 1e3:.1f} | {everyone / chosen:.2f}x |")
    print(f"\n{args.experts} experts of 8192, 5120 wide, one chosen a token, {args.dtype}; {machine()}\n")
    print("| tokens | every expert (transformers) ms | chosen expert (Llama4Mixture) ms | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
r"""Decode steps on transformers' modules: query heads grouped by their key head, against keys repeated.

    .venv/bin/python scripts/bench_grouped_decode.py [--families qwen2 deepseek_v2] [--rows 1 32]
        [--steps N] [--prompt-tokens N] [--quantize int4|int8|none] [--dtype D]

A decode step's attention (attention.one_query_each) runs each key head's group of query heads as that
head's queries; before, PyTorch's `enable_gqa` did it, whose CPU kernel repeats each key head for its
group first. Each family, a model of random weights of a released checkpoint's attention (Qwen2.5-0.5B's
for a grouped-query family on transformers' modules; DeepSeek-V2-Lite's latent attention, 16 heads over
one key head of 576, at 8 layers), is timed both ways, the two alternating at each row count so that
drift in the machine falls on both: `--steps` decode steps once every row decodes (its prefill off the
clock), no drafts. Prompts are `--prompt-tokens` long, so that attention reads as many positions as a
chat's turn would. Prints a markdown table and the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.nn.functional import scaled_dot_product_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.engine.engine import Engine  # noqa: E402
from backend.layers import attention  # noqa: E402
from backend.messages import SamplingParams, Submit  # noqa: E402
from backend.model.decoder_runner import DecoderRunner  # noqa: E402
from backend.model.loader import pick_device, pick_dtype  # noqa: E402
from backend.quant.quantized_linear import QUANTIZERS  # noqa: E402
from scripts.bench_engine import machine  # noqa: E402
from scripts.bench_families import random_model_of  # noqa: E402
from scripts.random_llama import default_tokenizer  # noqa: E402

SHAPES = {
    # Qwen2.5-0.5B's: 24 layers, 896 wide, 14 heads of 64 over 2 key heads
    "qwen2": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    # DeepSeek-V2-Lite's attention (16 heads, a latent of 512 beside a rotated key of 64, heads of 128 + 64
    # and values of 128) and its experts' width, at 8 layers and 8 experts of which 2 are chosen (the
    # attention is the point: its 64 experts would take 8 GB here)
    "deepseek_v2": dict(
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
    ),
}


def repeated_keys(query, key, value, mask, scaling):
    """The step's attention as it was: PyTorch's `enable_gqa`."""
    return scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


def decode_step(engine: Engine, prompts: list[list[int]], rows: int, steps: int) -> float:
    """Seconds a decode step takes with `rows` rows decoding, every prompt prefilled: the prefill is off
    the clock, which at 32 rows of 1,000 tokens would otherwise be most of it. No row ends before the
    last is prefilled (rows decode until cancelled)."""
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)  # within max_seq_len
    for i in range(rows):
        engine.submit(Submit(f"bench-{i}", tuple(prompts[i]), params))
    while len(engine.active_rows) < rows or not all(row.generated for row in engine.active_rows):
        if not engine.step() and not engine.has_work:
            raise RuntimeError("a row ended before every row decoded: longer max_seq_len and max_tokens")
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    for i in range(rows):
        engine.cancel(f"bench-{i}")
    while engine.has_work:
        engine.step()
    return elapsed


def timed(engine: Engine, prompts: list[list[int]], rows: int, steps: int, grouped: bool) -> float:
    """A decode step's seconds with `rows` decoding, grouped or with keys repeated."""
    if grouped:
        return decode_step(engine, prompts, rows, steps)
    with mock.patch.object(attention, "one_query_each", repeated_keys):
        return decode_step(engine, prompts, rows, steps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES, reverse=True))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--quantize", choices=["none", *QUANTIZERS], default="int4")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    tokenizer = default_tokenizer()
    dtype = pick_dtype(args.dtype, pick_device("auto"))
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, len(tokenizer) - 10, (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(max(args.rows))
    ]
    table = []
    for family in args.families:
        model = random_model_of(family, SHAPES[family], tokenizer, dtype, args.quantize)
        with mock.patch.object(DecoderRunner, "supports", staticmethod(lambda config, max_seq_len: False)):
            engine = Engine(
                model,
                tokenizer,
                rows=max(args.rows),
                max_seq_len=args.prompt_tokens + 256,  # within the model's 2,048
                max_prefill_tokens=2048,  # prompts prefilled in few steps: the decode steps are timed
                speculative_tokens=0,
            )
        engine.warm_up()
        cache_dtype = str(engine.runner.cache_dtype).removeprefix("torch.")
        for rows in args.rows:  # first calls off the clock (oneDNN builds a kernel for each new shape)
            for grouped in (True, False):
                timed(engine, prompts, rows, 2, grouped)
            step = {grouped: timed(engine, prompts, rows, args.steps, grouped) for grouped in (False, True)}
            speeds = " | ".join(f"{step[g] * 1000:.0f} | {rows / step[g]:.1f}" for g in (False, True))
            table.append(
                f"| {family} | {cache_dtype} | {rows} | {speeds} | {step[False] / step[True]:.2f}x |"
            )
            print(table[-1], flush=True)
        del engine, model
    print(
        f"\n{args.quantize} weights, {dtype}, prompts of {args.prompt_tokens} tokens, "
        f"{args.steps} decode steps timed each way; {machine()}\n"
    )
    print(
        "| family | cache | rows | keys repeated: step ms | tokens/s | grouped: step ms | tokens/s | gain |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(table))


if __name__ == "__main__":
    main()

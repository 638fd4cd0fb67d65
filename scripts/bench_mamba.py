#!/usr/bin/env python
r"""A Mamba (or a hybrid of Gated DeltaNets) on the engine's row states against transformers' `generate`.

    .venv/bin/python scripts/bench_mamba.py [--rows 1 32] [--max-tokens N] [--quantize int4|int8|none]
        [--dtype D] [--model-type mamba|falcon_mamba|mamba2|qwen3_5_text] [--pytorch-states]

A model of random weights of mamba-130m's shape (24 layers, 768 wide, a state of 16 a channel; Mamba-2:
mamba2-130m's, 24 heads of 64 with a state of 128; Qwen3.5's kinds of layers at 0.6B: SHAPES) with the
default model's tokenizer, quantized as `--quantize` says (int4 by default, as `--quantize int4` serves
it). Engine tokens/s with 1 and 32 rows decoding (model/mamba.py), and transformers' `generate` one
request at a time on the model before it is quantized (its forward cannot run a quantized head). Prints
a markdown table and the machine. Random weights decode at the speed of real ones. `--pytorch-states`:
the same model again with its decoding rows' states advanced by PyTorch's operations instead of the
CPU's loop (decode_ops.FusedOps), timed in turn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.engine.engine import Engine  # noqa: E402
from backend.layers.decode_ops import EAGER  # noqa: E402
from backend.model.loader import pick_device, pick_dtype  # noqa: E402
from backend.quant.quantize import quantize_model  # noqa: E402
from backend.quant.quantized_linear import QUANTIZERS  # noqa: E402
from scripts.bench_engine import PROMPTS, machine, time_engine, time_generate  # noqa: E402
from scripts.random_llama import default_tokenizer  # noqa: E402

SHAPES = {
    # state-spaces/mamba-130m-hf's
    "mamba": dict(hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4),
    "falcon_mamba": dict(hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4),
    # mamba2-130m's: 24 heads of 64, one group, a state of 128
    "mamba2": dict(
        hidden_size=768, num_hidden_layers=24, state_size=128, num_heads=24, head_dim=64, n_groups=1, expand=2
    ),
    # A hybrid of Gated DeltaNets at ~0.6B, Qwen3.5's kinds of layers: 24, 1024 wide, three Gated DeltaNet
    # layers (16 key and 16 value heads of 128, a state of 128 x 128 a head) to one gated attention layer
    # (8 heads of 256, 2 KV heads), a 3584-wide MLP
    "qwen3_5_text": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quantize", choices=["none", *QUANTIZERS], default="int4")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model-type", choices=sorted(SHAPES), default="mamba")
    parser.add_argument("--baseline-requests", type=int, default=2)
    parser.add_argument(
        "--pytorch-states",
        action="store_true",
        help="also time the same model with its decoding rows' states advanced by PyTorch's operations "
        "(decode_ops.EAGER) instead of the CPU's loop, each row count on both in turn",
    )
    args = parser.parse_args()

    tokenizer = default_tokenizer()
    prompts = [tokenizer(text).input_ids for text in PROMPTS]
    dtype = pick_dtype(args.dtype, pick_device("auto"))
    config = CONFIG_MAPPING[args.model_type](
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPES[args.model_type],
    )
    # Before quantizing: transformers' Mamba reads its head's `weight`, which a quantized head has not.
    model = random_model(config, dtype)
    baseline = time_generate(model, prompts, args.baseline_requests, args.max_tokens)
    # A model each: a hybrid's mixers keep the states of the one engine built over them.
    engines = {"loop": engine_over(model, args, tokenizer)}
    if args.pytorch_states:
        with mock.patch("backend.model.mamba.decode_ops", lambda *_, **__: EAGER):
            engines["pytorch"] = engine_over(random_model(config, dtype), args, tokenizer)
    lines = []
    for active in args.rows:
        for engine in engines.values():
            time_engine(engine, prompts, active, 8)  # first-call costs of this shape off the clock
        measured = {
            name: time_engine(engine, prompts, active, args.max_tokens) for name, engine in engines.items()
        }
        tokens_per_second, step = measured["loop"]
        line = f"| {args.model_type} | {active} | {tokens_per_second:.1f} | {step * 1000:.1f} |"
        if args.pytorch_states:
            pytorch, pytorch_step = measured["pytorch"]
            line += f" {pytorch:.1f} | {pytorch_step * 1000:.1f} | {tokens_per_second / pytorch:.2f}x |"
        lines.append(f"{line} {baseline:.1f} |")
    print(f"\n{args.quantize} weights, {dtype}, {args.max_tokens} tokens a request; {machine()}\n")
    header = "| model | rows | engine tokens/s | decode step ms |"
    if args.pytorch_states:
        header += " with PyTorch's state updates tokens/s | step ms | loop's gain |"
    print(f"{header} generate tokens/s (one request, unquantized) |")
    print(
        "| --- | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if args.pytorch_states else "") + " ---: |"
    )
    print("\n".join(lines))


def random_model(config, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def engine_over(model: torch.nn.Module, args: argparse.Namespace, tokenizer) -> Engine:
    """The engine over the model, quantized as `--quantize` says, warmed up."""
    if args.quantize in QUANTIZERS:
        quantize_model(model, args.quantize)
    engine = Engine(model, tokenizer, rows=max(args.rows), max_seq_len=512)
    engine.warm_up()
    return engine


if __name__ == "__main__":
    main()

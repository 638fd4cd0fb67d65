#!/usr/bin/env python
"""Perplexity of the served model in each mode, on a fixed text shipped with the repository.

    .venv/bin/python scripts/perplexity.py [--model M] [--window 1024]

Quantized weights trade quality for speed; this says how much. The text
(scripts/perplexity_text.txt, about 5,000 tokens of varied English and a
little code) is scored in windows of --window tokens by the model's own
forward pass, in each mode the server offers, against the exact mode
(float32, the GGUF file dequantized). A quantized layer multiplies by its
packed weights for steps of few rows and, for many, by its dense copy or,
on a CPU where that is faster, as int8 activations times int8 weights (see
backend/quant/quantized_linear.py and backend/quant/calibration.py); all three are
scored, whatever this machine would pick. Prints a markdown table and the machine it ran on.

    .venv/bin/python scripts/perplexity.py --model DIR --fp8-products

scores an FP8 checkpoint also as a GPU with FP8 arithmetic serves it (backend/quant/fp8_linear.py:
e4m3 weights a channel, activations e4m3 a row), by `torch._scaled_mm` run on this CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.messages import BackendConfig  # noqa: E402
from backend.model.loader import load_model  # noqa: E402
from backend.quant import calibration  # noqa: E402
from backend.quant.quantized_linear import WeightOnlyLinear  # noqa: E402
from scripts.bench_engine import machine  # noqa: E402

TEXT = Path(__file__).with_name("perplexity_text.txt")

# (name, dtype, quantize, which weights a quantized layer multiplies by: packed | int8 | dense | fp8)
MODES = [
    ("float32, dequantized (exact mode, the reference)", "float32", "none", "dense"),
    ("default: the file's 4-bit weights, bf16 (packed: few rows; all, in blocks)", "auto", "auto", "packed"),
    ("default: the file's 4-bit weights, bf16 (int8 path: many rows, no AMX)", "auto", "auto", "int8"),
    ("default: the file's 4-bit weights, bf16 (dense copies: many rows otherwise)", "auto", "auto", "dense"),
    ("bfloat16, dequantized", "bfloat16", "none", "dense"),
    ("--quantize int8 (packed)", "auto", "int8", "packed"),
    ("--quantize int4 (packed)", "auto", "int4", "packed"),
]
FP8_PRODUCTS = ("FP8 products, as on a GPU with FP8 (`_scaled_mm` on this CPU)", "bfloat16", "auto", "fp8")


@contextmanager
def as_on_an_fp8_gpu() -> Iterator[None]:
    """The loader's choice of FP8 products (fp8_linear.fp8_products) made true on this CPU, whose
    `torch._scaled_mm` then runs them: an FP8 checkpoint's layers served as a GPU with FP8 serves them."""
    with (
        mock.patch("backend.quant.fp8_weights.fp8_products", return_value=True),
        mock.patch("backend.quant.checkpoint_layers.fp8_products", return_value=True),
        mock.patch("backend.model.loader.fp8_products", return_value=True),  # --quantize fp8's check
    ):
        yield


@torch.inference_mode()
def perplexity(model: torch.nn.Module, token_ids: list[int], window: int) -> float:
    """exp of the mean negative log-likelihood of every token after the first of each window."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        ids = torch.tensor([chunk], device=model.device)
        logits = model(ids).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(total / count)


def hold_to_packed_weights(model: torch.nn.Module) -> None:
    """Make every quantized layer multiply by its packed weights, however many rows it is given."""
    for module in model.modules():
        if isinstance(module, WeightOnlyLinear):
            module.dense_from_rows = sys.maxsize


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="path or hub id (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument(
        "--fp8-products", action="store_true", help="an FP8 checkpoint: score its FP8 products too"
    )
    args = parser.parse_args()

    rows = []
    reference = None
    token_count = 0
    for name, dtype, quantize, weights in MODES + [FP8_PRODUCTS] * args.fp8_products:
        # The loader times the copies for many rows against blocks, and the int8 path against the dense
        # copies, and keeps the faster; here each is scored whichever this CPU would keep.
        calibration.copies_pay_off = lambda layer, *_, keep=weights != "packed", **__: keep
        calibration.int8_multiplies_faster = lambda layer, *_, int8=weights == "int8", **__: int8
        with as_on_an_fp8_gpu() if weights == "fp8" else mock.patch.dict({}):
            loaded = load_model(
                BackendConfig(model=args.model, dtype=dtype, quantize=quantize, rows=1, max_seq_len=64)
            )
        if weights == "packed":
            hold_to_packed_weights(loaded.model)
        token_ids = loaded.tokenizer(TEXT.read_text()).input_ids
        token_count = len(token_ids)
        value = perplexity(loaded.model, token_ids, args.window)
        reference = reference or value
        rows.append(
            f"| {name} | {loaded.model.dtype} | {value:.3f} | {100 * (value / reference - 1):+.2f}% |"
        )
    print(f"\nPerplexity on {TEXT.name} ({token_count} tokens, windows of {args.window}); {machine()}\n")
    print("| mode | activations | perplexity | vs float32 |")
    print("| --- | --- | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""FP8 checkpoints of tiny models, as transformers' `fp8` quantization stores them ("-FP8" repositories):
each linear layer's `weight` in float8 e4m3 and a float32 `weight_scale_inv` for every 128 x 128 of it,
w = weight * weight_scale_inv."""

from __future__ import annotations

from pathlib import Path

import torch

from scripts.random_llama import write_fp8_blocks
from tests.backend.models import tiny_model, write_tiny_causal_lm


def write_fp8_checkpoint(directory: Path, **extras) -> dict[str, torch.Tensor]:
    """A model directory of `tiny_model("llama", **extras)` with its projections in FP8, each 128 x 128
    block scaled to its largest weight; returns each layer's weights as transformers dequantizes them."""
    write_tiny_causal_lm(directory, "llama")  # the marker tokenizer
    return write_fp8_blocks(tiny_model("llama", **extras), directory)

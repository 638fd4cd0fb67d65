"""FP8 checkpoints ("-FP8" repositories, transformers' `fp8` quantization) served on a CPU as 8-bit blocks.

Such a checkpoint keeps each linear layer's weights as float8 e4m3 (3
mantissa bits) with a float32 scale for every 128 x 128 of them. A CPU has no
FP8 arithmetic, and transformers, finding no GPU, dequantizes the layers to
floats at load. The default mode then converts each of them once to the
engine's 8-bit blocks (gguf_types.requantize_int8: a scale a block of 32
inputs, the block's largest weight at 127), which read a byte a weight as
the file does and multiply by int8 dot products: within half a step of 1/127
of each block's largest weight of the checkpoint's, where e4m3 itself
rounds every weight to 1/16 of its power of two. The exact mode keeps the
dequantized floats, and so does a GPU for now: the loader has transformers
dequantize the layers on any device (loader.load_weights says why), and the
GPU multiplies them in the model's dtype, twice FP8's bytes. FP8 products on
a GPU that has them (`torch._scaled_mm`) are not built yet.
"""

from __future__ import annotations

import logging

from torch import nn

from backend.quant import block_weights
from backend.quant.gguf_types import requantize_int8
from backend.quant.quantized_linear import Int8Linear, quantizable_linears, replace_module

log = logging.getLogger(__name__)


def is_fp8_checkpoint(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "fp8"


def serve_fp8_as_blocks(model: nn.Module, quantization_config: dict) -> int:
    """Replace the layers the checkpoint stored in FP8 (its linear layers but those it names as kept) by
    8-bit blocks of their dequantized weights, where the CPU multiplies blocks; returns how many."""
    kept = quantization_config.get("modules_to_not_convert") or []
    linears = {
        name: linear
        for name, linear in quantizable_linears(model).items()
        if not any(name == module or name.startswith(f"{module}.") for module in kept)
    }
    device = next(model.parameters()).device
    if not block_weights.available(device):
        log.info("FP8 checkpoint: %d linear layers served as dequantized floats on %s", len(linears), device)
        return 0
    for name, linear in linears.items():
        eight_bit = requantize_int8(linear.weight.detach().float().numpy())
        replace_module(
            model, name, Int8Linear(eight_bit.q, eight_bit.scale, linear.bias, dense=linear.weight.detach())
        )
    log.info(
        "FP8 checkpoint: %d linear layers converted to 8-bit blocks of 32 inputs (%s has no FP8 "
        "arithmetic), their dequantized weights kept for many rows",
        len(linears),
        block_weights.kernel(device),
    )
    return len(linears)

"""FP8 checkpoints ("-FP8" repositories, transformers' `fp8` quantization): FP8 products on a GPU that has
them, 8-bit blocks on a CPU.

Such a checkpoint keeps each linear layer's weights as float8 e4m3 (3 mantissa bits) with a float32 scale
for every 128 x 128 of them. The loader has transformers dequantize them to float32 as they load, on any
device (loader.load_weights says why), and `serve_fp8` replaces them before the model is cast to its
dtype, so that each is converted from those float32 weights, not from bfloat16's rounding of them:

    a GPU with FP8 arithmetic (fp8_linear.fp8_products): an Fp8Linear, each output channel's weights
        quantized once to e4m3 with a scale of their own (`_scaled_mm` takes a scale a channel, not one
        a 128 x 128), the activations quantized to e4m3 a row as they come: the file's bytes a weight.
    a CPU that multiplies blocks: 8-bit blocks (gguf_types.requantize_int8: a scale a block of 32 inputs,
        the block's largest weight at 127), within half a step of 1/127 of each block's largest weight,
        where e4m3 itself rounds every weight to 1/16 of its power of two; a byte a weight, as in the file.
    anywhere else, and in the exact mode: the dequantized weights, in the model's dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backend.quant import block_weights
from backend.quant.fp8_linear import Fp8Linear, fits_fp8_products, fp8_products
from backend.quant.gguf_types import requantize_int8
from backend.quant.quantized_linear import Int8Linear, quantizable_linears, replace_module

log = logging.getLogger(__name__)


def is_fp8_checkpoint(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "fp8"


def serve_fp8(model: nn.Module, quantization_config: dict, device: torch.device, dtype: torch.dtype) -> int:
    """Replace the layers the checkpoint stored in FP8 (its linear layers but those it names as kept), the
    model still in float32 on the host, by what serves them on `device` in `dtype` (module docstring);
    returns how many were replaced."""
    kept = quantization_config.get("modules_to_not_convert") or []
    linears = {
        name: linear
        for name, linear in quantizable_linears(model).items()
        if not any(name == module or name.startswith(f"{module}.") for module in kept)
    }
    if fp8_products(device, dtype):
        fits = {name: linear for name, linear in linears.items() if fits_fp8_products(*linear.weight.shape)}
        for name, linear in fits.items():
            replace_module(model, name, Fp8Linear.of_weights(linear.weight.to(device), linear.bias))
        log.info(
            "FP8 checkpoint: %d linear layers served as FP8 products on %s (e4m3 weights, a scale a channel, "
            "quantized once from the 128 x 128 blocks' weights; activations e4m3 a row)%s",
            len(fits),
            device,
            f", {len(linears) - len(fits)} as dequantized floats (sizes no multiple of 16)"
            * (fits != linears),
        )
        return len(fits)
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

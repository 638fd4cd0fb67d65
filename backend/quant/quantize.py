"""`--quantize int4|int8|fp8`: a float model's weights made quantized at load.

int4 and int8: its linear layers weight-only (quantized_linear.py), a mixture of experts' weights
(quantized_experts.py) and the output head (int8, for the steps of few rows). fp8, on a GPU with FP8
arithmetic (fp8_linear.py): its linear layers as FP8 products, e4m3 weights a channel and activations
e4m3 a 128 of a row (or a row: fp8_linear.channel_layer), as vLLM's `--quantization fp8` serves a float
model; the head and any experts stay floats.
"""

from __future__ import annotations

from torch import nn

from backend.quant.fp8_linear import channel_layer, e4m3_channels, fits_fp8_products
from backend.quant.quantized_experts import quantize_experts
from backend.quant.quantized_linear import QUANTIZERS, quantizable_linears, quantize_head, replace_module

QUANTIZE_MODES = (*QUANTIZERS, "fp8")


def quantize_model(model: nn.Module, mode: str) -> int:
    """Replace every quantizable linear layer by its `mode` ("int4", "int8" or "fp8") version, and for int4
    and int8 a mixture of experts' weights by such layers too and the head by an int8 one; returns how
    many layers were replaced."""
    linears = quantizable_linears(model)
    if mode == "fp8":
        fits = {name: linear for name, linear in linears.items() if fits_fp8_products(*linear.weight.shape)}
        for name, linear in fits.items():
            replace_module(model, name, channel_layer(*e4m3_channels(linear.weight), linear.bias))
        return len(fits)
    quantize = QUANTIZERS[mode]
    count = len(linears)
    # Each float layer let go of as soon as its replacement is in (popped): held to the end, they kept
    # every float weight beside its quantized layer and dense copy, a 1B's load at 6.3 GiB for 2.4 served.
    while linears:
        name, linear = linears.popitem()
        replace_module(model, name, quantize(linear))
    return count + quantize_experts(model, quantize) + quantize_head(model)

"""`--quantize int4|int8`: a float model's weights made weight-only quantized at load.

Its linear layers (quantized_linear.py), a mixture of experts' weights (quantized_experts.py) and the
output head (int8, for the steps of few rows).
"""

from __future__ import annotations

from torch import nn

from backend.quant.quantized_experts import quantize_experts
from backend.quant.quantized_linear import QUANTIZERS, quantizable_linears, quantize_head, replace_module


def quantize_model(model: nn.Module, mode: str) -> int:
    """Replace every quantizable linear layer by its `mode` ("int4" or "int8") version, a mixture of
    experts' weights by such layers too, and the head by an int8 one; returns how many layers were
    replaced."""
    quantize = QUANTIZERS[mode]
    linears = quantizable_linears(model)
    for name, linear in linears.items():
        replace_module(model, name, quantize(linear))
    return len(linears) + quantize_experts(model, quantize) + quantize_head(model)

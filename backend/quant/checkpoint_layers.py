"""A quantized checkpoint's layers, as its reader unpacked them, served as the engine's weight-only layers.

GPTQ and AWQ (group_wise.py), compressed-tensors (compressed_checkpoint.py) and bitsandbytes
(bitsandbytes_checkpoint.py) checkpoints each unpack a layer into what it stores; each such layer says
whether its own values are 4-bit blocks or 8-bit weights the engine multiplies as they are, and how it
converts otherwise. One loop then serves them all, the same way:

    its own FP8 values, a scale a channel or a tensor or a 128 x 128, on a GPU with FP8 arithmetic: an
        Fp8Linear or Fp8BlockLinear (fp8_linear.py: FP8 products, the activations quantized to e4m3)
    its own 4-bit values in groups of consecutive inputs: an Int4Linear (blocks on a CPU that has them,
        PyTorch's int4 kernel elsewhere); a symmetric checkpoint's, on a CPU with blocks, a BlocksLinear
        of symmetric blocks (d alone, as GGUF's Q4_0)
    its own 8-bit values: an Int8Linear, where the device multiplies their scales (a block's on a CPU
        with blocks; a channel's anywhere)
    anything else, on a CPU with blocks: 8-bit blocks converted once (the layer's `converted`)
    else: the dequantized weights the model was built from

each weight-only layer keeping those dequantized weights as its dense copy for many rows.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch
from torch import nn

from backend.quant import block_weights
from backend.quant.fp8_linear import (
    Fp8BlockLinear,
    Fp8Layer,
    blockwise_products_work,
    channel_layer,
    e4m3_channels,
    fits_fp8_products,
    fp8_products,
)
from backend.quant.gguf_types import EightBitWeight, FourBitWeight
from backend.quant.quantized_linear import (
    BlocksLinear,
    Int4Linear,
    Int8Linear,
    fits_int4_kernels,
    replace_module,
)

FOUR_BIT = "4-bit blocks of the checkpoint's groups"
SYMMETRIC_FOUR_BIT = "4-bit symmetric blocks of the checkpoint's groups"
EIGHT_BIT = "8-bit blocks of the checkpoint's values"
FP8_PRODUCTS = "FP8 products"
FLOATS = "dequantized floats"


class StoredLayer(Protocol):
    conversion: str  # what `converted` starts from, for the log ("the dequantized weights", ...)

    def four_bit(self) -> FourBitWeight | None:
        """Its own values as 4-bit blocks, where they are 4-bit in groups of consecutive inputs."""

    def eight_bit(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Its own values as int8 [out, in] and a scale a channel ([out]) or a block ([out, in / 32])."""

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Its own values as float8 e4m3 [out, in] and a scale a channel ([out]) or a 128 x 128 ([out /
        128, in / 128]), where they are FP8 so."""

    def converted(self) -> EightBitWeight:
        """8-bit blocks of 32 converted once from its weights."""


def serve_layers(model: nn.Module, layers: dict[str, StoredLayer]) -> Counter:
    """Replace each of `layers` (module docstring); how many were served each way, for the log."""
    device = next(model.parameters()).device
    blocks = block_weights.available(device)
    served = Counter()
    for name, layer in layers.items():
        # A layer the model holds otherwise (experts that transformers fuses into one tensor) keeps the
        # dequantized floats it was built from; so does one whose outputs are no whole tile of 16.
        linear = model.get_submodule(name) if is_module(model, name) else None
        if type(linear) is not nn.Linear or not fits_int4_kernels(linear):
            served[FLOATS] += 1
            continue
        dense = linear.weight.detach()
        fp8, four_bit, eight_bit = layer.fp8(), layer.four_bit(), layer.eight_bit()
        if fp8 is not None and fp8_products(device, dense.dtype) and fits_fp8_products(*dense.shape):
            how, fp8_linear = fp8_layer(*fp8, linear.bias, device)
            replace_module(model, name, fp8_linear)
            served[how] += 1
        elif four_bit is not None:
            how, four_bit_linear = four_bit_layer(four_bit, linear.bias, dense, device)
            replace_module(model, name, four_bit_linear)
            served[how] += 1
        elif eight_bit is not None and (blocks or eight_bit[1].dim() == 1):
            q, scale = (t.to(device) for t in eight_bit)
            replace_module(model, name, Int8Linear(q, scale, linear.bias, dense=dense))
            served[EIGHT_BIT] += 1
        elif blocks:
            converted = layer.converted()
            replace_module(model, name, Int8Linear(converted.q, converted.scale, linear.bias, dense=dense))
            served[f"8-bit blocks converted once from {layer.conversion}"] += 1
        else:
            served[FLOATS] += 1
    return served


def four_bit_layer(
    four_bit: FourBitWeight, bias: torch.Tensor | None, dense: torch.Tensor, device: torch.device
) -> tuple[str, nn.Module]:
    """A 4-bit layer of these weights and how it is served, for the log: a symmetric checkpoint's (every
    zero 0) in symmetric blocks where the CPU multiplies blocks, d alone (4.5 bits a weight, not 5)."""
    symmetric = four_bit.symmetric()
    if symmetric is not None and BlocksLinear.takes(dense.shape, device):
        return SYMMETRIC_FOUR_BIT, BlocksLinear.of(symmetric, bias, dense)
    q, scale, zero = (t.to(device) for t in (four_bit.q, four_bit.scale, four_bit.zero))
    return FOUR_BIT, Int4Linear(q, scale, zero, bias, dense=dense)


def fp8_layer(
    values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, device: torch.device
) -> tuple[str, Fp8Layer]:
    """An FP8 layer of these e4m3 values and scales, a channel's ([out]) or a 128 x 128's ([out / 128,
    in / 128]), and how it is served, for the log: in its blocks where the GPU's blockwise product works,
    else converted to a channel's (fp8_linear.channel_layer)."""
    values, scale = values.to(device), scale.to(device)
    if scale.dim() == 1:
        layer = channel_layer(values, scale, bias)
        return f"{FP8_PRODUCTS} of the checkpoint's values, {layer.served_as}", layer
    in_blocks = Fp8BlockLinear(values, scale, bias)
    if blockwise_products_work(device) is None:
        return f"{FP8_PRODUCTS} of the checkpoint's values, {in_blocks.served_as}", in_blocks
    layer = channel_layer(*e4m3_channels(in_blocks.dequantized()), bias)
    return f"{FP8_PRODUCTS} converted once from the blocks' weights to {layer.served_as}", layer


def described(served: Counter) -> str:
    """The log's words for how layers were served: 4-bit blocks of the checkpoint's groups x196, ..."""
    return ", ".join(f"{how} x{count}" for how, count in served.most_common())


def is_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True

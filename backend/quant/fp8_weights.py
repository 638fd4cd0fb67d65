"""FP8 checkpoints ("-FP8" repositories, transformers' `fp8` quantization): FP8 products on a GPU that has
them, 8-bit blocks on a CPU.

Such a checkpoint keeps each linear layer's weights as float8 e4m3 (3 mantissa bits) with a float32 scale
for every 128 x 128 of them. The loader has transformers dequantize them to float32 as they load, on any
device (loader.load_weights says why), and `serve_fp8` replaces them before the model is cast to its
dtype, so that each is converted from those float32 weights, not from bfloat16's rounding of them:

    a GPU with FP8 arithmetic (fp8_linear.fp8_products): an Fp8BlockLinear of the file's own e4m3
        weights and 128 x 128 scales, read from its files, where the GPU's blockwise product passes the
        start's check (fp8_linear.blockwise_products_work); else an Fp8Linear, each output channel's
        weights quantized once to e4m3 with a scale of their own (`_scaled_mm` takes a scale a channel,
        not one a 128 x 128), the activations quantized to e4m3 a row as they come: the file's bytes a
        weight either way.
    a CPU that multiplies blocks: 8-bit blocks (gguf_types.requantize_int8: a scale a block of 32 inputs,
        the block's largest weight at 127), within half a step of 1/127 of each block's largest weight,
        where e4m3 itself rounds every weight to 1/16 of its power of two; a byte a weight, as in the file.
    anywhere else, and in the exact mode: the dequantized weights, in the model's dtype.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from backend.quant import block_weights
from backend.quant.checkpoint_layers import described
from backend.quant.fp8_linear import (
    BLOCK,
    FP8,
    Fp8BlockLinear,
    blockwise_products_work,
    channel_layer,
    e4m3_channels,
    fits_fp8_products,
    fp8_products,
)
from backend.quant.gguf_types import requantize_int8
from backend.quant.group_wise import checkpoint_files
from backend.quant.quantized_linear import Int8Linear, quantizable_linears, replace_module

log = logging.getLogger(__name__)


def is_fp8_checkpoint(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "fp8"


def serve_fp8(
    model: nn.Module,
    quantization_config: dict,
    device: torch.device,
    dtype: torch.dtype,
    checkpoint_dir: Path | None = None,
) -> int:
    """Replace the layers the checkpoint stored in FP8 (its linear layers but those it names as kept), the
    model still in float32 on the host, by what serves them on `device` in `dtype` (module docstring);
    returns how many were replaced. `checkpoint_dir`: where its files are, to read the FP8 blocks from."""
    kept = quantization_config.get("modules_to_not_convert") or []
    linears = {
        name: linear
        for name, linear in quantizable_linears(model).items()
        if not any(name == module or name.startswith(f"{module}.") for module in kept)
    }
    if fp8_products(device, dtype):
        return serve_fp8_products(model, linears, quantization_config, device, checkpoint_dir)
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


FLOATS = "dequantized floats (sizes no multiple of 16)"


def serve_fp8_products(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    quantization_config: dict,
    device: torch.device,
    checkpoint_dir: Path | None,
) -> int:
    """The FP8 layers as FP8 products: in the file's own 128 x 128 blocks where it has them and the GPU's
    blockwise product works, else e4m3 a channel quantized once from the dequantized weights."""
    why_not = why_not_in_blocks(quantization_config, device, checkpoint_dir)
    blocks = {}
    if why_not is None:
        whole = [name for name, linear in linears.items() if all(n % BLOCK == 0 for n in linear.weight.shape)]
        for name, (weight, scale) in read_fp8_blocks(checkpoint_dir, whole).items():
            blocks[name] = Fp8BlockLinear(weight.to(device), scale.to(device), linears[name].bias)
    served, converted = Counter(), 0
    for name, linear in linears.items():
        if name in blocks:
            replace_module(model, name, blocks[name])
            served[f"the file's {blocks[name].served_as}"] += 1
        elif fits_fp8_products(*linear.weight.shape):
            layer = channel_layer(*e4m3_channels(linear.weight.to(device)), linear.bias)
            replace_module(model, name, layer)
            served[f"{layer.served_as}, converted once from the blocks' weights"] += 1
            converted += 1
        else:
            served[FLOATS] += 1
    log.info(
        "FP8 checkpoint: %d linear layers on %s served as %s%s",
        len(linears),
        device,
        described(served),
        f" (not in blocks: {why_not})" if why_not and converted else "",
    )
    return len(linears) - served[FLOATS]


def why_not_in_blocks(
    quantization_config: dict, device: torch.device, checkpoint_dir: Path | None
) -> str | None:
    """None where the checkpoint's layers can be served in its own blocks, else why not."""
    if list(quantization_config.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        return f"its blocks are {quantization_config.get('weight_block_size')}, not {BLOCK} x {BLOCK}"
    if checkpoint_dir is None:
        return "its files were not found"
    return blockwise_products_work(device)


def read_fp8_blocks(checkpoint_dir: Path, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each named layer's e4m3 weights and its scale for every 128 x 128 (`weight_scale_inv`, which the
    weights are multiplied by) as the checkpoint's files hold them."""
    wanted = {f"{name}.{part}": (name, part) for name in names for part in ("weight", "weight_scale_inv")}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for path in checkpoint_files(str(checkpoint_dir)):
        with safe_open(path, framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (a safetensors file is no dict)
                if key in wanted:
                    name, part = wanted[key]
                    parts.setdefault(name, {})[part] = file.get_tensor(key)
    return {
        name: (tensors["weight"], tensors["weight_scale_inv"])
        for name, tensors in parts.items()
        if len(tensors) == 2 and tensors["weight"].dtype == FP8
    }

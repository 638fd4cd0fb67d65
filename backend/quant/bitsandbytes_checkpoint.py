"""bitsandbytes checkpoints ("-bnb-4bit" repositories, Unsloth's among them, and "load_in_8bit" ones),
read by this server itself: the library is not needed to serve them.

transformers saves a model that bitsandbytes quantized with, for each quantized linear layer:

    4-bit (NF4 or FP4): weight uint8 [n / 2, 1] (or another dtype's bytes, `bnb_4bit_quant_storage`),
        two 4-bit codes a byte, the first weight's in the high nibble, the layer's weights in row-major
        order; weight.quant_map float32 [16], the value of each code; weight.absmax, the largest
        magnitude of each `blocksize` (64) weights: float32, or with double quantization
        (`bnb_4bit_use_double_quant`) uint8 codes of weight.nested_quant_map [256], each 256 of them
        scaled by a float32 of weight.nested_absmax, plus nested_offset; weight.quant_state.
        bitsandbytes__nf4 (or __fp4): the rest as JSON bytes (quant_type, blocksize, dtype, shape,
        nested_blocksize, nested_offset).
    8-bit (LLM.int8): weight int8 [out, in]; SCB float32 [out], each row's largest magnitude;
        weight_format, 0 for rows.

and dequantizes them (functional.py's dequantize_4bit and int8_vectorwise_dequant, the default backend's
code) as

    4-bit: w = quant_map[code] * absmax[i / blocksize], in float32 (absmax itself nested_quant_map[a] *
        nested_absmax[j / nested_blocksize] + nested_offset where double quantized)
    8-bit: w = weight * SCB * (1 / 127 in float32)

The model is built from those weights in the start's dtype (the exact mode's float32 is the
reference), which are the dense copy for many rows. Then:

    4-bit: NF4's and FP4's 16 values are spaced unevenly, which the engine's 4-bit blocks (16 even
        steps) cannot hold: 8-bit blocks of 32 converted once, where the CPU multiplies blocks (a byte
        a weight), each block's scale the one its codes round nearest at (`FourBitLayer.eight_bit`),
        else the dequantized floats.
    8-bit: an Int8Linear of the checkpoint's own int8 weights and SCB / 127 a channel (fp16 in the
        CPU's blocks, within 2^-11 of it; PyTorch's int8 kernel where there are none, GPUs included).

LLM.int8's split of outlier activations (threshold 6.0) is how its kernel keeps int8 activations
accurate; the weights are these either way, and activations stay floats here.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from backend.quant.checkpoint_layers import described, serve_layers
from backend.quant.gguf_types import BLOCK, EightBitWeight, fp16_at_least, requantize_int8
from backend.quant.group_wise import UnsupportedCheckpoint, read_tensors

log = logging.getLogger(__name__)

METHOD = "bitsandbytes"
FOUR_BIT_STATE = ".weight.quant_state.bitsandbytes__"  # then "nf4" or "fp4"
FOUR_BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
ROWS = 0  # weight_format of LLM.int8's row-major weights (the others are old GPU tile layouts)
INVERSE_127 = 7.874015718698502e-3  # the library's float32 1 / 127
# A block's largest weight at 100..127 times its scale: the one whose grid its codes fall nearest. NF4's
# 16 values fit no one grid well: on SmolLM2's NF4 checkpoint the served model's perplexity was +0.60%
# from the file's dequantized weights' where the plain conversion (the largest at 127) gave +1.36%
# (docs/performance.md, 2026-12-04).
LARGEST_STEPS = torch.arange(100, 128, dtype=torch.float32)
BLOCKS_AT_ONCE = 1 << 18  # 32-weight blocks whose errors are weighed in one pass (bounds the memory)


@dataclass(frozen=True)
class BitsAndBytesFormat:
    bits: int  # 4 or 8
    quant_type: str  # "nf4", "fp4" or "int8"

    def describe(self) -> str:
        return self.quant_type.upper() if self.bits == 4 else "LLM.int8"


def checkpoint_format(quantization_config: dict | None) -> BitsAndBytesFormat | None:
    """The format of a checkpoint whose config.json has this `quantization_config`: None where it is no
    bitsandbytes checkpoint."""
    if not quantization_config or quantization_config.get("quant_method") != METHOD:
        return None
    if quantization_config.get("load_in_4bit"):
        return BitsAndBytesFormat(4, str(quantization_config.get("bnb_4bit_quant_type", "fp4")))
    if quantization_config.get("load_in_8bit"):
        return BitsAndBytesFormat(8, "int8")
    raise UnsupportedCheckpoint("a bitsandbytes checkpoint quantized neither to 4 nor to 8 bits")


@dataclass(frozen=True)
class FourBitLayer:
    """One NF4 or FP4 layer as stored, its absmax already dequantized."""

    codes: torch.Tensor  # uint8 [n / 2], two codes a byte, the first in the high nibble
    quant_map: torch.Tensor  # float32 [16]
    absmax: torch.Tensor  # float32 [blocks]
    blocksize: int
    shape: tuple[int, int]
    quant_type: str  # "nf4" or "fp4"

    @property
    def conversion(self) -> str:
        return f"the dequantized {self.quant_type.upper()} weights"

    def four_bit(self) -> None:  # 16 uneven values: no 4-bit block holds them
        return None

    def eight_bit(self) -> None:
        return None

    def fp8(self) -> None:
        return None

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [out, in] as the library's dequantize_4bit gives them before its cast."""
        count = self.shape[0] * self.shape[1]
        codes = torch.stack([self.codes >> 4, self.codes & 0xF], dim=1).reshape(-1)[:count]
        values = self.quant_map[codes.int()]
        whole = count // self.blocksize  # blocks; a last one may be short
        weights = torch.empty(count)
        cut = whole * self.blocksize
        weights[:cut] = (values[:cut].view(whole, self.blocksize) * self.absmax[:whole, None]).reshape(-1)
        if cut < count:
            weights[cut:] = values[cut:] * self.absmax[whole]
        return weights.reshape(self.shape)

    def converted(self) -> EightBitWeight:
        """These weights in 8-bit blocks of 32, each block's scale its largest weight / s, s of LARGEST_STEPS
        the one at which its weights round least far. A block's weights are absmax times its codes' values,
        so the error at s is found from how many of each code it holds, not from every weight."""
        out_features, in_features = self.shape
        count = out_features * in_features
        codes = torch.stack([self.codes >> 4, self.codes & 0xF], dim=1).reshape(-1)[:count].long()
        codes = codes.reshape(-1, BLOCK)
        absmax = self.absmax.repeat_interleave(self.blocksize // BLOCK)[: len(codes)]  # each block's own
        q = torch.empty_like(codes, dtype=torch.int8)
        scale = torch.empty(len(codes))
        for first in range(0, len(codes), BLOCKS_AT_ONCE):
            part = slice(first, first + BLOCKS_AT_ONCE)
            q[part], scale[part] = self.blocks_in_eight_bits(codes[part], absmax[part])
        return EightBitWeight(q.reshape(self.shape), scale.reshape(out_features, in_features // BLOCK))

    def blocks_in_eight_bits(
        self, codes: torch.Tensor, absmax: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[blocks, 32] codes and each block's absmax to int8 values and each block's fp16 scale."""
        values = self.quant_map
        largest = values.abs()[codes].amax(dim=1)  # of the code values, [blocks]
        counts = torch.zeros(len(codes), 16).scatter_add_(
            1, codes, torch.ones_like(codes, dtype=torch.float32)
        )
        errors = torch.empty(len(codes), len(LARGEST_STEPS))
        for value in largest.unique():  # at most 16: the blocks whose largest code is this one share a grid
            steps = LARGEST_STEPS / value.clamp(min=1e-30)  # a code value's steps at each s
            scaled = values[:, None] * steps  # [16, s]
            grid_errors = ((scaled - torch.round(scaled)) / steps).square()
            blocks = largest == value
            errors[blocks] = counts[blocks] @ grid_errors
        best = LARGEST_STEPS[errors.argmin(dim=1)]
        scale = fp16_at_least(largest * absmax / best)
        weights = values[codes] * absmax[:, None]
        q = torch.round(weights / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127)
        return q.to(torch.int8), scale


@dataclass(frozen=True)
class EightBitLayer:
    """One LLM.int8 layer as stored."""

    q: torch.Tensor  # int8 [out, in]
    row_max: torch.Tensor  # float32 [out] (SCB)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [out, in] as the library's int8_vectorwise_dequant gives them."""
        return self.q * self.row_max.view(-1, 1) * INVERSE_127

    conversion = "the dequantized weights"

    def four_bit(self) -> None:
        return None

    def fp8(self) -> None:
        return None

    def eight_bit(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its own int8 values and each row's scale, SCB / 127."""
        return self.q, self.row_max * INVERSE_127

    def converted(self) -> EightBitWeight:  # not taken: its own values serve wherever int8 does
        return requantize_int8(self.dequantize().numpy())


def four_bit_layer(parts: dict[str, torch.Tensor], state: dict, name: str) -> FourBitLayer:
    """A 4-bit layer from its tensors (`weight`, `absmax`, `quant_map`, ...) and its JSON state."""
    if state.get("quant_type") not in ("nf4", "fp4") or len(state.get("shape") or ()) != 2:
        raise UnsupportedCheckpoint(
            f"{name}: a bitsandbytes 4-bit layer of type {state.get('quant_type')!r} and shape "
            f"{state.get('shape')}: only NF4 and FP4 linear layers are read"
        )
    absmax = parts["absmax"]
    if "nested_absmax" in parts:  # double quantization: absmax as 8-bit codes, blocks of their own
        blocks = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
        nested = parts["nested_quant_map"].float()[absmax.long()] * parts["nested_absmax"].float()[blocks]
        absmax = nested + float(state["nested_offset"])
    codes = parts["weight"].contiguous().view(torch.uint8).reshape(-1)
    shape = (int(state["shape"][0]), int(state["shape"][1]))
    quant_map, blocksize = parts["quant_map"].float(), int(state["blocksize"])
    return FourBitLayer(codes, quant_map, absmax.float(), blocksize, shape, state["quant_type"])


def read_checkpoint(
    location: str, fmt: BitsAndBytesFormat, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, FourBitLayer | EightBitLayer]]:
    """The checkpoint's state dict with each quantized layer's weight dequantized to `dtype` (what the
    model is built from), and those layers as stored, by module name."""
    tensors = read_tensors(location)
    layers: dict[str, FourBitLayer | EightBitLayer] = {}
    for key in [key for key in tensors if FOUR_BIT_STATE in key]:
        module = key.split(FOUR_BIT_STATE)[0]
        state = json.loads(bytes(tensors.pop(key).tolist()).decode("utf-8"))
        parts = {"weight": tensors.pop(f"{module}.weight")}
        parts |= {
            p: tensors.pop(f"{module}.weight.{p}")
            for p in FOUR_BIT_PARTS
            if f"{module}.weight.{p}" in tensors
        }
        layers[module] = four_bit_layer(parts, state, module)
    for key in [key for key in tensors if key.endswith(".SCB")]:
        module = key.removesuffix(".SCB")
        layout = tensors.pop(f"{module}.weight_format", torch.tensor(ROWS))
        if int(layout) != ROWS:
            raise UnsupportedCheckpoint(
                f"{module}: LLM.int8 weights in the GPU tile layout {int(layout)}: only row-major ones "
                "are read"
            )
        layers[module] = EightBitLayer(
            tensors.pop(f"{module}.weight").to(torch.int8), tensors.pop(key).float()
        )
    if not layers:
        raise UnsupportedCheckpoint(f"a bitsandbytes {fmt.describe()} checkpoint with no quantized layers")
    for module, layer in layers.items():
        tensors[f"{module}.weight"] = layer.dequantize().to(dtype)
    return tensors, layers


def serve_bitsandbytes(
    model: nn.Module, layers: dict[str, FourBitLayer | EightBitLayer], fmt: BitsAndBytesFormat
) -> Counter:
    """Replace each quantized layer by a weight-only one (module docstring), its dequantized weights the
    dense copy for many rows. Returns how many were served each way."""
    served = serve_layers(model, layers)
    log.info(
        "bitsandbytes checkpoint (%s): %d linear layers served as %s, their dequantized weights kept for "
        "many rows; activations stay floats",
        fmt.describe(),
        len(layers),
        described(served),
    )
    return served

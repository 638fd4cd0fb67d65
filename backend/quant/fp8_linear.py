"""FP8 products on a GPU that has them: float8 e4m3 weights times float8 activations by `torch._scaled_mm`.

An FP8 checkpoint read as floats ("-FP8" and "-FP8-dynamic" repositories) multiplies twice its file's
bytes a step. From Ada and Hopper on (compute capability 8.9) the GPU multiplies float8 e4m3 in its
tensor cores, at twice bfloat16's rate, so such a layer is served as vLLM serves it:

    weights: e4m3 with a float32 scale an output channel, the checkpoint's own values where it has a
        scale a channel or a tensor (compressed-tensors' FP8), else quantized once from its dequantized
        weights (`e4m3_channels`)
    activations: quantized to e4m3 as they come, a scale a row (its largest value at 448)
    product: `torch._scaled_mm` with both scales, accumulated in float32, out in bfloat16

and a checkpoint with a scale for every 128 x 128 weights (transformers' `fp8`) in those very blocks
(`Fp8BlockLinear`, below).

The weights and scales are kept as their bits (uint8, int32): the model's `.to(dtype)` casts every
floating tensor, float8 included, and would turn them into floats without their scales, the trap
transformers' own FP8 layers fell in (loader.load_weights). Every operation stays on the device, so the
decode graphs capture the layer as they capture any other.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# cuBLAS's FP8 products take inner and output sizes in multiples of 16
FP8_ALIGNMENT = 16
BLOCK = 128  # the side of the weights' blocks that torch's blockwise FP8 product takes


def fp8_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` multiply in FP8: a CUDA GPU of compute capability 8.9 or
    more (Ada, Hopper, Blackwell), bfloat16 (the only output `_scaled_mm` gives with a scale a row)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fits_fp8_products(out_features: int, in_features: int) -> bool:
    return out_features % FP8_ALIGNMENT == 0 and in_features % FP8_ALIGNMENT == 0


class Fp8Layer(nn.Module):
    """What the FP8 layers share: e4m3 weights [out, in] and float32 scales, kept as their bits."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        scale = scale.to(device=weight.device, dtype=torch.float32)
        self.register_buffer("weight_bits", weight.to(FP8).contiguous().view(torch.uint8), persistent=False)
        self.register_buffer("scale_bits", scale.contiguous().view(torch.int32), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_bits.view(FP8)


class Fp8Linear(Fp8Layer):
    """`nn.Linear` of float8 e4m3 weights with a scale an output channel, its inputs quantized to e4m3 a
    row as they come: w = weight * scale[out], x = x8 * x_scale[row]."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        """weight: [out, in] float8 e4m3; scale: [out] (or one for the whole tensor), float32."""
        super().__init__(weight, scale.reshape(-1).expand(weight.shape[0]), bias)

    served_as = "e4m3 a channel, activations e4m3 a row"

    @property
    def scale(self) -> torch.Tensor:
        return self.scale_bits.view(torch.float32)

    def dequantized(self) -> torch.Tensor:
        """The weights this layer multiplies by, in float32 [out, in]."""
        return self.weight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        x8, x_scale = quantize_groups(flat, self.in_features)  # a scale a row: [rows, 1]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = torch._scaled_mm(
            x8,
            self.weight.t(),  # column-major, as cuBLAS wants the second operand
            scale_a=x_scale,
            scale_b=self.scale[None, :],
            bias=bias,
            out_dtype=x.dtype,
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, FP8 e4m3 a channel"


class Fp8BlockLinear(Fp8Layer):
    """An FP8 layer whose inputs are quantized to e4m3 with a scale for every 128 of a row, multiplied by
    `torch.nn.functional.scaled_mm`'s blockwise product (which cuBLAS runs on Hopper), its weights with

        a scale for every 128 x 128 of them (DeepSeek's and Qwen's "-FP8" files, served with their very
            weights and scales; BlockWise1x128 by BlockWise128x128): w = weight * scale[out / 128, in / 128]
        or a scale a channel, as a scale for every 128 inputs of a channel (BlockWise1x128 by
            BlockWise1x128; `of_channels`): w = weight * scale[out, in / 128]

    Requantizing a 128 x 128 layer to a scale a channel rounds every weight a second time: +1.8%
    perplexity on SmolLM2 where its own blocks gave +0.2%; and a scale for every 128 of a row rounds
    inputs nearer than one a row (+0.6% where a row's gave +1.2%; docs/performance.md, "FP8 products").
    Where the GPU's blockwise product fails the start's check (`blockwise_products_work`), the loader
    serves an Fp8Linear instead. Off CUDA the product is computed in float32 from the same e4m3 values
    and scales (`emulated`), the reference the check holds the GPU's to, and what the tests run on a CPU."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        """weight: [out, in] float8 e4m3, in a multiple of 128; scale: [out / 128, in / 128] (out too a
        multiple of 128) or [out, in / 128], float32."""
        out_features, in_features = weight.shape
        inner = in_features // BLOCK
        if (
            in_features % BLOCK == 0
            and out_features % BLOCK == 0
            and scale.shape == (out_features // BLOCK, inner)
        ):
            rows_a_scale = BLOCK
            # cuBLAS takes these scales with the inner blocks a multiple of 4 (padding never read)
            stored = nn.functional.pad(scale.float(), (0, -inner % 4))
        elif in_features % BLOCK == 0 and scale.shape == (out_features, inner):
            rows_a_scale = 1
            stored = scale.float().t()  # kept transposed: cuBLAS reads a row's scales column-major
        else:
            raise ValueError(f"{tuple(weight.shape)} weights with {tuple(scale.shape)} scales of 128 inputs")
        super().__init__(weight, stored, bias)
        self.rows_a_scale = rows_a_scale

    @classmethod
    def of_channels(
        cls, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> Fp8BlockLinear:
        """e4m3 weights [out, in] with a scale a channel ([out]), that scale for every 128 of its inputs."""
        out_features, in_features = weight.shape
        return cls(weight, scale.float().reshape(-1, 1).expand(out_features, in_features // BLOCK), bias)

    @property
    def served_as(self) -> str:
        weights = f"{BLOCK} x {BLOCK} blocks" if self.rows_a_scale == BLOCK else "e4m3 a channel"
        return f"{weights}, activations e4m3 a {BLOCK} of a row"

    @property
    def scale(self) -> torch.Tensor:
        stored = self.scale_bits.view(torch.float32)
        return stored[:, : self.in_features // BLOCK] if self.rows_a_scale == BLOCK else stored.t()

    def dequantized(self) -> torch.Tensor:
        spread = self.scale.repeat_interleave(self.rows_a_scale, dim=0).repeat_interleave(BLOCK, dim=1)
        return self.weight.float() * spread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows % 4:  # cuBLAS's blockwise products take the rows' scales a multiple of 4 rows long
            flat = nn.functional.pad(flat, (0, 0, 0, -rows % 4))
        x8, x_scale = quantize_groups(flat)
        out = self.product(x8, x_scale, x.dtype)[:rows]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def product(self, x8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x8 [rows, in] e4m3 with a scale a 128 of a row [rows, in / 128] times the weights, in `dtype`."""
        if x8.device.type != "cuda":
            return self.emulated(x8, x_scale).to(dtype)
        return nn.functional.scaled_mm(
            x8,
            self.weight.t(),
            x_scale.t().contiguous().t(),  # rows' scales column-major, as cuBLAS reads them
            nn.functional.ScalingType.BlockWise1x128,
            self.scale_bits.view(torch.float32).t(),  # [in / 128 (padded), out / 128], or [out, in / 128]
            nn.functional.ScalingType.BlockWise128x128
            if self.rows_a_scale == BLOCK
            else nn.functional.ScalingType.BlockWise1x128,
            output_dtype=dtype,
        )

    def emulated(self, x8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The product in float32 from the same e4m3 values and scales: [rows, out]."""
        inputs = (x8.float().view(x8.shape[0], -1, BLOCK) * x_scale[..., None]).view(x8.shape)
        return inputs @ self.dequantized().T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, FP8 {self.served_as}"


def e4m3_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [out, in] quantized once to e4m3 with a float32 scale a channel (its largest weight
    at 448): the values and the scales [out]."""
    weight = weight.detach().float()
    scale = (weight.abs().amax(dim=-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def channel_layer(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Fp8Layer:
    """An FP8 layer of e4m3 weights [out, in] with a scale a channel ([out]), on their device: its inputs a
    scale for every 128 of a row (Fp8BlockLinear) where `in` is a multiple of 128 and the device's
    blockwise product passes the start's check, else a scale a row (Fp8Linear)."""
    if weight.shape[1] % BLOCK == 0 and blockwise_products_work(weight.device, rows_a_scale=1) is None:
        return Fp8BlockLinear.of_channels(weight, scale, bias)
    return Fp8Linear(weight, scale, bias)


def quantize_groups(flat: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, in] to e4m3 with a scale for every `group` of a row (its largest value at 448): the values
    and the scales, [rows, in / group] float32.

    One reduction, two operations on the scales, one division and one cast, in as few kernels as they
    take (each a launch in a decode step). A group's largest value divided by its scale rounds to 448 at
    most (e4m3 reaches NaN from 480 up), so no clamp; an all-zero group gets a scale of 1e-12 and zeros,
    not 0 / 0."""
    groups = flat.view(flat.shape[0], -1, group)
    largest = torch.linalg.vector_norm(groups, math.inf, dim=-1, dtype=torch.float32)
    x_scale = largest.div_(FP8_MAX).clamp_(min=1e-12)
    return (groups / x_scale[..., None]).to(FP8).view(flat.shape), x_scale


@functools.cache
def blockwise_products_work(device: torch.device, rows_a_scale: int = BLOCK) -> str | None:
    """None where this device's blockwise FP8 product, the weights' scales a 128 x 128 (`rows_a_scale`
    128) or a channel's for every 128 inputs (1), gives its float32 emulation's (within bfloat16's
    rounding) on a random layer of 256 x 512 and 5 rows; else what went wrong, for the log. cuBLAS runs
    it on Hopper from CUDA 12.9 on; nothing here can check it without one, so every start does."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 512, generator=generator) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scale = torch.rand(256 // rows_a_scale, 4, generator=generator) * 0.01 + 0.001
    layer = Fp8BlockLinear(weight, scale, None).to(device)
    x = torch.randn(5, 512, generator=generator).to(device=device, dtype=torch.bfloat16)
    try:
        got = layer(x).float()
    except (RuntimeError, NotImplementedError, ValueError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    x8, x_scale = quantize_groups(nn.functional.pad(x, (0, 0, 0, 3)))
    expected = layer.emulated(x8, x_scale)[:5]
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    return None if error < 2**-6 else f"its products were {error:.3g} of their largest off the emulation's"

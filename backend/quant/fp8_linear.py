"""FP8 products on a GPU that has them: float8 e4m3 weights times float8 activations by `torch._scaled_mm`.

An FP8 checkpoint read as floats ("-FP8" and "-FP8-dynamic" repositories) multiplies twice its file's
bytes a step. From Ada and Hopper on (compute capability 8.9) the GPU multiplies float8 e4m3 in its
tensor cores, at twice bfloat16's rate, so such a layer is served as vLLM serves it:

    weights: e4m3 with a float32 scale an output channel, the checkpoint's own values where it has a
        scale a channel or a tensor (compressed-tensors' FP8), else quantized once from its dequantized
        weights (transformers' `fp8`, a scale for every 128 x 128: `of_weights`)
    activations: quantized to e4m3 as they come, a scale a row (its largest value at 448)
    product: `torch._scaled_mm` with both scales, accumulated in float32, out in bfloat16

The weights and scales are kept as their bits (uint8, int32): the model's `.to(dtype)` casts every
floating tensor, float8 included, and would turn them into floats without their scales, the trap
transformers' own FP8 layers fell in (loader.load_weights). Every operation stays on the device, so the
decode graphs capture the layer as they capture any other.
"""

from __future__ import annotations

import math

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# cuBLAS's FP8 products take inner and output sizes in multiples of 16
FP8_ALIGNMENT = 16


def fp8_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` multiply in FP8: a CUDA GPU of compute capability 8.9 or
    more (Ada, Hopper, Blackwell), bfloat16 (the only output `_scaled_mm` gives with a scale a row)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fits_fp8_products(out_features: int, in_features: int) -> bool:
    return out_features % FP8_ALIGNMENT == 0 and in_features % FP8_ALIGNMENT == 0


class Fp8Linear(nn.Module):
    """`nn.Linear` of float8 e4m3 weights with a scale an output channel, its inputs quantized to e4m3 a
    row as they come: w = weight * scale[out], x = x8 * x_scale[row]."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        """weight: [out, in] float8 e4m3; scale: [out] (or one for the whole tensor), float32."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        scale = scale.to(device=weight.device, dtype=torch.float32).reshape(-1).expand(self.out_features)
        self.register_buffer("weight_bits", weight.to(FP8).contiguous().view(torch.uint8), persistent=False)
        self.register_buffer("scale_bits", scale.contiguous().view(torch.int32), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of_weights(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        """Quantized once from float weights [out, in]: each channel's largest weight at 448."""
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        return cls((weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_bits.view(FP8)

    @property
    def scale(self) -> torch.Tensor:
        return self.scale_bits.view(torch.float32)

    def dequantized(self) -> torch.Tensor:
        """The weights this layer multiplies by, in float32 [out, in]."""
        return self.weight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each row's largest value at 448: one reduction, two operations on a column of a value a row,
        # one division and one cast, in as few kernels as they take (each a launch in a decode step). A
        # row's largest value divided by its scale rounds to 448 at most (e4m3 reaches NaN from 480 up), so
        # no clamp; an all-zero row gets a scale of 1e-12 and zeros, not 0 / 0.
        flat = x.reshape(-1, self.in_features)
        largest = torch.linalg.vector_norm(flat, math.inf, dim=-1, keepdim=True, dtype=torch.float32)
        x_scale = largest.div_(FP8_MAX).clamp_(min=1e-12)
        x8 = (flat / x_scale).to(FP8)
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

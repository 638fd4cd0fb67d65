"""The many-rows path of quantized layers on a CPU: int8 activations times int8 weights (SmoothQuant).

A prefill, or a decode step of 16 rows or more, is bound by arithmetic, not
by reading weights, and on a CPU without AMX bfloat16 arithmetic is slow:
on the 2-core AMD EPYC of docs/performance.md SmolLM2's projections took
61 ms for 32 rows and 691 ms for 512 through the dense bfloat16 copies, and
24 and 159 ms as int8 times int8 (`torch._int_mm`, VNNI), scaled back to
floats. Each row of activations gets its own scale, at run time; each
output channel of the weights its own, at load time.

Rounding activations to 8 bits loses little, except in the few input
channels where they run far larger than elsewhere: one such channel sets
the scale of the whole row. SmoothQuant (Xiao et al., 2023) moves that
range into the weights, exactly: with a per-channel factor s,
x @ W.T = (x / s) @ (W * s).T, and s_j = amax(x_j)^ALPHA / amax(W_j)^(1 - ALPHA)
evens out both sides. amax(x_j) is measured once at load time, on a short
text shipped with the package (calibration.py); layers that read one input
(q, k and v; gate and up) share one s, so that they can still be fused.

Perplexity on scripts/perplexity_text.txt: within 1% of float32 for the
projections; the head stays in bfloat16 (int8 activations there cost
another half per cent, and its bfloat16 copy is the input embedding, free).
"""

from __future__ import annotations

import torch

from backend.kernels.extension import extension

ALPHA = 0.6  # how much of the activations' range moves into the weights (best of 0.5-0.85 measured)


def smoothed_int8_matmul(
    x: torch.Tensor,
    weight_int8: torch.Tensor,
    weight_scales: torch.Tensor,
    smoothing: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x [rows, in] @ W.T, where W * s = weight_int8 * weight_scales[:, None] and smoothing = 1 / s.

    Returns [rows, out] in `dtype`. The rounding of x to int8 and the scaling back are one loop each
    where the fused CPU operations are built (kernels/extension.py): as the eleven operations below, they
    took as long as the int8 product itself at 32 rows."""
    fused = extension() if x.device.type == "cpu" and x.is_contiguous() else None
    if fused is not None and dtype in (torch.float32, torch.bfloat16):
        x_int8, row_scales = fused.quantize_rows(x, smoothing)
        return fused.scale_products(torch._int_mm(x_int8, weight_int8.t()), row_scales, weight_scales, dtype)
    smoothed = x.float() * smoothing
    row_scales = smoothed.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    x_int8 = (smoothed / row_scales).round().to(torch.int8)  # |x / scale| <= 127: no clamp needed
    accumulated = torch._int_mm(x_int8, weight_int8.t())  # int32: products of 8-bit values, summed exactly
    return (accumulated * (row_scales * weight_scales)).to(dtype)


def smoothing_factors(input_ranges: torch.Tensor, weight_ranges: torch.Tensor) -> torch.Tensor:
    """1 / s per input channel, from the largest absolute inputs and weights seen in each."""
    s = input_ranges.clamp(min=1e-5) ** ALPHA / weight_ranges.clamp(min=1e-5) ** (1 - ALPHA)
    return 1 / s.clamp(min=1e-5)


def quantize_smoothed(dense: torch.Tensor, smoothing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weights (per output channel, symmetric) and their scales [out] of dense [out, in] * s.

    The weights' channels are rounded as a step's activation rows are (`smoothed_int8_matmul`), by the same
    loop where the fused CPU operations are built: as the operations below, with their float32 temporaries
    of the whole layer, they took 124 ms for one 8192 x 2048 projection of a 1B model, 5.7 s of its start's
    calibration, against 12 ms."""
    s = 1 / smoothing  # the weights' side of x @ W.T = (x / s) @ (W * s).T
    fused = extension() if dense.device.type == "cpu" and dense.is_contiguous() else None
    if fused is not None and dense.dtype in (torch.float32, torch.bfloat16):
        weight_int8, scales = fused.quantize_rows(dense, s.float().contiguous())
        return weight_int8, scales.view(-1)
    smoothed = dense.float() * s
    scales = smoothed.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (smoothed / scales[:, None]).round().to(torch.int8), scales  # |w / scale| <= 127: no clamp needed

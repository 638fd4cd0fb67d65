"""Weights in blocks of 32 for the CPU's int8 dot products (block_matmul.cpp), as llama.cpp serves them.

A decode step of few rows reads every weight once and does two operations
with it, so a CPU should run at the speed of its memory. PyTorch's
weight-only kernels did not: on the 2-core AMD EPYC that measures this
project (Zen 4, AVX-512 VNNI), `_weight_int4pack_mm_for_cpu` read the
default model's 4-bit layers at 15 GB/s and `_weight_int8pack_mm` its head at
10 where a plain sum reads 30 (docs/performance.md): they turn each weight
into a float first. `block_matmul` instead rounds each block of 32
activations to int8 with a scale (as llama.cpp's Q8_1) and multiplies by
VNNI's 8-bit dot products, the 4-bit or 8-bit weights as they are (on a CPU
without AVX-512 VNNI, by AVX2's vpmaddubsw eight channels at a time: one row
of the default model's projections and head 1.0 ms against 0.9 with VNNI and
2.8 with PyTorch's kernels, timed here on the EPYC):

    w = d * u + m, u in 0..15 (4-bit) or 0..255 (8-bit, m = -128 d),
    one fp16 d (and 4-bit, one fp16 m) per block of 32 inputs of a channel.

GGUF's Q4_0, Q4_1 and Q8_0 blocks map onto these exactly. The activations'
rounding costs a few times bfloat16's (tests/backend/test_block_weights.py)
and the default model +0.3% perplexity (docs/performance.md).

Layout, for each group of 16 output channels and each block of 32 inputs
(the blocks of a group follow each other, the groups too): the 16 channels'
values side by side, four consecutive inputs of one channel a 32-bit lane,
so that a 64-byte line feeds one vpdpbusd; 4-bit values pack two lines
into one (line 2c in the low nibbles, 2c + 1 in the high); then the 16
channels' d, and (4-bit) their m, as fp16. A layer's blocks are a uint8
tensor [out, in / 32 * bytes], 20 bytes a channel's block in 4 bits and 34
in 8 (Q4_1's and Q8_0's own sizes), so that its first dimension is the
layer's outputs: it slices and concatenates by whole groups of 16 like any
weight (quantized_linear.fuse_linears).
"""

from __future__ import annotations

import torch

from backend.kernels import extension as kernels

BLOCK = 32  # inputs a scale covers
CHANNELS = 16  # output channels stored side by side, one a vector lane
BYTES_PER_CHANNEL = {4: 20, 8: 34}  # a channel's share of a block: its values and scales


def available(device: torch.device) -> bool:
    """Whether layers on `device` multiply by `matmul`: a CPU with AVX-512 VNNI or AVX2, the extension
    built."""
    return kernel(device) != ""


def kernel(device: torch.device) -> str:
    """What `matmul` multiplies by on `device`: "AVX-512 VNNI", "AVX2", or "" (no blocks there)."""
    if device.type != "cpu":
        return ""
    extension = kernels.extension()
    return extension.block_matmul_kernel() if extension is not None else ""


def fits(out_features: int, in_features: int) -> bool:
    return out_features % CHANNELS == 0 and in_features % BLOCK == 0


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q [out, in] values 0..15, scale and zero [out, in / 32], w = (q - 8) * scale + zero (Int4Linear's
    terms), as 4-bit blocks: d = scale, m = zero - 8 * scale."""
    lanes = interleave(q.to(torch.uint8))  # [groups, blocks, 8 lines, 64]
    nibbles = lanes[:, :, 0::2] | (lanes[:, :, 1::2] << 4)  # [groups, blocks, 4, 64]
    return assemble(nibbles, [scale, zero - 8 * scale], q.shape)


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [out, in] int8, scale [out, in / 32] (a block's) or [out] (a channel's), w = q * scale, as 8-bit
    blocks: u = q + 128, d = scale."""
    out_features, in_features = q.shape
    scale = scale if scale.dim() == 2 else scale[:, None].expand(out_features, in_features // BLOCK)
    unsigned = (q.to(torch.int16) + 128).to(torch.uint8)
    return assemble(interleave(unsigned), [scale], q.shape)


def interleave(values: torch.Tensor) -> torch.Tensor:
    """[out, in] bytes to [groups, blocks, 8, 64]: line j of a block, inputs 4j..4j+3 of its 16 channels."""
    out_features, in_features = values.shape
    lanes = values.reshape(out_features // CHANNELS, CHANNELS, in_features // BLOCK, 8, 4)
    return lanes.permute(0, 2, 3, 1, 4).reshape(out_features // CHANNELS, in_features // BLOCK, 8, 64)


def assemble(values: torch.Tensor, scales: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """[out, bytes]: each block's values, then each of `scales` ([out, in / 32]) for its channels in fp16."""
    out_features, in_features = shape
    groups, blocks = out_features // CHANNELS, in_features // BLOCK
    halves = [
        s.to(torch.float16).reshape(groups, CHANNELS, blocks).transpose(1, 2).contiguous().view(torch.uint8)
        for s in scales
    ]
    joined = torch.cat([values.reshape(groups, blocks, -1), *halves], dim=-1)
    return joined.reshape(out_features, -1).contiguous()


def bits_of(blocks: torch.Tensor, in_features: int) -> int:
    per_channel = blocks.shape[1] // (in_features // BLOCK)
    return next(bits for bits, size in BYTES_PER_CHANNEL.items() if size == per_channel)


def matmul(x: torch.Tensor, blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """x [rows, in] (float32 or bfloat16) @ the blocks' weights.T -> [rows, out] in x's dtype. Compiled
    (torch.compile), as the custom operator `block_matmul_op` the compiler can place in its graph."""
    if torch.compiler.is_compiling():
        return block_matmul_op(x, blocks, bits)
    return kernels.extension().block_matmul(x, blocks, bits)


@torch.library.custom_op("inference::block_matmul", mutates_args=())
def block_matmul_op(x: torch.Tensor, blocks: torch.Tensor, bits: int) -> torch.Tensor:
    return kernels.extension().block_matmul(x.contiguous(), blocks, bits)


@block_matmul_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, bits: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def dequantize(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weights [out, in] the blocks hold: what `matmul` multiplies by (for tests and checks)."""
    bits = bits_of(blocks, in_features)
    out_features = blocks.shape[0]
    groups, count = out_features // CHANNELS, in_features // BLOCK
    per_block = blocks.reshape(groups, count, -1)
    value_bytes = 256 if bits == 4 else 512
    raw = per_block[..., :value_bytes].reshape(groups, count, -1, 64)
    lines = torch.stack([raw & 0x0F, raw >> 4], dim=3).flatten(2, 3) if bits == 4 else raw
    u = lines.reshape(groups, count, 8, CHANNELS, 4).permute(0, 3, 1, 2, 4).reshape(out_features, in_features)
    halves = per_block[..., value_bytes:].contiguous().view(torch.float16).float()  # [groups, count, 16k]
    by_channel = halves.reshape(groups, count, -1, CHANNELS).permute(0, 3, 1, 2)
    by_channel = by_channel.reshape(out_features, count, -1)  # d, and (4-bit) m
    d = by_channel[..., 0, None]
    u = u.float().reshape(out_features, count, BLOCK)
    weights = u * d + by_channel[..., 1, None] if bits == 4 else (u - 128) * d  # 8-bit: q * d, exactly
    return weights.reshape(out_features, in_features)

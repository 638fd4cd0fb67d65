"""GGUF's K-quant blocks written from float weights, to their documented packing (ggml-common.h's
block_q4_K, block_q5_K and block_q6_K), for test files: the gguf package reads these types but does not
write them. Not llama.cpp's quantizer (which searches each block's scale and min to lower the error),
but blocks of the same layout, checked against the gguf package's dequantization (test_gguf_types.py).

    Q4_K, per 256 inputs: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales s and mins m, 128 bytes of
        4-bit q; each 32 inputs' w = d * s * q - dmin * m.
    Q5_K: the same with 5-bit q, the fifth bits in 32 bytes before the low nibbles.
    Q6_K, per 256 inputs: 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales s (one a
        16 inputs), fp16 d; w = d * s * (q - 32).
    Q3_K, per 256 inputs: 32 bytes of third bits (hmask), 64 of low 2-bit pairs, 12 of sixteen 6-bit
        scales s + 32 (one a 16 inputs), fp16 d; w = d * s * q, q in -4..3.
    Q2_K, per 256 inputs: sixteen bytes of a 4-bit s (low nibble) and m (high one), one a 16 inputs, 64
        bytes of 2-bit q, fp16 d, fp16 dmin; w = d * s * q - dmin * m, q in 0..3.

And IQ4_NL's and IQ4_XS's (block_iq4_nl, block_iq4_xs), whose 4-bit q index 16 int8 values t:

    IQ4_NL, per 32 inputs: fp16 d, 16 bytes of q (input j's in the low nibble of byte j, j + 16's in its
        high one); w = d * t[q].
    IQ4_XS, per 256 inputs: fp16 d, each 32's 6-bit s + 32 (top two bits in a uint16, low four in 4
        bytes), then each 32's q as IQ4_NL's; w = d * s * t[q].
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

SUPER = 256


def quantize(weights: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """[..., out, in] float32 weights (a mixture's stacked experts: [experts, out, in]) to [..., out,
    bytes] uint8 rows of `kind`'s blocks."""
    writers = {
        GGMLQuantizationType.Q4_K: lambda w: scaled_with_min(w, 15),
        GGMLQuantizationType.Q5_K: lambda w: scaled_with_min(w, 31),
        GGMLQuantizationType.Q6_K: q6_k,
        GGMLQuantizationType.Q3_K: q3_k,
        GGMLQuantizationType.Q2_K: q2_k,
        GGMLQuantizationType.IQ4_NL: iq4_nl,
        GGMLQuantizationType.IQ4_XS: iq4_xs,
    }
    if kind not in writers:
        return quants.quantize(weights, kind)
    rows = np.asarray(weights, dtype=np.float32)
    supers = rows.reshape(-1, SUPER)
    return writers[kind](supers).reshape(*rows.shape[:-1], -1)


def fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def as_bytes(values: np.ndarray) -> np.ndarray:
    """[n] fp16 values to [n, 2] bytes."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def scaled_with_min(supers: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (top 15) or Q5_K (top 31) blocks of [n, 256] weights."""
    d, dmin, scales, mins, q = scales_and_mins(supers.reshape(-1, 8, 32), top, 63)
    q = q.reshape(-1, 4, 2, 32)  # chunks of 64: two blocks of 32
    nibbles = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)  # [n, 4, 32]
    parts = [as_bytes(d), as_bytes(dmin), pack_scales(scales, mins)]
    if top == 31:  # bit 4 of input 32 i + l is bit i of byte l
        high = (q.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(np.bitwise_or.reduce(high, axis=1).astype(np.uint8))
    parts.append(nibbles.reshape(-1, 128))
    return np.concatenate(parts, axis=-1)


def scales_and_mins(blocks: np.ndarray, levels: int, largest: int) -> tuple[np.ndarray, ...]:
    """[n, blocks, inputs] weights as each block's range over `levels` steps above its min (at most 0):
    each super-block's fp16 d and dmin, each block's scale and min multiples of them (0..largest, rounded
    up so that no weight falls outside its block's range) and the weights' q (0..levels), uint8."""
    low = np.minimum(blocks.min(axis=-1), 0)
    step = (blocks.max(axis=-1) - low) / levels  # [n, blocks]: each block's scale, and below its min
    d, dmin = fp16(step.max(axis=-1) / largest), fp16(-low.min(axis=-1) / largest)
    scales = np.clip(np.ceil(step / np.maximum(d.astype(np.float32), 1e-30)[:, None]), 0, largest)
    mins = np.clip(np.ceil(-low / np.maximum(dmin.astype(np.float32), 1e-30)[:, None]), 0, largest)
    block_scale = d.astype(np.float32)[:, None] * scales
    block_min = dmin.astype(np.float32)[:, None] * mins
    q = np.round((blocks + block_min[..., None]) / np.maximum(block_scale, 1e-30)[..., None])
    return d, dmin, scales.astype(np.uint8), mins.astype(np.uint8), np.clip(q, 0, levels).astype(np.uint8)


def pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins to 12 bytes: the first four of each in bytes 0-3 and 4-7 (their top two
    bits carrying the last four's), the last four's low nibbles in bytes 8-11."""
    packed = np.empty((scales.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return packed


def q6_k(supers: np.ndarray) -> np.ndarray:
    """Q6_K blocks of [n, 256] weights."""
    blocks = supers.reshape(-1, 16, 16)
    step = np.abs(blocks).max(axis=-1) / 31  # [n, 16]
    d = fp16(step.max(axis=-1) / 127)
    scales = np.clip(np.ceil(step / np.maximum(d.astype(np.float32), 1e-30)[:, None]), 0, 127)
    block_scale = d.astype(np.float32)[:, None] * scales
    q = np.round(blocks / np.maximum(block_scale, 1e-30)[..., None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 inputs
    # Half h, input r: low nibble in byte 64 h + r % 64 (high nibble from 64), top two bits in byte
    # 32 h + r % 32, at bits 2 (r // 32).
    low = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # [n, 2, 64]
    high = (q >> 4).reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    high = np.bitwise_or.reduce(high, axis=2).astype(np.uint8)  # [n, 2, 32]
    return np.concatenate(
        [low.reshape(-1, 128), high.reshape(-1, 64), scales.astype(np.int8).view(np.uint8), as_bytes(d)],
        axis=-1,
    )


def q3_k(supers: np.ndarray) -> np.ndarray:
    """Q3_K blocks of [n, 256] weights: each 16's largest magnitude at q = -4 of its scale, which is
    negative where that weight is positive (q runs from -4 to 3)."""
    blocks = supers.reshape(-1, 16, 16)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    step = -largest / 4  # [n, 16]
    d = fp16(np.abs(step).max(axis=-1) / 31)
    magnitude = np.clip(np.ceil(np.abs(step) / np.maximum(d.astype(np.float32), 1e-30)[:, None]), 0, 31)
    scales = np.sign(step) * magnitude
    block_scale = d.astype(np.float32)[:, None] * scales
    safe = np.where(block_scale == 0, 1.0, block_scale)[..., None]
    q = np.clip(np.round(blocks / safe), -4, 3).astype(np.int8) + 4
    u = q.astype(np.uint8).reshape(-1, 256)  # q + 4, 0..7
    # Input e: its low two bits in byte 32 (e // 128) + e % 32 of qs, at bits 2 (e % 128 // 32); its third
    # bit (set where q >= 0) in byte e % 32 of hmask, at bit e // 32.
    low = (u & 3).reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qs = np.bitwise_or.reduce(low, axis=2).astype(np.uint8).reshape(-1, 64)
    third = (u >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]
    hmask = np.bitwise_or.reduce(third, axis=1).astype(np.uint8)
    # Scale i + 32 (6 bits): its low nibble in byte i % 8 (the high nibble from i = 8 on), its top two bits
    # in byte 8 + i % 4, at bits 2 (i // 4).
    biased = (scales.astype(np.int16) + 32).astype(np.uint8)
    packed = np.zeros((biased.shape[0], 12), dtype=np.uint8)
    packed[:, :8] = (biased[:, :8] & 0x0F) | ((biased[:, 8:] & 0x0F) << 4)
    top = (biased >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    packed[:, 8:] = np.bitwise_or.reduce(top, axis=1)
    return np.concatenate([hmask, qs, packed, as_bytes(d)], axis=-1)


def q2_k(supers: np.ndarray) -> np.ndarray:
    """Q2_K blocks of [n, 256] weights: each 16's range over the 3 steps above its min (at most 0), s
    and m 4-bit."""
    d, dmin, scales, mins, q = scales_and_mins(supers.reshape(-1, 16, 16), 3, 15)
    u = q.reshape(-1, 2, 4, 32)
    # Input e: byte 32 (e // 128) + e % 32 of qs, at bits 2 (e % 128 // 32)
    qs = np.bitwise_or.reduce(u << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    packed = scales | (mins << 4)
    return np.concatenate([packed, qs.astype(np.uint8).reshape(-1, 64), as_bytes(d), as_bytes(dmin)], axis=-1)


def nearest_indices(scaled: np.ndarray) -> np.ndarray:
    """Each value's nearest of IQ4_NL's 16 table values, as indices."""
    table = np.array(quants.IQ4_NL.kvalues, dtype=np.float32)
    return np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8)


def index_bytes(q: np.ndarray) -> np.ndarray:
    """[..., 32] indices to [..., 16] bytes: input j's in the low nibble of byte j, j + 16's in its high."""
    return q[..., :16] | (q[..., 16:] << 4)


def iq4_nl(supers: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of [n, 256] weights: each 32's largest magnitude at 127 of the table."""
    blocks = supers.reshape(-1, 32)
    d = fp16(np.abs(blocks).max(axis=-1) / 127)
    q = nearest_indices(blocks / np.maximum(d.astype(np.float32), 1e-30)[:, None])
    return np.concatenate([as_bytes(d), index_bytes(q)], axis=-1)


def iq4_xs(supers: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks of [n, 256] weights: each 32's scale d * s, s in -32..31, its largest magnitude near
    127 of the table."""
    blocks = supers.reshape(-1, 8, 32)
    wanted = np.abs(blocks).max(axis=-1) / 127  # [n, 8]
    d = fp16(wanted.max(axis=-1) / 31)
    s = np.clip(np.round(wanted / np.maximum(d.astype(np.float32), 1e-30)[:, None]), -32, 31).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * s
    q = nearest_indices(blocks / np.where(scale == 0, 1, scale)[..., None])  # [n, 8, 32]
    stored = (s.astype(np.int16) + 32).astype(np.uint8)  # 0..63
    high = np.bitwise_or.reduce(
        (stored >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16)), axis=1
    )
    low = (stored[:, 0::2] & 0x0F) | ((stored[:, 1::2] & 0x0F) << 4)  # [n, 4]
    return np.concatenate(
        [as_bytes(d), high.astype("<u2").reshape(-1, 1).view(np.uint8), low, index_bytes(q).reshape(-1, 128)],
        axis=-1,
    )

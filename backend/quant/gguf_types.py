"""A GGUF tensor's quantized blocks as the weights the engine's layers take.

The engine's layers (quantized_linear.py) take weights with a scale for
every block of 32 inputs of an output channel:

    4-bit: w = (q - 8) * scale + zero, q in 0..15   (Int4Linear)
    8-bit: w = q * scale, q in -127..127            (Int8Linear)

and, where the CPU multiplies blocks (BlocksLinear, block_weights.py), 5-bit
and 6-bit blocks, and K-quants' super-blocks of 256 inputs with the scales
as the file keeps them. How each GGUF type becomes one of them:

    Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of 4-bit q; w = d * q + m
    Q4_0 block (18 bytes): fp16 d,          16 bytes of 4-bit q; w = d * (q - 8)
        byte j of the 16 holds element j in its low nibble and element j + 16 in its high one.
        4-bit, exactly: scale = d, zero = m + 8d (Q4_1) or 0 (Q4_0). Q4_0 where the CPU multiplies
        blocks: its symmetric blocks, d alone as the file keeps it.
    Q8_0 block (34 bytes): fp16 d, 32 int8 q; w = d * q
        8-bit, exactly.
    Q4_K super-block of 256 (144 bytes): fp16 d and dmin, then for each of its eight blocks of 32 a
        6-bit scale s and a 6-bit min m (12 bytes), then 4-bit q; w = d * s * q - dmin * m
        The CPU's 4-bit super-blocks, exactly (block_weights.py: d, -dmin, s and m as they are); elsewhere
        4-bit, exactly: scale = d * s, zero = 8 * scale - dmin * m (products exact in float32).

    Q5_0 block (22 bytes): fp16 d, 32 fifth bits (bit j: element j's), 16 bytes of low nibbles as Q4_0's;
        w = d * (q - 16). Q5_1 (24 bytes): fp16 d, fp16 m, then the same; w = d * q + m.
        5-bit, exactly: Q5_0 as symmetric blocks (d alone), Q5_1 with m.
    Q5_K super-block of 256 (176 bytes): Q4_K's d, dmin, scales and mins, 32 bytes of fifth bits (bit i
        of byte l: input 32 i + l's), 128 bytes of low nibbles as Q4_K's; w = d * s * q - dmin * m.
        The CPU's 5-bit super-blocks, exactly, as Q4_K.
    Q6_K super-block of 256 (210 bytes): 128 bytes of low nibbles, 64 of top two bits, sixteen int8
        scales s (one a 16 inputs), fp16 d; w = d * s * (q - 32), q in 0..63
        The CPU's 6-bit super-blocks, exactly (d and s as they are).
    Q3_K super-block of 256 (110 bytes): 32 bytes of third bits, 64 of low two bits, sixteen 6-bit
        scales s + 32 (one a 16 inputs) in 12 bytes, fp16 d; w = d * s * q, q in -4..3
        The CPU's symmetric 4-bit super-blocks, exactly, as Q6_K's with q + 8 for 4-bit values (4.56
        bits a weight where the file keeps 3.44; requantized to 8-bit blocks it took 8.5 and moved).
    IQ4_NL block (18 bytes): fp16 d, 16 bytes of 4-bit indices into a table t of 16 int8 values (byte j:
        input j's low, j + 16's high); w = d * t[q]. IQ4_XS super-block of 256 (136 bytes): fp16 d, each
        block's 6-bit s + 32, then each block's indices as IQ4_NL's; w = d * s * t[q].
        The CPU's table blocks and super-blocks, exactly.
    MXFP4 block (17 bytes): an 8-bit exponent e, 16 bytes of 4-bit indices as IQ4_NL's into E2M1's
        values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives); w = 2^(e - 128) * t[q].
        The CPU's table blocks of MXFP4's table, exactly: d = 2^(e - 128) in fp16, which holds every
        power of two from 2^-24 to 2^15 (e 104 to 143; real weights' are 2^-10 or so). A tensor with a
        block of nonzero values outside that is requantized to 8-bit blocks, as below.
    Q2_K super-block of 256 (84 bytes): sixteen bytes of a 4-bit s (low nibble) and a 4-bit m (high one),
        one a 16 inputs, 64 bytes of 2-bit q, fp16 d and dmin; w = d * s * q - dmin * m, q in 0..3
        The CPU's 2-bit super-blocks, exactly (d, -dmin, s and m as they are: 3.1 bits a weight where
        requantized to 8-bit blocks it took 8.5 and moved).

Every other type that the gguf package dequantizes (the IQ2 and IQ3
types, ...) is quantized again from its dequantized weights to 8-bit blocks
of 32 with the block's largest magnitude at 127. That adds at most half a
step of 1/127 of a block's largest weight, and keeps 8.5 bits a weight where
bfloat16 would keep 16. PyTorch's kernels (CUDA, a CPU without AVX2) take a
single scale a channel for 8-bit weights and have no 5-bit or 6-bit ones:
there these layers and the 5-bit and 6-bit types' are quantized again per
channel (gguf_weights.served_layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from backend.quant import block_weights
from backend.quant.block_weights import Table

BLOCK = 32  # the inputs an engine block's scale covers
FOUR_BIT = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}  # bytes per block of 32
Q8_0_BYTES = 34  # fp16 d, 32 int8 values
Q4_K_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit q
Q5_BYTES = {GGMLQuantizationType.Q5_0: 22, GGMLQuantizationType.Q5_1: 24}  # bytes per block of 32
Q5_K_BYTES = 176  # Q4_K's 16 bytes of d, dmin, scales and mins, 32 of fifth bits, 128 of low nibbles
Q6_K_BYTES = 210  # 128 bytes of low nibbles, 64 of top two bits, 16 int8 scales, fp16 d
Q3_K_BYTES = 110  # 32 bytes of third bits, 64 of low two bits, 12 of 6-bit scales, fp16 d
Q2_K_BYTES = 84  # 16 bytes of 4-bit scales and mins, 64 of 2-bit q, fp16 d, fp16 dmin
IQ4_NL_BYTES = 18  # fp16 d, 16 bytes of 4-bit indices
IQ4_XS_BYTES = 136  # fp16 d, 2 + 4 bytes of 6-bit scales, 128 bytes of 4-bit indices
MXFP4_BYTES = 17  # an 8-bit exponent, 16 bytes of 4-bit indices
# d = 2^(e - 128) from MXFP4's exponent e, exactly in fp16 for these e (2^-24 to 2^15)
MXFP4_EXPONENTS_IN_FP16 = range(104, 144)
SUPER_BLOCK = 256  # the inputs of a K-quant's super-block
K_SCALES = 12
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


@dataclass(frozen=True)
class FourBitWeight:
    """One linear layer's weight as Int4Linear takes it: w = (q - 8) * scale + zero."""

    q: torch.Tensor  # [out, in] uint8, 0..15
    scale: torch.Tensor  # [out, in / 32] float32
    zero: torch.Tensor  # [out, in / 32] float32

    def symmetric(self) -> FourBitSymmetric | None:
        """The same weights as Q4_0's, d alone, where every zero is 0 (w = (q - 8) * scale: symmetric GPTQ
        and compressed-tensors checkpoints); else None."""
        if bool((self.zero != 0).any()):
            return None
        return FourBitSymmetric(self.q, self.scale)


@dataclass(frozen=True)
class EightBitWeight:
    """w = q * scale, a scale a block of 32 inputs of an output channel (Q8_0's blocks, or requantized)."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in / 32] float32


@dataclass(frozen=True)
class FiveBitWeight:
    """w = scale * q + minimum, a scale and minimum a block of 32 inputs of an output channel (Q5_0, Q5_1,
    Q5_K)."""

    q: torch.Tensor  # [out, in] uint8, 0..31
    scale: torch.Tensor  # [out, in / 32] float32
    minimum: torch.Tensor  # [out, in / 32] float32


@dataclass(frozen=True)
class SymmetricWeight:
    """w = d * (q - 2^(bits - 1)), d a block of 32 inputs of an output channel: Q4_0's and Q5_0's blocks,
    which keep d alone."""

    q: torch.Tensor  # [out, in] uint8, 0..2^bits - 1
    d: torch.Tensor  # [out, in / 32] float32, fp16 values
    bits: ClassVar[int]
    table: ClassVar[Table] = Table.NONE

    def blocks(self) -> torch.Tensor:
        """The CPU's symmetric blocks of these weights, exactly."""
        return block_weights.pack_symmetric(self.q, self.bits, self.d)

    def per_block(self) -> FourBitWeight | FiveBitWeight:
        """The same weights with a zero or minimum beside each scale, for the layers of devices that take
        no symmetric blocks."""
        if self.bits == 4:
            return FourBitWeight(self.q, self.d, torch.zeros_like(self.d))
        return FiveBitWeight(self.q, self.d, -16 * self.d)


class FourBitSymmetric(SymmetricWeight):  # Q4_0
    bits = 4


class FiveBitSymmetric(SymmetricWeight):  # Q5_0
    bits = 5


@dataclass(frozen=True)
class SuperBlockWeight:
    """w = d * s * q + minimum * m: Q4_K's and Q5_K's super-blocks, d and minimum (the file's -dmin) a
    super-block of 256 inputs of an output channel, s and m (0..63) a block of 32 in it."""

    q: torch.Tensor  # [out, in] uint8, 0..2^bits - 1
    d: torch.Tensor  # [out, in / 256] float32, fp16 values
    minimum: torch.Tensor  # [out, in / 256] float32, fp16 values
    s: torch.Tensor  # [out, in / 32] uint8
    m: torch.Tensor  # [out, in / 32] uint8
    bits: ClassVar[int]
    table: ClassVar[Table] = Table.NONE

    def blocks(self) -> torch.Tensor:
        """The CPU's super-blocks of these weights, exactly."""
        return block_weights.pack_super_blocks(self.q, self.bits, self.d, self.s, self.minimum, self.m)

    def scale(self) -> torch.Tensor:
        """d * s, [out, in / 32]: exact in float32 (an 11-bit d times a 6-bit s)."""
        return each_block(self.d) * self.s.float()

    def block_minimum(self) -> torch.Tensor:
        return each_block(self.minimum) * self.m.float()

    def per_block(self) -> FourBitWeight | FiveBitWeight:
        """The same weights with a scale and minimum a block of 32, for the layers of devices that take no
        super-blocks."""
        scale, minimum = self.scale(), self.block_minimum()
        if self.bits == 4:
            return FourBitWeight(self.q, scale, 8 * scale + minimum)
        return FiveBitWeight(self.q, scale, minimum)


class FourBitSuperBlocks(SuperBlockWeight):  # Q4_K
    bits = 4


class FiveBitSuperBlocks(SuperBlockWeight):  # Q5_K
    bits = 5


@dataclass(frozen=True)
class SubScaledWeight:
    """w = d * sub_scale * (q - 2^(bits - 1)), d a super-block of 256 inputs of an output channel and an int8
    sub_scale a 16 inputs: Q6_K's 6-bit values, and Q3_K's as 4-bit ones (the file's q + 8). The CPU's
    6-bit super-blocks, or symmetric 4-bit ones, exactly."""

    q: torch.Tensor  # [out, in] uint8, 0..2^bits - 1
    sub_scale: torch.Tensor  # [out, in / 16] int8
    d: torch.Tensor  # [out, in / 256] float32, fp16 values
    bits: ClassVar[int]  # the values' bits as the blocks keep them
    table: ClassVar[Table] = Table.NONE

    def blocks(self) -> torch.Tensor:
        return block_weights.pack_super_blocks(
            self.q, self.bits, self.d, self.sub_scale, symmetric=self.bits == 4
        )

    def scale(self) -> torch.Tensor:
        """d for each block of 32, [out, in / 32]."""
        return each_block(self.d)


class SixBitWeight(SubScaledWeight):  # Q6_K: q 0..63
    bits = 6


class ThreeBitWeight(SubScaledWeight):  # Q3_K: the file's q + 8, 4..11, and its s, -32..31
    bits = 4


@dataclass(frozen=True)
class TwoBitWeight:
    """w = d * s * q + minimum * m: Q2_K's super-blocks, d and minimum (the file's -dmin) a super-block of
    256 inputs of an output channel, s and m (0..15) a 16 inputs in it. The CPU's 2-bit super-blocks."""

    q: torch.Tensor  # [out, in] uint8, 0..3
    d: torch.Tensor  # [out, in / 256] float32, fp16 values
    minimum: torch.Tensor  # [out, in / 256] float32, fp16 values
    s: torch.Tensor  # [out, in / 16] uint8
    m: torch.Tensor  # [out, in / 16] uint8
    table: ClassVar[Table] = Table.NONE

    def blocks(self) -> torch.Tensor:
        return block_weights.pack_super_blocks(self.q, 2, self.d, self.s, self.minimum, self.m)


@dataclass(frozen=True)
class TableWeight:
    """w = d * TABLE_VALUES[table][q]: IQ4_NL's blocks, d a block of 32 inputs of an output channel."""

    q: torch.Tensor  # [out, in] uint8, 0..15
    d: torch.Tensor  # [out, in / 32] float32, fp16 values
    table: ClassVar[Table] = Table.IQ4

    def blocks(self) -> torch.Tensor:
        return block_weights.pack_table(self.q, self.d)


class MXFP4Weight(TableWeight):
    """w = d * TABLE_VALUES[Table.MXFP4][q]: MXFP4's blocks (E2M1 values doubled), d half a block's power
    of two."""

    table: ClassVar[Table] = Table.MXFP4


@dataclass(frozen=True)
class TableSuperBlocks:
    """w = d * s * TABLE_VALUES[Table.IQ4][q]: IQ4_XS's super-blocks, d a super-block of 256 inputs of an
    output channel, s (-32..31) a block of 32 in it."""

    q: torch.Tensor  # [out, in] uint8, 0..15
    d: torch.Tensor  # [out, in / 256] float32, fp16 values
    s: torch.Tensor  # [out, in / 32] int8
    table: ClassVar[Table] = Table.IQ4

    def blocks(self) -> torch.Tensor:
        return block_weights.pack_super_blocks(self.q, 4, self.d, self.s, table=True)


def each_block(per_super_block: torch.Tensor) -> torch.Tensor:
    """[out, in / 256] values of each super-block to [out, in / 32], each repeated for its blocks of 32."""
    return per_super_block.repeat_interleave(SUPER_BLOCK // BLOCK, dim=1)


def served(kind: GGMLQuantizationType, in_features: int) -> bool:
    """Whether a tensor of this type, rows of `in_features`, becomes engine blocks (floats do not)."""
    # Every other type: transformers loaded the file, so the gguf package dequantizes it.
    return kind not in FLOAT_TYPES and in_features % BLOCK == 0


def unpack(rows: np.ndarray, kind: GGMLQuantizationType) -> Weight:
    """[out, bytes] uint8 rows of `kind`'s blocks as the engine's weights: exactly the file's where the
    type has an unpacking of its own (UNPACKINGS), else requantized to 8-bit blocks."""
    if kind in UNPACKINGS:
        return UNPACKINGS[kind](rows)
    if kind == GGMLQuantizationType.MXFP4 and (exact := unpack_mxfp4(rows)) is not None:
        return exact
    return requantize_int8(quants.dequantize(np.ascontiguousarray(rows), kind))


def unpack_q4_0(rows: np.ndarray) -> FourBitSymmetric:
    four_bit = unpack_blocks(rows, GGMLQuantizationType.Q4_0)
    return FourBitSymmetric(four_bit.q, four_bit.scale)


def unpack_q5_0(rows: np.ndarray) -> FiveBitSymmetric:
    five_bit = unpack_q5(rows, GGMLQuantizationType.Q5_0)
    return FiveBitSymmetric(five_bit.q, five_bit.scale)


def unpack_blocks(rows: np.ndarray, kind: GGMLQuantizationType) -> FourBitWeight:
    """[out, blocks * bytes per block] uint8 rows of Q4_0 or Q4_1 blocks to q, scale and zero."""
    block_bytes = FOUR_BIT[kind]
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, block_bytes)
    d = halves(blocks[..., 0:2])
    zero = halves(blocks[..., 2:4]) + 8 * d if kind == GGMLQuantizationType.Q4_1 else np.zeros_like(d)
    packed = blocks[..., block_bytes - 16 :]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows.shape[0], -1)
    return FourBitWeight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def unpack_q8_0(rows: np.ndarray) -> EightBitWeight:
    """[out, blocks * 34] uint8 rows of Q8_0 blocks (fp16 d, then 32 int8 values) to q and scale."""
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, Q8_0_BYTES)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows.shape[0], -1)
    return EightBitWeight(torch.from_numpy(q), torch.from_numpy(halves(blocks[..., 0:2])))


def unpack_q4_k(rows: np.ndarray) -> FourBitSuperBlocks:
    """[out, super-blocks * 144] uint8 rows of Q4_K to q and its super-blocks' terms. Its q are in chunks
    of 64 inputs, 32 bytes each: the low nibbles the chunk's first 32, the high ones the next."""
    blocks = np.ascontiguousarray(rows).reshape(-1, Q4_K_BYTES)
    q = k_nibbles(blocks[:, 4 + K_SCALES :])
    return FourBitSuperBlocks(*k_terms(q, blocks, rows.shape[0]))


def unpack_q5(rows: np.ndarray, kind: GGMLQuantizationType) -> FiveBitWeight:
    """[out, blocks * bytes] uint8 rows of Q5_0 or Q5_1 blocks to q, scale and minimum."""
    block_bytes = Q5_BYTES[kind]
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, block_bytes)
    d = halves(blocks[..., 0:2])
    minimum = halves(blocks[..., 2:4]) if kind == GGMLQuantizationType.Q5_1 else -16 * d
    packed = blocks[..., block_bytes - 16 :]
    low = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [out, blocks, 32]
    fifth_bits = blocks[..., block_bytes - 20 : block_bytes - 16].copy().view("<u4")  # [out, blocks, 1]
    fifth = ((fifth_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = (low | (fifth << 4)).reshape(rows.shape[0], -1)
    return FiveBitWeight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(minimum))


def unpack_q5_k(rows: np.ndarray) -> FiveBitSuperBlocks:
    """[out, super-blocks * 176] uint8 rows of Q5_K to q and its super-blocks' terms: Q4_K's low nibbles
    and scales, and bit 4 of input 32 i + l in bit i of fifth-bit byte l."""
    blocks = np.ascontiguousarray(rows).reshape(-1, Q5_K_BYTES)
    fifth_bytes = blocks[:, 4 + K_SCALES : 4 + K_SCALES + 32].reshape(-1, 1, 32)
    fifth = (fifth_bytes >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [super-blocks, 8, 32]
    q = k_nibbles(blocks[:, 4 + K_SCALES + 32 :]) | (fifth.reshape(-1, SUPER_BLOCK) << 4)
    return FiveBitSuperBlocks(*k_terms(q, blocks, rows.shape[0]))


def k_terms(q: np.ndarray, blocks: np.ndarray, out_features: int) -> list[torch.Tensor]:
    """Q4_K's and Q5_K's values q [super-blocks, 256] and [super-blocks, bytes] to SuperBlockWeight's
    terms: q, d, minimum (-dmin), s and m, each [out, ...]."""
    d, dmin = halves(blocks[:, 0:2]), halves(blocks[:, 2:4])
    s, m = quants.Q4_K.get_scale_min(blocks[:, 4 : 4 + K_SCALES])  # [super-blocks, 8] each, 0..63
    terms = (q, d, -dmin, s.astype(np.uint8), m.astype(np.uint8))
    return [torch.from_numpy(np.ascontiguousarray(t).reshape(out_features, -1)) for t in terms]


def k_nibbles(packed: np.ndarray) -> np.ndarray:
    """[super-blocks, 128] of Q4_K's or Q5_K's low nibbles to [super-blocks, 256] values: chunks of 64
    inputs, 32 bytes each, the low nibbles the chunk's first 32, the high ones the next."""
    chunks = packed.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, SUPER_BLOCK)


def unpack_q6_k(rows: np.ndarray) -> SixBitWeight:
    """[out, super-blocks * 210] uint8 rows of Q6_K to q, sub_scale and scale. Each half of a super-block
    (128 inputs) keeps input r's low nibble in byte r % 64 of its 64 (the high nibble from r = 64 on) and
    its top two bits in byte r % 32 of its 32, at bits 2 (r // 32)."""
    out_features = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, Q6_K_BYTES)
    low = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    top = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    q = (low & 0x0F).reshape(-1, 2, 128) | ((top & 0x03) << 4).reshape(-1, 2, 128)
    sub_scale = blocks[:, 192:208].copy().view(np.int8)
    d = halves(blocks[:, 208:210])
    return SixBitWeight(
        torch.from_numpy(q.reshape(out_features, -1)),
        torch.from_numpy(sub_scale.reshape(out_features, -1)),
        torch.from_numpy(d.reshape(out_features, -1)),
    )


def unpack_q3_k(rows: np.ndarray) -> ThreeBitWeight:
    """[out, super-blocks * 110] uint8 rows of Q3_K to q + 8 and its int8 scales: input e's
    low two bits in byte 32 (e // 128) + e % 32 of its 64, at bits 2 (e % 128 // 32), its third bit in
    byte e % 32 of its 32 at bit e // 32 (set: q = the low bits; clear: they less 4); scale i + 32's low
    nibble in byte i % 8 (the high one from i = 8 on), its top two bits in byte 8 + i % 4 at bits 2 (i //
    4)."""
    out_features = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, Q3_K_BYTES)
    third = blocks[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    low = blocks[:, 32:96].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    q = (low & 3).reshape(-1, 256) + 4 * (third & 1).reshape(-1, 256) + 4  # q + 8, 4..11
    packed = blocks[:, 96:108]
    low_nibbles = packed[:, :8, None] >> np.array([0, 4], dtype=np.uint8)  # [super-blocks, 8, 2]
    top = packed[:, None, 8:] >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)  # [super-blocks, 4, 4]
    biased = (low_nibbles.transpose(0, 2, 1).reshape(-1, 16) & 0x0F) | ((top.reshape(-1, 16) & 3) << 4)
    return ThreeBitWeight(
        torch.from_numpy(q.astype(np.uint8).reshape(out_features, -1)),
        torch.from_numpy((biased.astype(np.int16) - 32).astype(np.int8).reshape(out_features, -1)),
        torch.from_numpy(halves(blocks[:, 108:110]).reshape(out_features, -1)),
    )


def unpack_q2_k(rows: np.ndarray) -> TwoBitWeight:
    """[out, super-blocks * 84] uint8 rows of Q2_K to q and its super-blocks' terms: input e's q in byte
    32 (e // 128) + e % 32 of its 64, at bits 2 (e % 128 // 32); the 16 inputs i's s in the low nibble of
    scale byte i, its m in the high one."""
    out_features = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, Q2_K_BYTES)
    scales = blocks[:, :16]
    packed = blocks[:, 16:80].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    terms = (
        (packed & 3).reshape(-1, SUPER_BLOCK),
        halves(blocks[:, 80:82]),
        -halves(blocks[:, 82:84]),
        scales & 0x0F,
        scales >> 4,
    )
    return TwoBitWeight(*(torch.from_numpy(np.ascontiguousarray(t).reshape(out_features, -1)) for t in terms))


def unpack_iq4_nl(rows: np.ndarray) -> TableWeight:
    """[out, blocks * 18] uint8 rows of IQ4_NL (fp16 d, then 16 bytes: input j's index in the low nibble
    of byte j, input j + 16's in its high one) to q and d."""
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, IQ4_NL_BYTES)
    packed = blocks[..., 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows.shape[0], -1)
    return TableWeight(torch.from_numpy(q), torch.from_numpy(halves(blocks[..., 0:2])))


def unpack_iq4_xs(rows: np.ndarray) -> TableSuperBlocks:
    """[out, super-blocks * 136] uint8 rows of IQ4_XS to q, d and s: fp16 d, then block i's s + 32 in 6
    bits (its low four in nibble i % 2 of byte i // 2 of 4 bytes, its top two in bits 2i and 2i + 1 of a
    uint16 before them), then each block's 16 bytes of indices as IQ4_NL's."""
    out_features = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, IQ4_XS_BYTES)
    high = blocks[:, 2:4].copy().view("<u2")  # [super-blocks, 1]
    low = blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # [super-blocks, 4, 2]
    top = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [super-blocks, 8]
    s = ((low.reshape(-1, 8) & 0x0F) | (top.astype(np.uint8) << 4)).astype(np.int8) - 32
    packed = blocks[:, 8:].reshape(-1, 8, 16)
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [super-blocks, 8, 32]
    return TableSuperBlocks(
        torch.from_numpy(q.reshape(out_features, -1)),
        torch.from_numpy(halves(blocks[:, 0:2]).reshape(out_features, -1)),
        torch.from_numpy(s.reshape(out_features, -1)),
    )


def unpack_mxfp4(rows: np.ndarray) -> MXFP4Weight | None:
    """[out, blocks * 17] uint8 rows of MXFP4 (an exponent e, then 16 bytes of indices as IQ4_NL's) to q
    and d (`mxfp4_weight`)."""
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, MXFP4_BYTES)
    packed = blocks[..., 1:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows.shape[0], -1)
    return mxfp4_weight(torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(blocks[..., 0])))


def mxfp4_weight(q: torch.Tensor, exponents: torch.Tensor) -> MXFP4Weight | None:
    """MXFP4's indices q [out, in] (0..15) and each block's exponent e [out, in / 32] (uint8) as its
    weights, d = 2^(e - 128); None where a block of nonzero values has a d that fp16 does not hold (a
    block of zeros takes d = 0: its weights are 0 whatever d is)."""
    e = exponents.to(torch.int32)
    in_fp16 = (e >= MXFP4_EXPONENTS_IN_FP16.start) & (e < MXFP4_EXPONENTS_IN_FP16.stop)
    outside = ~in_fp16
    # Only the blocks outside are looked at: looking at every block's values took 2.4 s of a 4-layer
    # gpt-oss-20b file's 23 s start, nearly all its blocks inside.
    if bool(outside.any()):
        # indices 0 and 8: E2M1's +0 and -0
        zeros = ((q.reshape(*e.shape, BLOCK)[outside] & 0x07) == 0).all(dim=-1)
        if not bool(zeros.all()):
            return None
    powers = ((e - 1).clamp(min=1) << 23).view(torch.float32)  # 2^(e - 128), a float32's exponent bits
    return MXFP4Weight(q, torch.where(in_fp16, powers, 0.0))


# Each type whose blocks become the engine's weights exactly, and how.
UNPACKINGS = {
    GGMLQuantizationType.Q4_0: unpack_q4_0,
    GGMLQuantizationType.Q4_1: lambda rows: unpack_blocks(rows, GGMLQuantizationType.Q4_1),
    GGMLQuantizationType.Q5_0: unpack_q5_0,
    GGMLQuantizationType.Q5_1: lambda rows: unpack_q5(rows, GGMLQuantizationType.Q5_1),
    GGMLQuantizationType.Q8_0: unpack_q8_0,
    GGMLQuantizationType.Q2_K: unpack_q2_k,
    GGMLQuantizationType.Q3_K: unpack_q3_k,
    GGMLQuantizationType.Q4_K: unpack_q4_k,
    GGMLQuantizationType.Q5_K: unpack_q5_k,
    GGMLQuantizationType.Q6_K: unpack_q6_k,
    GGMLQuantizationType.IQ4_NL: unpack_iq4_nl,
    GGMLQuantizationType.IQ4_XS: unpack_iq4_xs,
}


def requantize_int8(weights: np.ndarray) -> EightBitWeight:
    """[out, in] float weights to 8-bit blocks of 32, each block's largest magnitude at 127."""
    blocks = torch.from_numpy(np.asarray(weights, dtype=np.float32)).reshape(weights.shape[0], -1, BLOCK)
    scale = fp16_at_least(blocks.abs().amax(dim=-1) / 127)
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[..., None])
    return EightBitWeight(q.to(torch.int8).reshape(weights.shape), scale)


def fp16_at_least(wanted: torch.Tensor) -> torch.Tensor:
    """Each scale `wanted` in fp16, as the CPU's blocks keep it, rounded up where it rounded down (a small
    block's subnormal scale can, by several percent; any other, by up to half its step), as float32: no
    weight then falls outside -127..127 of it."""
    scale = wanted.to(torch.float16)
    up = torch.nextafter(scale, torch.full_like(scale, float("inf")))
    return torch.where(scale.float() < wanted, up, scale).float()


# The weights the CPU's blocks take as they are (block_weights.py), and all of them (MXFP4Weight a
# TableWeight).
InBlocksWeight = (
    SymmetricWeight | SuperBlockWeight | SubScaledWeight | TwoBitWeight | TableWeight | TableSuperBlocks
)
Weight = FourBitWeight | FiveBitWeight | EightBitWeight | InBlocksWeight


def halves(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] bytes holding fp16 values to those values in float32, [...]."""
    return pairs.copy().view(np.float16)[..., 0].astype(np.float32)

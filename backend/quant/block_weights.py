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
    one fp16 d (and 4-bit, one fp16 m) per block of 32 inputs of a channel;
    5-bit: w = d * u + m as 4-bit, u in 0..31;
    symmetric 4-bit and 5-bit: d alone, m = -8 d or -16 d;
    6-bit: w = d * s * (u - 32), u in 0..63, an int8 s for each 16 inputs;
    2-bit (super-blocks alone): w = d * s * u + minimum * m, u in 0..3, a uint8 s and m for each 16 inputs.

GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q6_K and Q8_0 blocks map onto these exactly,
Q4_0 and Q5_0 as symmetric blocks: 18 and 22 bytes a channel's 32 inputs,
the file's own, where an m beside d took 20 and 24, and one row's product
reads every byte (the 1B Q4_0 file's projections: 522 MiB, where they took
580). The activations'
rounding costs a few times bfloat16's (tests/backend/test_block_weights.py)
and the default model +0.3% perplexity (docs/performance.md).

Layout, for each group of 16 output channels and each block of 32 inputs
(the blocks of a group follow each other, the groups too): the 16 channels'
values side by side, four consecutive inputs of one channel a 32-bit lane,
so that a 64-byte line feeds one vpdpbusd; 4-bit values pack two lines
into one (line 2c in the low nibbles, 2c + 1 in the high); then the 16
channels' d, and (4-bit and 5-bit, but symmetric ones) their m, as fp16. 5-bit and 6-bit
values keep their low nibbles so, then one line of fifth bits (bit j of a
byte: line j's) or two lines of top two bits (bits 2i and 2i + 1 of line h:
those of line 4h + i); a 6-bit block then has d and the 16 channels' s for
inputs 0-15 and for 16-31. A layer's blocks are a uint8 tensor [out, in /
32 * bytes], 20 bytes a channel's block in 4 bits, 24 in 5, 28 in 6 and 34
in 8 (Q4_1's and Q8_0's own sizes; Q5_1's), so that its first dimension is
the layer's outputs: it slices and concatenates by whole groups of 16 like
any weight (quantized_linear.fuse_linears).

GGUF's K-quants keep their scales by super-blocks of 256 inputs: one fp16 d
(and minimum) a channel's super-block, and for each block of 32 in it 6-bit
multiples s and m of those (Q4_K, Q5_K: w = d * s * u + minimum * m), or
two int8 s (Q6_K: w = d * s * (u - 32)). Their layers keep them so, in
super-blocks: for each group of 16 channels and each 256 inputs, the 16
channels' d (and minimum) in fp16, then the 8 blocks, each its values as
above and 32 bytes: the channels' s, then their m (one byte each; Q6_K: s
for inputs 0-15, then for 16-31). Symmetric 4-bit super-blocks are as
6-bit ones, w = d * s * (u - 8) with u 4-bit (GGUF's Q3_K, q + 8). 148, 180
and 210 bytes a channel's 256 inputs, and 146 symmetric 4-bit (Q4_K's own
144 keeps s and m in 6 bits) where blocks of 32 with
fp16 scales of their own took 160, 192 and 224: fewer bytes for one row's
product to read, and exactly the file's weights (fp16 d * s rounded them).

GGUF's Q2_K (the low K-quant of Q2_K files and of big models squeezed into
little memory) keeps a 4-bit s and a 4-bit m for each 16 inputs, w = d * s *
q + minimum * m with q in 0..3 (minimum the file's -dmin). Its layers are
2-bit super-blocks: Q4_K's header (d and minimum), then for each block of 32
its values as two lines of 2-bit values (bits 2i and 2i + 1 of line h: those
of line 4h + i, as 6-bit blocks keep their top two bits) and 64 bytes: the
16 channels' s for inputs 0-15, then for 16-31, then their m so. 100 bytes a
channel's 256 inputs (3.1 bits a weight; the file's 84), where requantized to
8-bit blocks they took 272 and moved.

GGUF's IQ4_NL and IQ4_XS weights are d * t[u]: u in 0..15 picks one of 16
int8 values t (TABLE_VALUES[Table.IQ4]), denser near 0 than a 4-bit grid.
Their blocks (`table`) keep u as 4-bit blocks do and d alone: IQ4_NL's
blocks of 32 an fp16 d (18 bytes a channel's 32, as in the file), IQ4_XS's
super-blocks of 256 the fp16 d first and for each block of 32 an int8 s
(w = d * s * t[u]; 138 bytes a channel's 256 where the file takes 136).
MXFP4's weights (gpt-oss's experts, GGUF's MXFP4) are OCP's 4-bit floats
(E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times a power of two
a block of 32: t[u] * d with t those values doubled (TABLE_VALUES[Table.MXFP4])
and d half the power of two, kept as IQ4_NL's blocks are (an fp16 d where the
file keeps an 8-bit exponent: 18 bytes a channel's 32 where it takes 17).
The kernels look the values up and multiply them as 8-bit ones.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from backend.kernels import extension as kernels

BLOCK = 32  # inputs a scale covers
CHANNELS = 16  # output channels stored side by side, one a vector lane
SUPER_BLOCK = 256  # inputs of a K-quant's super-block
BLOCKS_A_SUPER_BLOCK = SUPER_BLOCK // BLOCK
VALUE_BYTES = {2: 128, 4: 256, 5: 320, 6: 384, 8: 512}  # a block's values, 16 channels


class Table(enum.IntEnum):
    """Whose values a table's blocks index (block_matmul.cpp's numbers), or NONE: blocks of values."""

    NONE = 0
    IQ4 = 1  # GGUF's IQ4_NL and IQ4_XS
    MXFP4 = 2  # OCP's E2M1 values doubled: GGUF's MXFP4, gpt-oss's checkpoints


# Each table's values, by index
TABLE_VALUES = {
    Table.IQ4: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
    Table.MXFP4: (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
}


class Layout(NamedTuple):
    """How a layer's blocks are kept: values of `bits`, in blocks of 32 or super-blocks of 256, their own or
    a table's indices (`table`: whose); `symmetric` blocks of 32 (4-bit and 5-bit) keep d alone, w = d *
    (u - 2^(bits - 1)), and symmetric super-blocks (4-bit) a d and an int8 s a 16 inputs, w = d * s * (u -
    8), as 6-bit ones; 2-bit values come in super-blocks alone, an s and an m a 16 inputs."""

    bits: int
    super_blocks: bool = False
    table: Table = Table.NONE
    symmetric: bool = False

    def name(self) -> str:
        kind = "super-blocks" if self.super_blocks else "blocks"
        values = TABLE_NAMES[self.table] if self.table else "symmetric " if self.symmetric else ""
        return f"{self.bits}-bit {values}{kind}"

    def inputs_a_unit(self) -> int:
        return SUPER_BLOCK if self.super_blocks else BLOCK


# A channel's bytes in each layout, a block of 32 inputs or a super-block of 256: its values and scales.
CHANNEL_BYTES = {
    Layout(4): 20,
    Layout(5): 24,
    Layout(6): 28,
    Layout(8): 34,
    Layout(4, super_blocks=True): 148,
    Layout(5, super_blocks=True): 180,
    Layout(6, super_blocks=True): 210,
    Layout(2, super_blocks=True): 100,
    Layout(4, table=Table.IQ4): 18,
    Layout(4, super_blocks=True, table=Table.IQ4): 138,
    Layout(4, table=Table.MXFP4): 18,
    Layout(4, symmetric=True): 18,  # as a table's: told apart by `table`
    Layout(5, symmetric=True): 22,
    Layout(4, super_blocks=True, symmetric=True): 146,
}
SIX_BIT_OFFSET = 32  # 6-bit weights are d * s * (u - 32)
TABLE_NAMES = {Table.IQ4: "table ", Table.MXFP4: "MXFP4 table "}  # as Layout.name says them


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


# Output channels packed at a time (a multiple of CHANNELS): the packing's temporaries, several times the
# values' bytes, are then those of this many channels. Packed whole, the 6-bit output head of a 1B file
# (49,152 x 2,048 weights, 78 MiB of super-blocks) took 462 MiB more while it was packed, 325 ms.
PACK_CHANNELS = 1024


def by_channels(pack: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`pack`, whose tensor arguments are each [out, ...], taken PACK_CHANNELS output channels at a time
    into one [out, bytes] (a layer's blocks are rows of its channels, so the parts join exactly)."""

    @functools.wraps(pack)
    def packed(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if q.shape[0] <= PACK_CHANNELS:
            return pack(q, *args, **kwargs)

        def part(first: int) -> torch.Tensor:
            def cut(value):
                return value[first : first + PACK_CHANNELS] if isinstance(value, torch.Tensor) else value

            return pack(cut(q), *map(cut, args), **{name: cut(value) for name, value in kwargs.items()})

        first_part = part(0)
        out = torch.empty(q.shape[0], first_part.shape[1], dtype=first_part.dtype, device=first_part.device)
        out[:PACK_CHANNELS] = first_part
        for first in range(PACK_CHANNELS, q.shape[0], PACK_CHANNELS):
            out[first : first + PACK_CHANNELS] = part(first)
        return out

    return packed


@by_channels
def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q [out, in] values 0..15, scale and zero [out, in / 32], w = (q - 8) * scale + zero (Int4Linear's
    terms), as 4-bit blocks: d = scale, m = zero - 8 * scale."""
    return assemble(value_lines(q, 4), [scale, zero - 8 * scale], q.shape)


@by_channels
def pack_int5(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """q [out, in] values 0..31, scale and minimum [out, in / 32] (fp16 values), w = scale * q + minimum
    (GGUF's Q5_1, and Q5_K a block at a time), as 5-bit blocks: d = scale, m = minimum."""
    return assemble(value_lines(q, 5), [scale, minimum], q.shape)


@by_channels
def pack_symmetric(q: torch.Tensor, bits: int, d: torch.Tensor) -> torch.Tensor:
    """w = d * (q - 2^(bits - 1)) (Q4_0, Q5_0): q [out, in] 0..2^bits - 1 (bits 4 or 5), d [out, in / 32]
    (fp16 values), as symmetric blocks."""
    return assemble(value_lines(q, bits), [d], q.shape)


@by_channels
def pack_int6(q: torch.Tensor, sub_scale: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [out, in] values 0..63, sub_scale [out, in / 16] int8, scale [out, in / 32] (fp16 values), w =
    scale * sub_scale * (q - 32), as 6-bit blocks: d = scale, s = sub_scale."""
    return assemble(value_lines(q, 6), [scale], q.shape, after=channel_bytes(sub_scale.to(torch.int8), 2))


@by_channels
def pack_table(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """w = d * TABLE_VALUES[table][q] (IQ4_NL, MXFP4): q [out, in] 0..15, d [out, in / 32] (fp16 values),
    as a table's blocks (which table's, the layer keeps: their bytes are the same)."""
    return assemble(value_lines(q, 4), [d], q.shape)


@by_channels
def pack_super_blocks(
    q: torch.Tensor,
    bits: int,
    d: torch.Tensor,
    s: torch.Tensor,
    minimum: torch.Tensor | None = None,
    m: torch.Tensor | None = None,
    table: bool = False,
    symmetric: bool = False,
) -> torch.Tensor:
    """K-quants' terms as super-blocks: q [out, in] values 0..2^bits - 1, d (and minimum) [out, in / 256]
    (fp16 values), and 4-bit and 5-bit (Q4_K, Q5_K) w = d * s * q + minimum * m with s and m [out, in /
    32] 0..255; 6-bit (Q6_K) w = d * s * (q - 32) with s [out, in / 16] int8, and `symmetric` 4-bit (Q3_K)
    w = d * s * (q - 8) so. `table` (IQ4_XS): w = d * s * TABLE_VALUES[Table.IQ4][q], s [out, in / 32] int8.
    2-bit
    (Q2_K): w = d * s * q + minimum * m, s and m [out, in / 16] 0..255."""
    out_features, in_features = q.shape
    groups, supers = out_features // CHANNELS, in_features // SUPER_BLOCK
    if bits == 2:  # an s and an m a 16 inputs
        block_tail = torch.cat([channel_bytes(s.to(torch.uint8), 2), channel_bytes(m.to(torch.uint8), 2)], -1)
        header = [d, minimum]
    elif bits == 6 or symmetric or table:
        block_tail = channel_bytes(s.to(torch.int8), 1 if table else 2)  # an s a 32, or a 16
        header = [d]
    else:
        block_tail = torch.cat([channel_bytes(s.to(torch.uint8), 1), channel_bytes(m.to(torch.uint8), 1)], -1)
        header = [d, minimum]
    blocks = torch.cat([value_lines(q, bits), block_tail], dim=-1)  # [groups, blocks, bytes]
    halves = [channel_bytes(h.to(torch.float16), 1) for h in header]  # [groups, supers, 32] each
    joined = torch.cat([*halves, blocks.reshape(groups, supers, -1)], dim=-1)
    return joined.reshape(out_features, -1).contiguous()


def value_lines(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [out, in] values 0..2^bits - 1 as each block's value bytes, [groups, blocks, bytes]: 8-bit the 8
    lines; 2-bit two lines, bits 2i and 2i + 1 of line h those of line 4h + i; else the low nibbles of lines
    2c and 2c + 1 in one, then (5-bit) a line of fifth bits or (6-bit) two of top two bits (as 2-bit ones)."""
    lanes = interleave(q.to(torch.uint8))  # [groups, blocks, 8 lines, 64]
    if bits == 8:
        return lanes.flatten(2)
    if bits == 2:
        return two_bit_lines(lanes)
    low = lanes & 0x0F
    nibbles = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).flatten(2)  # [groups, blocks, 256]
    if bits == 5:
        shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
        fifth = ((lanes >> 4) << shifts).sum(dim=2, dtype=torch.uint8)  # [groups, blocks, 64], no overlap
        return torch.cat([nibbles, fifth], dim=-1)
    if bits == 6:
        return torch.cat([nibbles, two_bit_lines(lanes >> 4)], dim=-1)
    return nibbles


def two_bit_lines(lanes: torch.Tensor) -> torch.Tensor:
    """[groups, blocks, 8 lines, 64] values 0..3 as two lines, [groups, blocks, 128]: bits 2i and 2i + 1 of
    line h hold line 4h + i."""
    pairs = lanes.reshape(*lanes.shape[:2], 2, 4, 64)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    return (pairs << shifts).sum(dim=3, dtype=torch.uint8).flatten(2)  # no bits overlap


def channel_bytes(values: torch.Tensor, per_block: int) -> torch.Tensor:
    """[out, n * per_block] values of one dtype to [groups, n, bytes]: for each of the n, its per_block
    values of the group's 16 channels, value by value, the channels side by side."""
    out_features = values.shape[0]
    groups, count = out_features // CHANNELS, values.shape[1] // per_block
    by_channel = values.reshape(groups, CHANNELS, count, per_block).permute(0, 2, 3, 1).contiguous()
    return by_channel.view(torch.uint8).reshape(groups, count, -1)


@by_channels
def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [out, in] int8, scale [out, in / 32] (a block's) or [out] (a channel's), w = q * scale, as 8-bit
    blocks: u = q + 128, d = scale."""
    out_features, in_features = q.shape
    scale = scale if scale.dim() == 2 else scale[:, None].expand(out_features, in_features // BLOCK)
    unsigned = q.to(torch.int8).view(torch.uint8) ^ 0x80  # + 128, in a byte (q + 128 in int16 took two)
    return assemble(interleave(unsigned), [scale], q.shape)


def interleave(values: torch.Tensor) -> torch.Tensor:
    """[out, in] bytes to [groups, blocks, 8, 64]: line j of a block, inputs 4j..4j+3 of its 16 channels.
    Each lane's 4 bytes move as one int32: moved a byte at a time, 1,024 channels of 2,048 inputs took 0.34
    ms against 0.15, and a 1B file's 8192 x 2048 Q4_K projection was packed in 26.9 ms against 19.7."""
    out_features, in_features = values.shape
    lanes = values.contiguous().view(torch.int32).reshape(out_features // CHANNELS, CHANNELS, -1, 8)
    interleaved = lanes.permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    return interleaved.reshape(out_features // CHANNELS, in_features // BLOCK, 8, 64)


def assemble(
    values: torch.Tensor, scales: list[torch.Tensor], shape: torch.Size, after: torch.Tensor | None = None
) -> torch.Tensor:
    """[out, bytes]: each block's values, then each of `scales` ([out, in / 32]) for its channels in fp16,
    then `after`'s bytes ([groups, blocks, n]) where given."""
    out_features, in_features = shape
    groups, blocks = out_features // CHANNELS, in_features // BLOCK
    halves = [channel_bytes(s.to(torch.float16), 1) for s in scales]
    tail = [] if after is None else [after]
    joined = torch.cat([values.reshape(groups, blocks, -1), *halves, *tail], dim=-1)
    return joined.reshape(out_features, -1).contiguous()


def layout_of(blocks: torch.Tensor, in_features: int, table: Table = Table.NONE) -> Layout:
    """The blocks' layout, by the bytes a channel takes and the table whose indices they hold (no two
    take the same for the same inputs and `table`)."""
    for layout, size in CHANNEL_BYTES.items():
        unit = layout.inputs_a_unit()
        if (
            layout.table == table
            and in_features % unit == 0
            and blocks.shape[1] == in_features // unit * size
        ):
            return layout
    raise ValueError(f"{blocks.shape[1]} bytes a channel are no blocks of {in_features} inputs")


def matmul(x: torch.Tensor, blocks: torch.Tensor, bits: int, table: int = Table.NONE) -> torch.Tensor:
    """x [rows, in] (float32 or bfloat16) @ the blocks' weights.T -> [rows, out] in x's dtype (`table`:
    whose values their indices pick, a Table). Compiled (torch.compile), as the custom operator
    `block_matmul_op` the compiler can place in its graph."""
    if torch.compiler.is_compiling():
        return block_matmul_op(x, blocks, bits, table)
    return kernels.extension().block_matmul(x, blocks, bits, table)


@torch.library.custom_op("inference::block_matmul", mutates_args=())
def block_matmul_op(x: torch.Tensor, blocks: torch.Tensor, bits: int, table: int) -> torch.Tensor:
    return kernels.extension().block_matmul(x.contiguous(), blocks, bits, table)


@block_matmul_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, bits: int, table: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def dense_copy(
    blocks: torch.Tensor, in_features: int, dtype: torch.dtype, table: Table = Table.NONE
) -> torch.Tensor:
    """The weights [out, in] the blocks hold, in `dtype` (float32 and bfloat16 rounded once from float32,
    another dtype from float32): `dequantize`'s values, written straight from the blocks by the extension's
    loop where it is built. A 1B Q4_K_M file's
    lean start makes its projections' copies two or three times: PyTorch's operations, 256 channels at a
    time, made 440 million weights a second on the 2-core Xeon and took 4 s of that start."""
    extension = kernels.extension()
    if extension is None or blocks.device.type != "cpu":
        return dequantize_in_torch(blocks, in_features, table).to(dtype)
    written = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32  # what the loop writes
    out = torch.empty(blocks.shape[0], in_features, dtype=written)
    extension.block_dequantize(blocks.contiguous(), layout_of(blocks, in_features, table).bits, table, out)
    return out.to(dtype)


def rows(blocks: torch.Tensor, ids: torch.Tensor, layout: Layout, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` ([n] int64) of the weights [out, in] the blocks of `layout` hold, [n, in] in `dtype`
    (float32 or bfloat16): `dense_copy`'s rows, written by the extension's loop (an embedding's:
    `BlocksEmbedding`, which knows its layout, so that a step does not look it up). Compiled, as the custom
    operator `block_rows_op`."""
    in_features = blocks.shape[1] // CHANNEL_BYTES[layout] * layout.inputs_a_unit()
    write = block_rows_op if torch.compiler.is_compiling() else written_rows
    return write(blocks, in_features, ids, dtype, layout.bits, layout.table)


def written_rows(
    blocks: torch.Tensor, in_features: int, ids: torch.Tensor, dtype: torch.dtype, bits: int, table: int
) -> torch.Tensor:
    out = torch.empty(ids.shape[0], in_features, dtype=dtype)
    kernels.extension().block_rows(blocks, bits, table, ids.contiguous(), out)
    return out


@torch.library.custom_op("inference::block_rows", mutates_args=())
def block_rows_op(
    blocks: torch.Tensor, in_features: int, ids: torch.Tensor, dtype: torch.dtype, bits: int, table: int
) -> torch.Tensor:
    return written_rows(blocks, in_features, ids, dtype, bits, table)


@block_rows_op.register_fake
def _(
    blocks: torch.Tensor, in_features: int, ids: torch.Tensor, dtype: torch.dtype, bits: int, table: int
) -> torch.Tensor:
    return blocks.new_empty(ids.shape[0], in_features, dtype=dtype)


def dequantize(blocks: torch.Tensor, in_features: int, table: Table = Table.NONE) -> torch.Tensor:
    """The float32 weights [out, in] the blocks hold: what `matmul` multiplies by (the dense copies of a
    lean load are made of it: `dense_copy`)."""
    return dense_copy(blocks, in_features, torch.float32, table)


def dequantize_in_torch(blocks: torch.Tensor, in_features: int, table: Table = Table.NONE) -> torch.Tensor:
    """`dequantize` by PyTorch's operations: where the extension is not built, and the reference its loop
    is tested against."""
    bits, super_blocks, table, symmetric = layout_of(blocks, in_features, table)
    out_features = blocks.shape[0]
    groups, count = out_features // CHANNELS, in_features // BLOCK
    signed_scales = bits == 6 or (super_blocks and symmetric)  # an int8 s a 16 inputs
    if super_blocks:
        header_bytes = 32 if signed_scales or table else 64  # d, or d and minimum
        per_super = blocks.reshape(groups, in_features // SUPER_BLOCK, -1)
        # [out, supers] d, or d and minimum in turn: [out, 2 supers]
        header = from_channel_bytes(per_super[..., :header_bytes], torch.float16, 1).float()
        per_block = per_super[..., header_bytes:].reshape(groups, count, -1)
    else:
        per_block = blocks.reshape(groups, count, -1)
    u = values_of(per_block, bits).reshape(out_features, in_features)
    tail = per_block[..., VALUE_BYTES[bits] :]
    if table:  # d, or the super-block's d times s
        if super_blocks:
            s = from_channel_bytes(tail, torch.int8, 1).float()
            d = header.repeat_interleave(BLOCKS_A_SUPER_BLOCK, dim=1) * s
        else:
            d = from_channel_bytes(tail, torch.float16, 1).float()
        values = torch.tensor(TABLE_VALUES[table], dtype=torch.float32)[u.long()]
        return (values.reshape(out_features, count, BLOCK) * d[..., None]).reshape(out_features, in_features)
    if bits == 2:  # d * s and minimum * m a 16 inputs
        d_and_minimum = header.reshape(out_features, -1, 2).repeat_interleave(2 * BLOCKS_A_SUPER_BLOCK, dim=1)
        s = from_channel_bytes(tail[..., : 2 * CHANNELS], torch.uint8, 2).float()
        m = from_channel_bytes(tail[..., 2 * CHANNELS :], torch.uint8, 2).float()
        d, minimum = d_and_minimum[..., 0] * s, d_and_minimum[..., 1] * m
        sixteens = u.float().reshape(out_features, -1, BLOCK // 2) * d[..., None] + minimum[..., None]
        return sixteens.reshape(out_features, in_features)
    if signed_scales:
        sub_scale = from_channel_bytes(tail[..., -2 * CHANNELS :], torch.int8, 2)  # [out, 2 count]
        if super_blocks:
            scale = header.repeat_interleave(BLOCKS_A_SUPER_BLOCK, dim=1)
        else:
            scale = from_channel_bytes(tail[..., : 2 * CHANNELS], torch.float16, 1)
        return dequantize_sub_scaled(u, sub_scale, scale, 2 ** (bits - 1))
    if super_blocks:  # d * s and minimum * m
        d_and_minimum = header.reshape(out_features, -1, 2).repeat_interleave(BLOCKS_A_SUPER_BLOCK, dim=1)
        s_and_m = from_channel_bytes(tail, torch.uint8, 1).reshape(out_features, count, 2).float()
        d, m = d_and_minimum[..., 0] * s_and_m[..., 0], d_and_minimum[..., 1] * s_and_m[..., 1]
    else:  # d and m, or d alone: m = -128 d (8-bit), -8 d or -16 d (symmetric)
        halves = from_channel_bytes(tail, torch.float16, 1).float().reshape(out_features, count, -1)
        d = halves[..., 0]
        m = halves[..., 1] if bits in (4, 5) and not symmetric else -(2 ** (bits - 1)) * d
    weights = u.float().reshape(out_features, count, BLOCK) * d[..., None] + m[..., None]
    return weights.reshape(out_features, in_features)


def values_of(per_block: torch.Tensor, bits: int) -> torch.Tensor:
    """Each block's values from its bytes [groups, blocks, bytes]: [groups * 16 channels, blocks * 32]."""
    groups, count = per_block.shape[:2]
    raw = per_block[..., : VALUE_BYTES[bits] if bits in (2, 8) else 256].reshape(groups, count, -1, 64)
    if bits == 2:
        lines = from_two_bit_lines(raw)
    else:
        lines = torch.stack([raw & 0x0F, raw >> 4], dim=3).flatten(2, 3) if bits != 8 else raw
    if bits == 5:
        fifth = per_block[..., 256:320].reshape(groups, count, 1, 64)
        lines = lines | (((fifth >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
    if bits == 6:
        lines = lines | (from_two_bit_lines(per_block[..., 256:384].reshape(groups, count, 2, 64)) << 4)
    return lines.reshape(groups, count, 8, CHANNELS, 4).permute(0, 3, 1, 2, 4).reshape(groups * CHANNELS, -1)


def from_two_bit_lines(lines: torch.Tensor) -> torch.Tensor:
    """two_bit_lines undone: [groups, blocks, 2, 64] to the 8 lines' values, [groups, blocks, 8, 64]."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    return ((lines[:, :, :, None] >> shifts) & 0x03).flatten(2, 3)


def from_channel_bytes(data: torch.Tensor, dtype: torch.dtype, per_block: int) -> torch.Tensor:
    """channel_bytes undone: [groups, n, bytes] to [out, n * per_block] values of `dtype` (where each n
    holds several fields of the same dtype, one after the other, they come out one after the other too)."""
    groups, count = data.shape[:2]
    values = data.contiguous().view(dtype).reshape(groups, count, -1, CHANNELS)
    return values.permute(0, 3, 1, 2).reshape(groups * CHANNELS, -1)


def dequantize_sub_scaled(
    q: torch.Tensor, sub_scale: torch.Tensor, scale: torch.Tensor, offset: int = SIX_BIT_OFFSET
) -> torch.Tensor:
    """The float32 weights [out, in] of pack_int6's terms: scale * sub_scale * (q - 32), exactly (an 11-bit
    d times a 7-bit s times a 6-bit value); symmetric 4-bit super-blocks' q - 8 (`offset` 8)."""
    halves = (q.float() - offset).reshape(q.shape[0], -1, BLOCK // 2)
    centred = halves * sub_scale.float()[..., None]
    return (centred.reshape(q.shape[0], -1, BLOCK) * scale.float()[..., None]).reshape(q.shape)

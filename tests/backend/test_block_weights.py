"""Weights in blocks of 32, and K-quants' super-blocks of 256, multiplied by the CPU's int8 dot products
(block_weights.py, block_matmul.cpp)."""

import pytest
import torch

from backend.kernels import extension as extension_module
from backend.kernels.extension import extension
from backend.quant import block_weights
from backend.quant.block_weights import (
    BLOCK,
    SUPER_BLOCK,
    TABLE_VALUES,
    Layout,
    Table,
    dequantize,
    layout_of,
    matmul,
    pack_int4,
    pack_int5,
    pack_int6,
    pack_int8,
    pack_super_blocks,
    pack_symmetric,
    pack_table,
)

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not block_weights.available(CPU),
    reason="this CPU has no AVX2 (or no compiler): quantized layers are packed for PyTorch's kernels instead",
)


@pytest.fixture(params=["the CPU's", "AVX2"])
def kernel(request):
    """The kernel `matmul` takes on this CPU (AVX-512 VNNI's where it has it), then the AVX2 one that CPUs
    without take, run here too."""
    if request.param == "AVX2":
        return lambda x, blocks, bits, table=Table.NONE: extension().block_matmul_avx2(x, blocks, bits, table)
    return matmul


def fp16_exact(t: torch.Tensor) -> torch.Tensor:
    """Values the blocks store exactly (their scales are fp16)."""
    return t.half().float()


def int4_weights(out_features: int, in_features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scale = fp16_exact(torch.rand(out_features, in_features // BLOCK, generator=generator) / 8)
    minimum = fp16_exact(torch.randn(out_features, in_features // BLOCK, generator=generator) / 8)
    zero = minimum + 8 * scale  # Int4Linear's terms: w = (q - 8) * scale + zero
    weight = (q.float() - 8).reshape(out_features, -1, BLOCK) * scale[..., None] + zero[..., None]
    return pack_int4(q, scale, zero), weight.reshape(out_features, in_features)


def int8_weights(out_features: int, in_features: int, per_block: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_features, in_features), generator=generator).to(torch.int8)
    shape = (out_features, in_features // BLOCK) if per_block else (out_features,)
    scale = fp16_exact(torch.rand(shape, generator=generator) / 100)
    by_block = scale if per_block else scale[:, None].expand(out_features, in_features // BLOCK)
    weight = q.float().reshape(out_features, -1, BLOCK) * by_block[..., None]
    return pack_int8(q, scale), weight.reshape(out_features, in_features)


def int5_weights(out_features: int, in_features: int, seed: int = 0):
    """Q5_0's, Q5_1's and Q5_K's terms: w = scale * q + minimum, q in 0..31."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scale = fp16_exact(torch.rand(out_features, in_features // BLOCK, generator=generator) / 16)
    minimum = fp16_exact(torch.randn(out_features, in_features // BLOCK, generator=generator) / 8)
    weight = q.float().reshape(out_features, -1, BLOCK) * scale[..., None] + minimum[..., None]
    return pack_int5(q, scale, minimum), weight.reshape(out_features, in_features)


def symmetric_weights(bits: int, out_features: int, in_features: int, seed: int = 0):
    """Q4_0's and Q5_0's terms: w = d * (q - 2^(bits - 1)), d alone, q's extremes among the values."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (out_features, in_features), generator=generator, dtype=torch.uint8)
    q[0, :2] = torch.tensor([0, 2**bits - 1], dtype=torch.uint8)
    d = fp16_exact(torch.randn(out_features, in_features // BLOCK, generator=generator) / 16)
    weight = (q.float() - 2 ** (bits - 1)).reshape(out_features, -1, BLOCK) * d[..., None]
    return pack_symmetric(q, bits, d), weight.reshape(out_features, in_features)


def int6_weights(out_features: int, in_features: int, seed: int = 0):
    """Q6_K's terms: w = scale * sub_scale * (q - 32), q in 0..63, an int8 sub_scale a 16 inputs (its
    extremes -128 and 127 among them)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (out_features, in_features), generator=generator, dtype=torch.uint8)
    sub_scale = torch.randint(-128, 128, (out_features, in_features // 16), generator=generator).to(
        torch.int8
    )
    sub_scale[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = fp16_exact(torch.rand(out_features, in_features // BLOCK, generator=generator) / 1000)
    by_half = (sub_scale.float().reshape(out_features, -1, 2) * scale[..., None]).reshape(out_features, -1)
    weight = (q.float() - 32).reshape(out_features, -1, 16) * by_half[..., None]
    return pack_int6(q, sub_scale, scale), weight.reshape(out_features, in_features)


def super_block_weights(
    bits: int, out_features: int, in_features: int, seed: int = 0, symmetric: bool = False
):
    """K-quants' terms in super-blocks: Q4_K's and Q5_K's w = d * s * q + minimum * m (s and m 0..63, the
    file's 6 bits), Q6_K's w = d * s * (q - 32) with an int8 s a 16 inputs (-128 and 127 among them),
    symmetric 4-bit ones' (Q3_K's) w = d * s * (q - 8) so, and 2-bit ones' (Q2_K's) w = d * s * q + minimum
    * m with s and m a 16 inputs (0..255, the layout's bytes; Q2_K's take 4 bits)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (out_features, in_features), generator=generator, dtype=torch.uint8)
    supers = (out_features, in_features // SUPER_BLOCK)
    if bits == 2:
        d = fp16_exact(torch.rand(supers, generator=generator) / 1000)
        minimum = -fp16_exact(torch.rand(supers, generator=generator) / 1000)
        s, m = (torch.randint(0, 256, (out_features, in_features // 16), generator=generator) for _ in "sm")
        s[0, :2], m[0, :2] = torch.tensor([0, 255]), torch.tensor([255, 0])
        scale = d.repeat_interleave(SUPER_BLOCK // 16, dim=1) * s
        low = minimum.repeat_interleave(SUPER_BLOCK // 16, dim=1) * m
        weight = q.float().reshape(out_features, -1, 16) * scale[..., None] + low[..., None]
        return pack_super_blocks(q, 2, d, s, minimum, m), weight.reshape(out_features, in_features)
    d = fp16_exact(torch.rand(supers, generator=generator) / (1000 if bits == 6 or symmetric else 100))
    if bits == 6 or symmetric:
        s = torch.randint(-128, 128, (out_features, in_features // 16), generator=generator).to(torch.int8)
        s[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
        by_16 = d.repeat_interleave(SUPER_BLOCK // 16, dim=1) * s.float()
        weight = (q.float() - 2 ** (bits - 1)).reshape(out_features, -1, 16) * by_16[..., None]
        blocks = pack_super_blocks(q, bits, d, s, symmetric=symmetric)
        return blocks, weight.reshape(out_features, in_features)
    s, m = (torch.randint(0, 64, (out_features, in_features // BLOCK), generator=generator) for _ in "sm")
    s[0, 0], m[0, 0] = 63, 63
    minimum = -fp16_exact(torch.rand(supers, generator=generator) / 50)
    scale = d.repeat_interleave(SUPER_BLOCK // BLOCK, dim=1) * s
    low = minimum.repeat_interleave(SUPER_BLOCK // BLOCK, dim=1) * m
    weight = q.float().reshape(out_features, -1, BLOCK) * scale[..., None] + low[..., None]
    return pack_super_blocks(q, bits, d, s, minimum, m), weight.reshape(out_features, in_features)


def table_weights(
    super_blocks: bool, out_features: int, in_features: int, seed: int = 0, table: Table = Table.IQ4
):
    """IQ4_NL's terms, w = d * t[q] with d a block's, or IQ4_XS's, w = d * s * t[q] with d a super-block's and
    s (-32..31) a block's; q indices into the table's values, every one of them among them. MXFP4's (blocks
    of 32): d a power of two, from 2^-24 (fp16's least) to 2^15, as its 8-bit exponents give them."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    q[0, :16] = torch.arange(16)
    values = torch.tensor(TABLE_VALUES[table], dtype=torch.float32)[q.long()].reshape(out_features, -1, BLOCK)
    unit = SUPER_BLOCK if super_blocks else BLOCK
    d = fp16_exact(torch.randn(out_features, in_features // unit, generator=generator) / 1000)
    if table == Table.MXFP4:
        exponents = torch.randint(-14, -6, d.shape, generator=generator)
        exponents[0, :2] = torch.tensor([-24, 15])
        d = torch.ldexp(torch.ones(d.shape), exponents)
    if not super_blocks:
        return pack_table(q, d), (values * d[..., None]).reshape(out_features, in_features)
    s = torch.randint(-32, 32, (out_features, in_features // BLOCK), generator=generator).to(torch.int8)
    s[0, :2] = torch.tensor([-32, 31], dtype=torch.int8)
    scale = d.repeat_interleave(SUPER_BLOCK // BLOCK, dim=1) * s.float()
    weight = (values * scale[..., None]).reshape(out_features, in_features)
    return pack_super_blocks(q, 4, d, s, table=True), weight


# The CPU's layouts: blocks of 32 of each bits, the K-quants' super-blocks, IQ4_NL's, IQ4_XS's and MXFP4's
# tables, Q4_0's and Q5_0's symmetric blocks.
LAYOUTS = [
    *(Layout(bits) for bits in (4, 5, 6, 8)),
    *(Layout(bits, super_blocks=True) for bits in (2, 4, 5, 6)),
    Layout(4, table=Table.IQ4),
    Layout(4, super_blocks=True, table=Table.IQ4),
    Layout(4, table=Table.MXFP4),
    *(Layout(bits, symmetric=True) for bits in (4, 5)),
    Layout(4, super_blocks=True, symmetric=True),
]
LAYOUT_IDS = [layout.name().replace(" ", "-") for layout in LAYOUTS]


def inputs_of(layout: Layout, blocks: int) -> int:
    """Inputs of about `blocks` blocks that the layout takes (whole super-blocks for super-blocks)."""
    return 2 * SUPER_BLOCK if layout.super_blocks else blocks * BLOCK


def packed(bits: int | Layout, out_features: int, in_features: int, seed: int = 0):
    """Blocks of `bits` (8: a scale a block), or of a layout, and the float weights they hold."""
    if isinstance(bits, Layout):
        layout, bits = bits, bits.bits
        if layout.table:
            return table_weights(layout.super_blocks, out_features, in_features, seed, layout.table)
        if layout.super_blocks:
            return super_block_weights(bits, out_features, in_features, seed, layout.symmetric)
        if layout.symmetric:
            return symmetric_weights(bits, out_features, in_features, seed)
    if bits == 4:
        return int4_weights(out_features, in_features, seed)
    if bits == 5:
        return int5_weights(out_features, in_features, seed)
    if bits == 6:
        return int6_weights(out_features, in_features, seed)
    return int8_weights(out_features, in_features, per_block=True, seed=seed)


def rounded_per_block(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: each block of 32 as int8 values times max|x| / 127."""
    blocks = x.double().reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    return (torch.round(blocks / scale.clamp(min=1e-300)) * scale).reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 4, 5, 6, "4, symmetric"])
def test_super_blocks_hold_the_weights_they_were_packed_from(bits):
    """148, 180 and 210 bytes a channel's 256 inputs (Q4_K, Q5_K, Q6_K: 144, 176 and 210 in the file),
    146 symmetric 4-bit (Q3_K's values, 110 in the file) and 100 2-bit (Q2_K: 84), where blocks of 32
    take 160, 192 and 224; told apart from blocks of 32 by their size."""
    out_features, in_features = 48, 3 * SUPER_BLOCK
    symmetric = bits == "4, symmetric"
    bits = 4 if symmetric else bits
    blocks, weight = super_block_weights(bits, out_features, in_features, symmetric=symmetric)
    assert blocks.dtype == torch.uint8
    assert blocks.shape == (out_features, 3 * (146 if symmetric else {2: 100, 4: 148, 5: 180, 6: 210}[bits]))
    assert layout_of(blocks, in_features) == Layout(bits, super_blocks=True, symmetric=symmetric)
    if bits != 2:  # 2-bit values come in super-blocks alone
        assert layout_of(packed(bits, out_features, in_features)[0], in_features) == Layout(bits)
    assert torch.equal(dequantize(blocks, in_features), weight)


@pytest.mark.parametrize(
    "super_blocks, table",
    [(False, Table.IQ4), (True, Table.IQ4), (False, Table.MXFP4)],
    ids=["IQ4_NL", "IQ4_XS", "MXFP4"],
)
def test_table_blocks_hold_the_weights_they_were_packed_from(super_blocks, table):
    """18 bytes a channel's 32 inputs (IQ4_NL's own size; MXFP4's 17) and 138 a channel's 256 (IQ4_XS:
    136); the same bytes are another table's weights, told apart by `table`."""
    out_features, in_features = 48, 3 * SUPER_BLOCK
    blocks, weight = table_weights(super_blocks, out_features, in_features, table=table)
    assert blocks.shape == (out_features, 3 * 138 if super_blocks else in_features // BLOCK * 18)
    assert layout_of(blocks, in_features, table) == Layout(4, super_blocks=super_blocks, table=table)
    assert torch.equal(dequantize(blocks, in_features, table), weight)
    if not super_blocks:
        other = Table.IQ4 if table == Table.MXFP4 else Table.MXFP4
        assert not torch.equal(dequantize(blocks, in_features, other), weight)


@pytest.mark.parametrize("bits", [4, 5])
def test_symmetric_blocks_keep_d_alone_and_hold_the_weights_they_were_packed_from(bits):
    """Q4_0's and Q5_0's own 18 and 22 bytes a channel's 32 inputs, where an m beside d took 20 and 24;
    4-bit ones take as many bytes as IQ4_NL's table blocks, told apart by `table`."""
    out_features, in_features = 48, 5 * BLOCK
    blocks, weight = symmetric_weights(bits, out_features, in_features)
    assert blocks.shape == (out_features, in_features // BLOCK * {4: 18, 5: 22}[bits])
    assert layout_of(blocks, in_features) == Layout(bits, symmetric=True)
    assert torch.equal(dequantize(blocks, in_features), weight)
    if bits == 4:
        assert layout_of(blocks, in_features, Table.IQ4) == Layout(4, table=Table.IQ4)
        assert not torch.equal(dequantize(blocks, in_features, Table.IQ4), weight)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_blocks_hold_the_weights_they_were_packed_from(bits):
    out_features, in_features = 48, 5 * BLOCK
    for blocks, weight in (
        [packed(bits, out_features, in_features)]
        if bits != 8
        else [int8_weights(out_features, in_features, per_block) for per_block in (True, False)]
    ):
        assert blocks.dtype == torch.uint8
        assert blocks.shape == (out_features, in_features // BLOCK * {4: 20, 5: 24, 6: 28, 8: 34}[bits])
        assert torch.equal(dequantize(blocks, in_features), weight)


@pytest.mark.parametrize("layout", [*LAYOUTS, "8-bit channels"], ids=[*LAYOUT_IDS, "8-bit-channels"])
def test_channels_packed_a_part_at_a_time_are_the_layer_packed_whole(layout, monkeypatch):
    """Packed PACK_CHANNELS output channels at a time (here 32 of 80: two parts and a half one), a layer's
    blocks are those it packs to whole, and hold its weights."""
    out_features = 80

    def pack() -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(layout, Layout):
            return packed(layout, out_features, inputs_of(layout, 3))
        return int8_weights(out_features, 3 * BLOCK, per_block=False)

    whole, weight = pack()
    monkeypatch.setattr(block_weights, "PACK_CHANNELS", 32)
    in_parts, _ = pack()
    assert torch.equal(in_parts, whole)
    table = layout.table if isinstance(layout, Layout) else Table.NONE
    assert torch.equal(dequantize(in_parts, weight.shape[1], table), weight)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_the_loop_makes_the_weights_pytorchs_operations_make_from_any_bytes(layout, monkeypatch):
    """dense_copy (and dequantize) write the floats in the extension's loop: bit for bit PyTorch's
    operations' floats, rounded once to bfloat16, from packed weights and from random bytes (fp16 scales
    of any value, NaN and infinities among them); and by those operations where the extension is not
    built."""
    out_features, in_features = 48, inputs_of(layout, 3)
    blocks, weight = packed(layout, out_features, in_features)
    noise = torch.randint(0, 256, blocks.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    for tried in (blocks, noise):
        expected = block_weights.dequantize_in_torch(tried, in_features, layout.table)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = block_weights.dense_copy(tried, in_features, dtype, layout.table)
            assert got.dtype == dtype and got.shape == (out_features, in_features)
            torch.testing.assert_close(got, expected.to(dtype), atol=0, rtol=0, equal_nan=True)
    assert torch.equal(dequantize(blocks, in_features, layout.table), weight)
    monkeypatch.setattr(extension_module, "_extension", None)
    monkeypatch.setattr(extension_module, "_unavailable", "switched off by the test")
    copy = block_weights.dense_copy(blocks, in_features, torch.bfloat16, layout.table)
    assert torch.equal(copy, weight.bfloat16())


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_multiplies_activations_rounded_per_block_by_the_blocks_weights(layout, dtype, kernel):
    """Exact up to float32 sums (and the output's bfloat16 rounding), for row counts below, at and
    past the rows the kernels take at once (8 with AVX-512, 4 with AVX2); super-blocks too."""
    out_features, in_features = 96, inputs_of(layout, 6)
    blocks, weight = packed(layout, out_features, in_features)
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 9, 17):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        x[0, :BLOCK] = 0  # a block of zeros: no scale to divide by
        got = kernel(x, blocks, layout.bits, layout.table)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        expected = rounded_per_block(x) @ weight.double().T
        tolerance = (1e-5 if dtype == torch.float32 else 2**-8) * expected.abs().max().item()
        assert (got.double() - expected).abs().max().item() < tolerance, rows


@pytest.mark.parametrize("super_blocks", [False, True], ids=["Q6 blocks", "Q6_K super-blocks"])
def test_six_bit_sums_at_their_bounds_are_exact(super_blocks, kernel):
    """6-bit products at the integer sums' limits: u 63 or 0, s -128 or 127, every activation +-127 once
    rounded. The AVX2 kernel sums pairs of vpmaddubsw sums in int16 (4 * 63 * 127 at most) and weighs a
    half block's activation sum (16 * 127) by -32 s in int16: none may wrap."""
    out_features, in_features = 32, 2 * SUPER_BLOCK
    channel = torch.arange(out_features)[:, None]
    q = torch.where(channel % 2 == 0, 63, 0).to(torch.uint8).expand(out_features, in_features).contiguous()
    s = torch.where(channel % 4 < 2, -128, 127).to(torch.int8).expand(out_features, in_features // 16)
    unit = SUPER_BLOCK if super_blocks else BLOCK
    d = torch.full((out_features, in_features // unit), 2.0**-10)
    blocks = pack_super_blocks(q, 6, d, s) if super_blocks else pack_int6(q, s.contiguous(), d)
    weight = (q.float() - 32) * s.float().repeat_interleave(16, dim=1) * 2.0**-10
    x = torch.stack([torch.full((in_features,), 127.0 * (-1) ** row) for row in range(5)])  # 4 + 1 rows
    expected = x.double() @ weight.double().T  # x's blocks round to themselves: their scale is 1
    assert (kernel(x, blocks, 6).double() - expected).abs().max() <= 1e-6 * expected.abs().min()


def test_two_bit_sums_at_their_bounds_are_exact(kernel):
    """2-bit products at the integer sums' limits: u 3 or 0, s and m 255, every activation +-127 once
    rounded. The AVX2 kernel sums a half block's four vpmaddubsw sums in int16 (16 * 3 * 127 at most), then
    weighs them by s, and the half's activation sum (16 * 127) by m, in vpmaddwd: none may wrap."""
    out_features, in_features = 32, 2 * SUPER_BLOCK
    channel = torch.arange(out_features)[:, None]
    q = torch.where(channel % 2 == 0, 3, 0).to(torch.uint8).expand(out_features, in_features).contiguous()
    s = m = torch.full((out_features, in_features // 16), 255)
    d, minimum = torch.full((out_features, 2), 2.0**-10), torch.full((out_features, 2), -(2.0**-12))
    blocks = pack_super_blocks(q, 2, d, s, minimum, m)
    weight = q.float() * 255 * 2.0**-10 - 255 * 2.0**-12
    x = torch.stack([torch.full((in_features,), 127.0 * (-1) ** row) for row in range(5)])  # 4 + 1 rows
    expected = x.double() @ weight.double().T  # x's blocks round to themselves: their scale is 1
    assert (kernel(x, blocks, 2).double() - expected).abs().max() <= 1e-6 * expected.abs().min()


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_a_row_alone_gets_the_products_it_gets_among_others(layout, kernel):
    """One row (a stream's decode step) takes a pass of its own over the blocks (AVX2, 2-, 4- and 8-bit:
    both halves of each block in turn), bit for bit the products the same row gets among others."""
    out_features, in_features = 96, inputs_of(layout, 6)
    blocks = packed(layout, out_features, in_features)[0]
    x = torch.randn(6, in_features, generator=torch.Generator().manual_seed(4))
    together = kernel(x, blocks, layout.bits, layout.table)
    for row in range(len(x)):
        assert torch.equal(
            kernel(x[row : row + 1], blocks, layout.bits, layout.table), together[row : row + 1]
        ), row


@pytest.mark.skipif(block_weights.kernel(CPU) != "AVX-512 VNNI", reason="this CPU has the AVX2 kernel alone")
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_the_avx2_kernel_gives_the_avx512_kernels_products(layout):
    """The same int8 activations and integer sums: 2- to 6-bit products bit for bit (symmetric ones
    too: both add m = -8 d or -16 d times x's sum); 8-bit ones (and a table's, multiplied as 8-bit ones)
    sum q * x where AVX-512 sums u * x and subtracts 128 * x, so they differ by float32 rounding alone."""
    bits, in_features = layout.bits, inputs_of(layout, 9)
    blocks = packed(layout, 64, in_features)[0]
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(3))  # 4 + 4 + 1 rows with AVX2
    avx512 = matmul(x, blocks, bits, layout.table)
    avx2 = extension().block_matmul_avx2(x, blocks, bits, layout.table)
    if bits != 8 and not layout.table:
        assert torch.equal(avx2, avx512)
    else:
        assert (avx2 - avx512).abs().max() < 1e-6 * avx512.abs().max()


@pytest.mark.parametrize(
    "bits",
    [
        4,
        5,
        6,
        8,
        Layout(4, super_blocks=True),
        Layout(2, super_blocks=True),
        Layout(4, table=Table.IQ4),
        Layout(4, table=Table.MXFP4),
        Layout(4, symmetric=True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_activation_makes_every_product_of_its_row_nan(bits, dtype, kernel):
    """Wherever the NaN sits in its block (a lane of either half, the first or the last), its row's
    products are all NaN, as a float product's would be, not -128 times a finite scale in some channels;
    an infinite activation gives NaN too; the other rows' products are as without it."""
    in_features = SUPER_BLOCK if isinstance(bits, Layout) else 4 * BLOCK
    blocks = packed(bits, 32, in_features)[0]
    bits, table = (bits.bits, bits.table) if isinstance(bits, Layout) else (bits, Table.NONE)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(4)).to(dtype)
    clean = kernel(x, blocks, bits, table)
    for column, bad in ((0, "nan"), (9, "nan"), (16, "nan"), (31, "nan"), (77, "nan"), (100, "inf")):
        poisoned = x.clone()
        poisoned[2, column] = float(bad)
        got = kernel(poisoned, blocks, bits, table)
        assert got[2].isnan().all(), (column, bad)
        assert torch.equal(got[[0, 1, 3, 4]], clean[[0, 1, 3, 4]])


def test_empty_shapes_give_empty_products(kernel):
    """No output channels (a division by zero sharing no groups among no threads), no rows, no inputs:
    an empty result, or zeros, as x @ W.T gives."""
    blocks, _ = int4_weights(32, 2 * BLOCK)
    x = torch.randn(3, 2 * BLOCK)
    assert kernel(x, blocks[:0], 4).shape == (3, 0)
    assert kernel(x[:0], blocks, 4).shape == (0, 32)
    assert torch.equal(kernel(x[:, :0], blocks[:, :0], 4), torch.zeros(3, 32))


def test_rounding_activations_per_block_costs_under_one_percent_a_few_times_bfloat16s_rounding():
    """Against the float product: 8 bits a value with a block's scale, where bfloat16 keeps 8 bits of
    each value's own mantissa (on Gaussian activations 0.56% against 0.17% here)."""
    blocks, weight = int4_weights(256, 576)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ weight.double().T
    in_blocks = (matmul(x, blocks, 4).double() - exact).norm() / exact.norm()
    in_bfloat16 = (x.bfloat16().double() @ weight.double().T - exact).norm() / exact.norm()
    assert in_bfloat16 < in_blocks < 5 * in_bfloat16
    assert in_blocks < 0.01


def test_compiled_code_calls_the_kernel_as_an_operator():
    """torch.compile (--compile) traces the kernel as a custom operator, with no graph break."""
    blocks, _ = int4_weights(64, 4 * BLOCK)
    x = torch.randn(3, 4 * BLOCK)
    compiled = torch.compile(lambda x: matmul(x, blocks, 4) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), matmul(x, blocks, 4) * 2)


def test_wrong_inputs_are_refused_with_the_reason():
    blocks, _ = int4_weights(32, 2 * BLOCK)
    with pytest.raises(RuntimeError, match="bits must be 2, 4, 5, 6 or 8"):
        matmul(torch.randn(1, 2 * BLOCK), blocks, 7)
    with pytest.raises(RuntimeError, match="do not hold 8-bit blocks"):
        matmul(torch.randn(1, 2 * BLOCK), blocks, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        matmul(torch.randn(1, 2 * BLOCK + 1), blocks, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        matmul(torch.randn(1, 2 * BLOCK).half(), blocks, 4)
    six_bit_super_blocks, _ = super_block_weights(6, 32, SUPER_BLOCK)
    with pytest.raises(RuntimeError, match="do not hold 4-bit blocks or super-blocks of 256 inputs"):
        matmul(torch.randn(1, SUPER_BLOCK), six_bit_super_blocks, 4)
    # 2-bit values come in super-blocks alone: 2-bit blocks of 32 would take what 4-bit ones with an m do
    with pytest.raises(RuntimeError, match="do not hold 2-bit blocks or super-blocks of 64 inputs"):
        matmul(torch.randn(1, 2 * BLOCK), blocks, 2)
    with pytest.raises(RuntimeError, match="a table's indices are 4-bit, not 5"):
        matmul(torch.randn(1, 2 * BLOCK), symmetric_weights(5, 32, 2 * BLOCK)[0], 5, Table.IQ4)
    with pytest.raises(RuntimeError, match="do not hold 4-bit table blocks"):  # 4-bit blocks with an m
        matmul(torch.randn(1, 2 * BLOCK), blocks, 4, Table.MXFP4)
    with pytest.raises(RuntimeError, match="no table 3"):
        matmul(torch.randn(1, 2 * BLOCK), blocks, 4, 3)
    # MXFP4 comes in blocks of 32 alone: super-blocks of its values are refused
    iq4_xs, _ = table_weights(True, 32, SUPER_BLOCK)
    with pytest.raises(RuntimeError, match="do not hold 4-bit table blocks or super-blocks of 256"):
        matmul(torch.randn(1, SUPER_BLOCK), iq4_xs, 4, Table.MXFP4)

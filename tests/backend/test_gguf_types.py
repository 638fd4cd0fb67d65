"""Each GGUF type's blocks become the engine's weights: the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) as
super-blocks,
Q5_0 and Q5_1 as 5-bit blocks, exactly, the other types as 8-bit blocks within half a step of 1/127 of
each block's largest weight, against the gguf package's own dequantization (the reference transformers
loads too)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from backend.model.gguf_conversion import q8_0_floats
from backend.quant import block_weights
from backend.quant.gguf_types import (
    EightBitWeight,
    FiveBitSymmetric,
    FiveBitWeight,
    FourBitWeight,
    MXFP4Weight,
    SixBitWeight,
    SuperBlockWeight,
    TableSuperBlocks,
    TableWeight,
    ThreeBitWeight,
    TwoBitWeight,
    requantize_int8,
    served,
    unpack,
)
from backend.quant.quantized_linear import BlocksLinear, Int8Linear
from tests.backend.k_quants import quantize

K_TYPES = [
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q2_K,
]
SIGNED_SCALES = (GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q3_K)  # w = d * s * q, a 16 inputs' s
SIXTEENS = (*SIGNED_SCALES, GGMLQuantizationType.Q2_K)  # a scale a 16 inputs
# Largest error of the writer against the weights, in steps of the kind's largest block (its range over
# 15 or 31 levels; Q6_K: its largest magnitude over 31): half a step, with room for fp16 scales. Q3_K's
# q run from -4 to 3 (its step: the largest magnitude over 4), so a weight of the other sign near the
# largest is a step away.
HALF_STEP = 0.5 + 1e-2
ONE_STEP = 1 + 1e-2


def weights(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # each row its own magnitude, as real layers' channels differ, and some large outliers
    scale = rng.uniform(0.01, 0.1, size=(rows, 1))
    values = rng.standard_normal((rows, columns)) * scale
    values[rng.random(values.shape) < 0.002] *= 8
    return values.astype(np.float32)


def largest_step(w: np.ndarray, kind: GGMLQuantizationType) -> float:
    blocks = w.reshape(-1, 16 if kind in SIXTEENS else 32)
    if kind in SIGNED_SCALES:
        return float(np.abs(blocks).max() / (31 if kind == GGMLQuantizationType.Q6_K else 4))
    levels = {GGMLQuantizationType.Q2_K: 3, GGMLQuantizationType.Q4_K: 15}.get(kind, 31)
    return float((blocks.max(axis=1) - np.minimum(blocks.min(axis=1), 0)).max() / levels)


@pytest.mark.parametrize("kind", K_TYPES)
def test_the_k_quant_blocks_written_for_tests_are_what_gguf_reads(kind):
    """The test files' writer (tests/backend/k_quants.py) against the gguf package's dequantization: its
    blocks hold the weights within half a step, so it packs each field where the format puts it."""
    w = weights(16, 512)
    back = quants.dequantize(quantize(w, kind), kind)
    allowed = ONE_STEP if kind == GGMLQuantizationType.Q3_K else HALF_STEP
    assert np.abs(back - w).max() <= allowed * largest_step(w, kind)


@pytest.mark.parametrize("kind", K_TYPES)
def test_k_quants_unpack_to_exactly_the_weights_gguf_dequantizes(kind):
    """Each field where the K-quant puts it: Q4_K's and Q5_K's nibbles, fifth bits, 6-bit scales and mins
    and their d and dmin; Q6_K's low nibbles, top two bits, sixteen int8 scales (negative ones too) and d;
    Q3_K's low two bits, third bits, sixteen 6-bit scales (negative ones too) and d, as Q6_K's terms with
    q + 8 (4..11) for q - 8; Q2_K's 2-bit q, sixteen 4-bit scales and mins, d and dmin. The same weights with
    a scale a block of 32 (for devices with no super-blocks) too, where they have them."""
    w = weights(32, 768)
    w[3, :16] *= -1  # a 16 whose largest magnitude is negative
    rows = quantize(w, kind)
    expected = quants.dequantize(rows, kind)
    unpacked = unpack(rows, kind)
    if kind == GGMLQuantizationType.Q2_K:
        assert isinstance(unpacked, TwoBitWeight) and unpacked.q.max() == 3 and unpacked.q.min() == 0
        assert unpacked.s.shape == unpacked.m.shape == (32, 48) and unpacked.d.shape == (32, 3)
        assert unpacked.s.max() == 15 and unpacked.m.max() == 15
        assert torch.equal(two_bit_weights(unpacked), torch.from_numpy(expected))
        return
    if kind in SIGNED_SCALES:
        six_bit = kind == GGMLQuantizationType.Q6_K
        assert isinstance(unpacked, SixBitWeight if six_bit else ThreeBitWeight)
        assert unpacked.sub_scale.dtype == torch.int8
        if not six_bit:  # its writer's scales take the sign of each 16's largest
            assert (unpacked.sub_scale < 0).any() and (unpacked.sub_scale > 0).any()
        offset = 32 if six_bit else 8
        rebuilt = block_weights.dequantize_sub_scaled(
            unpacked.q, unpacked.sub_scale, unpacked.scale(), offset
        )
        assert torch.equal(rebuilt, torch.from_numpy(expected))
        assert unpacked.q.max() == (63 if six_bit else 11)
        assert six_bit or unpacked.q.min() == 4
        return
    assert isinstance(unpacked, SuperBlockWeight) and unpacked.q.max() == 2**unpacked.bits - 1
    assert unpacked.d.shape == unpacked.minimum.shape == (32, 3) and unpacked.s.shape == (32, 24)
    rebuilt = unpacked.q.float().reshape(32, -1, 32) * unpacked.scale()[..., None]
    rebuilt = rebuilt + unpacked.block_minimum()[..., None]
    np.testing.assert_allclose(rebuilt.reshape(32, -1).numpy(), expected, rtol=0, atol=1e-7)
    per_block = unpacked.per_block()
    if isinstance(per_block, FourBitWeight):
        rebuilt = (per_block.q.float() - 8).reshape(32, -1, 32) * per_block.scale[..., None]
        rebuilt = rebuilt + per_block.zero[..., None]
    else:
        assert isinstance(per_block, FiveBitWeight)
        rebuilt = per_block.q.float().reshape(32, -1, 32) * per_block.scale[..., None]
        rebuilt = rebuilt + per_block.minimum[..., None]
    np.testing.assert_allclose(rebuilt.reshape(32, -1).numpy(), expected, rtol=0, atol=1e-7)


def two_bit_weights(weight: TwoBitWeight) -> torch.Tensor:
    """TwoBitWeight's float32 weights: q * (d * s) + minimum * m, each 16 inputs' (d * s exact)."""
    out_features = weight.q.shape[0]
    scale = weight.d.repeat_interleave(16, dim=1) * weight.s.float()
    low = weight.minimum.repeat_interleave(16, dim=1) * weight.m.float()
    sixteens = weight.q.float().reshape(out_features, -1, 16) * scale[..., None] + low[..., None]
    return sixteens.reshape(out_features, -1)


def test_q2_k_blocks_of_any_bytes_unpack_to_the_weights_gguf_dequantizes():
    """Every bit of a Q2_K block where the format puts it, whatever its value: random bytes (every scale
    and min from 0 to 15, every q) but for a finite d and dmin, as its terms and as the CPU's 2-bit
    super-blocks, against the gguf package's dequantization."""
    rows = np.random.default_rng(6).integers(0, 256, (32, 3 * 84), dtype=np.uint8)
    rows.reshape(-1, 84)[:, 80:82] = np.float16(2**-7).reshape(1).view(np.uint8)
    rows.reshape(-1, 84)[:, 82:84] = np.float16(3 * 2**-9).reshape(1).view(np.uint8)
    expected = torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType.Q2_K))
    unpacked = unpack(rows, GGMLQuantizationType.Q2_K)
    assert unpacked.s.min() == unpacked.m.min() == 0 and unpacked.s.max() == unpacked.m.max() == 15
    assert torch.equal(two_bit_weights(unpacked), expected)
    if block_weights.available(torch.device("cpu")):
        assert torch.equal(block_weights.dequantize(unpacked.blocks(), 768), expected)


def test_q3_k_blocks_of_any_bytes_unpack_to_the_weights_gguf_dequantizes():
    """Every bit of a Q3_K block where the format puts it, whatever its value: random bytes (every scale
    from -32 to 31, every third bit set or not) but for a finite d, as q + 8 and its scales and as the
    CPU's symmetric 4-bit super-blocks, against the gguf package's dequantization."""
    rows = np.random.default_rng(5).integers(0, 256, (32, 3 * 110), dtype=np.uint8)
    rows.reshape(-1, 110)[:, 108:] = np.float16(2**-7).reshape(1).view(np.uint8)
    expected = torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType.Q3_K))
    unpacked = unpack(rows, GGMLQuantizationType.Q3_K)
    assert unpacked.sub_scale.min() == -32 and unpacked.sub_scale.max() == 31
    rebuilt = block_weights.dequantize_sub_scaled(unpacked.q, unpacked.sub_scale, unpacked.scale(), 8)
    assert torch.equal(rebuilt, expected)
    if block_weights.available(torch.device("cpu")):
        assert torch.equal(block_weights.dequantize(unpacked.blocks(), 768), expected)


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
@pytest.mark.parametrize("kind", K_TYPES)
def test_the_cpus_super_blocks_hold_each_k_quant_bit_for_bit(kind):
    """Served from super-blocks, a K-quant's layer holds exactly the file's weights (d, dmin and the 6-bit
    scales as they are), in 148, 180 or 210 bytes a channel's 256 inputs (Q3_K: 146, symmetric 4-bit;
    Q2_K: 100, 2-bit), and multiplies by them."""
    w = weights(32, 768)
    rows = quantize(w, kind)
    expected = torch.from_numpy(quants.dequantize(rows, kind))
    layer = BlocksLinear.of(unpack(rows, kind))
    if kind == GGMLQuantizationType.Q3_K:
        assert layer.layout() == "4-bit symmetric super-blocks" and layer.blocks.shape == (32, 3 * 146)
    elif kind == GGMLQuantizationType.Q2_K:
        assert layer.layout() == "2-bit super-blocks" and layer.blocks.shape == (32, 3 * 100)
    else:
        assert layer.super_blocks and layer.layout() == f"{layer.bits}-bit super-blocks"
        assert layer.blocks.shape == (32, 3 * {4: 148, 5: 180, 6: 210}[layer.bits])
    assert torch.equal(block_weights.dequantize(layer.blocks, 768), expected)
    x = torch.randn(4, 768)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
def test_the_cpus_6_bit_blocks_of_32_hold_q6_k_bit_for_bit():
    """Q6_K's d repeated for each block of 32 (7 bits a weight): the layout of 6-bit blocks of 32."""
    rows = quantize(weights(32, 768), GGMLQuantizationType.Q6_K)
    expected = torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType.Q6_K))
    six_bit = unpack(rows, GGMLQuantizationType.Q6_K)
    layer = BlocksLinear.int6(six_bit.q, six_bit.sub_scale, six_bit.scale())
    assert not layer.super_blocks and layer.blocks.shape == (32, 768 // 32 * 28)
    assert torch.equal(block_weights.dequantize(layer.blocks, 768), expected)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1])
def test_5_bit_types_unpack_to_exactly_the_weights_gguf_dequantizes(kind):
    """Q5_0's and Q5_1's fifth bits in a 32-bit word: the CPU's 5-bit blocks hold them bit for bit, Q5_0's
    symmetric ones with d alone (22 bytes a channel's 32, as in the file)."""
    w = weights(32, 768)
    rows = quantize(w, kind)
    expected = torch.from_numpy(quants.dequantize(rows, kind))
    unpacked = unpack(rows, kind)
    symmetric = kind == GGMLQuantizationType.Q5_0
    assert isinstance(unpacked, FiveBitSymmetric if symmetric else FiveBitWeight)
    five_bit = unpacked.per_block() if symmetric else unpacked
    assert isinstance(five_bit, FiveBitWeight) and five_bit.q.max() == 31 and five_bit.q.min() == 0
    rebuilt = five_bit.q.float().reshape(32, -1, 32) * five_bit.scale[..., None] + five_bit.minimum[..., None]
    np.testing.assert_allclose(rebuilt.reshape(32, -1).numpy(), expected, rtol=0, atol=1e-7)
    if not block_weights.available(torch.device("cpu")):
        return
    if symmetric:
        layer = BlocksLinear.of(unpacked)
        assert layer.layout() == "5-bit symmetric blocks" and layer.blocks.shape == (32, 24 * 22)
    else:
        layer = BlocksLinear.int5(five_bit.q, five_bit.scale, five_bit.minimum)
    assert torch.equal(block_weights.dequantize(layer.blocks, 768), expected)
    x = torch.randn(4, 768)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


IQ4_TYPES = [GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS]


@pytest.mark.parametrize("kind", IQ4_TYPES, ids=lambda kind: kind.name)
def test_iq4_types_unpack_to_exactly_the_weights_gguf_dequantizes(kind):
    """The test files' IQ4 blocks hold the weights within 12% of each row's largest (the table's widest gap
    is 23 of 127, and its positive values end at 113), so their fields sit where the format puts them;
    unpacked, their indices, d and (IQ4_XS) 6-bit s rebuild the gguf package's weights exactly, and so do
    the CPU's table blocks, 18 bytes a channel's 32 (IQ4_NL) or 138 its 256 (IQ4_XS: 136 in the file)."""
    w = weights(32, 768)
    rows = quantize(w, kind)
    expected = torch.from_numpy(quants.dequantize(rows, kind))
    assert (np.abs(expected.numpy() - w) <= 0.12 * np.abs(w).max(axis=1, keepdims=True)).all()
    unpacked = unpack(rows, kind)
    values = torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32)[unpacked.q.long()]
    if kind == GGMLQuantizationType.IQ4_XS:
        assert isinstance(unpacked, TableSuperBlocks) and unpacked.s.min() >= -32 and unpacked.s.max() <= 31
        scale = unpacked.d.repeat_interleave(8, dim=1) * unpacked.s.float()
    else:
        assert isinstance(unpacked, TableWeight)
        scale = unpacked.d
    assert torch.equal((values.reshape(32, -1, 32) * scale[..., None]).reshape(32, -1), expected)
    if not block_weights.available(torch.device("cpu")):
        return
    layer = BlocksLinear.of(unpacked)
    assert layer.layout() == (
        "4-bit table super-blocks" if kind == GGMLQuantizationType.IQ4_XS else "4-bit table blocks"
    )
    assert layer.blocks.shape == (32, 3 * 138 if kind == GGMLQuantizationType.IQ4_XS else 24 * 18)
    assert torch.equal(block_weights.dequantize(layer.blocks, 768, block_weights.Table.IQ4), expected)
    x = torch.randn(4, 768)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


def test_mxfp4_unpacks_to_exactly_the_weights_gguf_dequantizes():
    """MXFP4 (gpt-oss's experts; the gguf package's own quantizer writes it): E2M1's values doubled,
    times 2^(e - 128) a block of 32. Unpacked, its indices and d in fp16 rebuild the gguf package's weights
    exactly, and so do the CPU's blocks of MXFP4's table, 18 bytes a channel's 32 (17 in the file)."""
    w = weights(32, 768)
    w[0, :32] *= 2**-12  # a block whose d is fp16's subnormal 2^-23 or so
    rows = quantize(w, GGMLQuantizationType.MXFP4)
    expected = torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType.MXFP4))
    unpacked = unpack(rows, GGMLQuantizationType.MXFP4)
    assert isinstance(unpacked, MXFP4Weight) and unpacked.table == block_weights.Table.MXFP4
    assert unpacked.d[0, 0] < 2**-14  # below fp16's normals, held all the same
    values = torch.tensor(quants.MXFP4.kvalues, dtype=torch.float32)[unpacked.q.long()]
    assert torch.equal((values.reshape(32, -1, 32) * unpacked.d[..., None]).reshape(32, -1), expected)
    if not block_weights.available(torch.device("cpu")):
        return
    layer = BlocksLinear.of(unpacked)
    assert layer.layout() == "4-bit MXFP4 table blocks" and layer.blocks.shape == (32, 24 * 18)
    assert torch.equal(block_weights.dequantize(layer.blocks, 768, block_weights.Table.MXFP4), expected)
    x = torch.randn(4, 768)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


def test_q8_0_dequantized_by_the_servers_threads_is_the_gguf_packages_to_the_bit():
    """A Q8_0 tensor's floats (`gguf_conversion.floats`: gpt-oss's and Mixtral's attention, output head and
    embedding as a start reads them, every Q8_0 tensor a conversion writes) are each value times its block's
    fp16 scale in float32: the gguf package's numbers exactly, for a matrix, experts stacked [experts,
    rows, bytes], scales from subnormal to large, and a block of zeros."""
    values = weights(48, 256) * np.exp2(np.arange(48) - 30.0)[:, None].astype(np.float32)
    values[3, :32] = 0
    rows = quants.quantize(values, GGMLQuantizationType.Q8_0)
    for data in (rows, rows.reshape(4, 12, -1)):
        got = q8_0_floats(data)
        expected = quants.dequantize(data, GGMLQuantizationType.Q8_0)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert torch.equal(got, torch.from_numpy(expected))


def test_an_mxfp4_tensor_with_a_power_of_two_fp16_does_not_hold_becomes_8_bit_blocks():
    """An exponent below 104 (d under 2^-24) or over 143 (2^16): fp16 holds no such d, and the tensor is
    requantized as the types without a layout of their own are. A block of zeros takes any exponent (a
    zero block's is 0 as the gguf package writes it): its weights are 0 with d = 0."""
    rows = quantize(weights(16, 256), GGMLQuantizationType.MXFP4)
    zero_block = rows[1].reshape(-1, 17)[0]
    zero_block[0], zero_block[1:] = 0, 0x80  # indices 0 and 8: +0 and -0
    unpacked = unpack(rows, GGMLQuantizationType.MXFP4)
    assert isinstance(unpacked, MXFP4Weight) and unpacked.d[1, 0] == 0
    expected = torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType.MXFP4))
    assert torch.equal(
        unpacked.q.float()
        .new_tensor(quants.MXFP4.kvalues)[unpacked.q.long()]
        .reshape(16, -1, 32)
        .mul(unpacked.d[..., None])
        .reshape(16, -1),
        expected,
    )
    for exponent in (103, 144):
        out_of_range = rows.copy()
        out_of_range[2, 0] = exponent
        eight_bit = unpack(out_of_range, GGMLQuantizationType.MXFP4)
        assert isinstance(eight_bit, EightBitWeight)
        assert_within_half_a_step(
            eight_bit, torch.from_numpy(quants.dequantize(out_of_range, GGMLQuantizationType.MXFP4))
        )


@pytest.mark.parametrize("kind", [GGMLQuantizationType.TQ2_0, GGMLQuantizationType.TQ1_0])
def test_other_types_become_8_bit_blocks_within_half_a_step_of_each_blocks_largest_weight(kind):
    w = weights(32, 512)
    rows = quantize(w, kind)
    expected = torch.from_numpy(quants.dequantize(rows, kind))
    eight_bit = unpack(rows, kind)
    assert isinstance(eight_bit, EightBitWeight) and eight_bit.q.dtype == torch.int8
    assert_within_half_a_step(eight_bit, expected)
    layer = Int8Linear(eight_bit.q, eight_bit.scale, None)
    x = torch.randn(4, 512)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


def assert_within_half_a_step(eight_bit: EightBitWeight, expected: torch.Tensor) -> None:
    largest = expected.reshape(expected.shape[0], -1, 32).abs().amax(dim=-1)
    assert (eight_bit.scale >= largest / 127).all()  # no weight clipped
    assert (eight_bit.scale <= largest / 127 * (1 + 2**-10) + 2**-24).all()  # fp16, rounded up at most
    rebuilt = eight_bit.q.float().reshape(expected.shape[0], -1, 32) * eight_bit.scale[..., None]
    error = (rebuilt - expected.reshape(rebuilt.shape)).abs()
    assert (error <= eight_bit.scale[..., None] / 2 * 1.0001).all()
    assert eight_bit.q.abs().max() <= 127


def test_requantizing_a_block_of_tiny_weights_keeps_them_all_in_range():
    """A block whose largest weight over 127 is below fp16's smallest normal gets a subnormal scale,
    which rounds by several percent: rounded down, its largest weight would fall outside -127..127."""
    w = np.full((16, 64), 3.3e-5, dtype=np.float32)
    w[:, 1::2] *= -0.7
    nearest = torch.tensor(3.3e-5 / 127).to(torch.float16).float()
    assert 3.3e-5 / nearest > 127.5  # fp16's nearest scale would put the largest weight out of range
    assert_within_half_a_step(requantize_int8(w), torch.from_numpy(w))


def test_requantizing_a_block_of_huge_weights_rounds_its_scale_up_too():
    """Past 2048 fp16's steps are 2 and more: 786,432 / 127 rounds down to 6,188, and the scale one step
    up from there (not one step toward 1) keeps the largest weight within 127."""
    w = np.full((16, 64), 786432.0, dtype=np.float32)
    assert torch.tensor(786432.0 / 127).half().float() < 786432.0 / 127
    assert_within_half_a_step(requantize_int8(w), torch.from_numpy(w))


def test_float_types_and_rows_of_no_whole_block_stay_floats():
    assert not served(GGMLQuantizationType.F16, 64) and not served(GGMLQuantizationType.BF16, 64)
    assert not served(GGMLQuantizationType.Q8_0, 48)
    assert served(GGMLQuantizationType.Q6_K, 256) and served(GGMLQuantizationType.Q4_0, 64)

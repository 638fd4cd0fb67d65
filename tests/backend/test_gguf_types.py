"""Each GGUF type's blocks become the engine's weights: Q4_K as 4-bit blocks, Q5_0, Q5_1 and Q5_K as
5-bit ones, Q6_K as 6-bit ones, exactly (K-quants within fp16 rounding of their scales), the other
types as 8-bit blocks within half a step of 1/127 of each block's largest weight, against the gguf
package's own dequantization (the reference transformers loads too)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from backend.quant import block_weights
from backend.quant.gguf_types import (
    EightBitWeight,
    FiveBitWeight,
    FourBitWeight,
    SixBitWeight,
    requantize_int8,
    served,
    unpack,
)
from backend.quant.quantized_linear import BlocksLinear, Int4Linear, Int8Linear
from tests.backend.k_quants import quantize

K_TYPES = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]
# Largest error of the writer against the weights, in steps of the kind's largest block (its range over
# 15 or 31 levels; Q6_K: its largest magnitude over 31): half a step, with room for fp16 scales.
HALF_STEP = 0.5 + 1e-2


def weights(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # each row its own magnitude, as real layers' channels differ, and some large outliers
    scale = rng.uniform(0.01, 0.1, size=(rows, 1))
    values = rng.standard_normal((rows, columns)) * scale
    values[rng.random(values.shape) < 0.002] *= 8
    return values.astype(np.float32)


def largest_step(w: np.ndarray, kind: GGMLQuantizationType) -> float:
    blocks = w.reshape(-1, 16 if kind == GGMLQuantizationType.Q6_K else 32)
    if kind == GGMLQuantizationType.Q6_K:
        return float(np.abs(blocks).max() / 31)
    levels = 15 if kind == GGMLQuantizationType.Q4_K else 31
    return float((blocks.max(axis=1) - np.minimum(blocks.min(axis=1), 0)).max() / levels)


@pytest.mark.parametrize("kind", K_TYPES)
def test_the_k_quant_blocks_written_for_tests_are_what_gguf_reads(kind):
    """The test files' writer (tests/backend/k_quants.py) against the gguf package's dequantization: its
    blocks hold the weights within half a step, so it packs each field where the format puts it."""
    w = weights(16, 512)
    back = quants.dequantize(quantize(w, kind), kind)
    assert np.abs(back - w).max() <= HALF_STEP * largest_step(w, kind)


def test_q4_k_unpacks_to_exactly_the_weights_gguf_dequantizes():
    w = weights(32, 768)
    rows = quantize(w, GGMLQuantizationType.Q4_K)
    expected = quants.dequantize(rows, GGMLQuantizationType.Q4_K)
    unpacked = unpack(rows, GGMLQuantizationType.Q4_K)
    assert isinstance(unpacked, FourBitWeight) and unpacked.q.max() <= 15
    rebuilt = (unpacked.q.float() - 8).reshape(32, -1, 32) * unpacked.scale[..., None] + unpacked.zero[
        ..., None
    ]
    np.testing.assert_allclose(rebuilt.reshape(32, -1).numpy(), expected, rtol=0, atol=1e-7)


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
def test_the_cpus_4_bit_blocks_hold_q4_k_within_fp16_rounding_of_its_scales():
    """d * s and dmin * m become fp16 in the blocks: each within 2^-11 of itself, so a weight within
    2^-11 of (15 * scale + min); the layer's products as close to the float weights' as Q4_0's are."""
    w = weights(32, 768)
    rows = quantize(w, GGMLQuantizationType.Q4_K)
    expected = torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType.Q4_K))
    unpacked = unpack(rows, GGMLQuantizationType.Q4_K)
    layer = Int4Linear(unpacked.q, unpacked.scale, unpacked.zero, None)
    served_weights = block_weights.dequantize(layer.blocks, 768)
    bound = 2**-11 * (15 * unpacked.scale + (8 * unpacked.scale - unpacked.zero).abs())
    assert ((served_weights - expected).abs().reshape(32, -1, 32) <= bound[..., None] * 1.0001).all()
    x = torch.randn(4, 768)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


def test_q6_k_unpacks_to_exactly_the_weights_gguf_dequantizes():
    """Each field where Q6_K puts it: low nibbles, top two bits, the sixteen int8 scales (negative ones
    too) and d; the CPU's 6-bit blocks then hold those weights bit for bit, and multiply by them."""
    w = weights(32, 768)
    w[3, :16] *= -1  # a 16 whose largest magnitude is negative
    rows = quantize(w, GGMLQuantizationType.Q6_K)
    expected = torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType.Q6_K))
    six_bit = unpack(rows, GGMLQuantizationType.Q6_K)
    assert (
        isinstance(six_bit, SixBitWeight) and six_bit.q.max() <= 63 and six_bit.sub_scale.dtype == torch.int8
    )
    assert torch.equal(
        block_weights.dequantize_int6_values(six_bit.q, six_bit.sub_scale, six_bit.scale), expected
    )
    if not block_weights.available(torch.device("cpu")):
        return
    layer = BlocksLinear.int6(six_bit.q, six_bit.sub_scale, six_bit.scale)
    assert torch.equal(block_weights.dequantize(layer.blocks, 768), expected)
    assert layer.blocks.shape == (32, 768 // 32 * 28)  # 7 bits a weight
    x = torch.randn(4, 768)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.parametrize(
    "kind", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K]
)
def test_5_bit_types_unpack_to_exactly_the_weights_gguf_dequantizes(kind):
    """Q5_0's and Q5_1's fifth bits in a 32-bit word, Q5_K's in 32 bytes beside Q4_K's nibbles: the CPU's
    5-bit blocks hold Q5_0 and Q5_1 bit for bit, and Q5_K within fp16 rounding of d * s and dmin * m."""
    w = weights(32, 768)
    rows = quantize(w, kind)
    expected = torch.from_numpy(quants.dequantize(rows, kind))
    five_bit = unpack(rows, kind)
    assert isinstance(five_bit, FiveBitWeight) and five_bit.q.max() == 31 and five_bit.q.min() == 0
    rebuilt = five_bit.q.float().reshape(32, -1, 32) * five_bit.scale[..., None] + five_bit.minimum[..., None]
    np.testing.assert_allclose(rebuilt.reshape(32, -1).numpy(), expected, rtol=0, atol=1e-7)
    if not block_weights.available(torch.device("cpu")):
        return
    layer = BlocksLinear.int5(five_bit.q, five_bit.scale, five_bit.minimum)
    served_weights = block_weights.dequantize(layer.blocks, 768)
    if kind == GGMLQuantizationType.Q5_K:
        bound = 2**-11 * (31 * five_bit.scale + five_bit.minimum.abs())
        assert ((served_weights - expected).abs().reshape(32, -1, 32) <= bound[..., None] * 1.0001).all()
    else:
        assert torch.equal(served_weights, expected)
    x = torch.randn(4, 768)
    reference = x @ expected.T
    assert (layer(x) - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.parametrize("kind", [GGMLQuantizationType.TQ2_0, GGMLQuantizationType.MXFP4])
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


def test_float_types_and_rows_of_no_whole_block_stay_floats():
    assert not served(GGMLQuantizationType.F16, 64) and not served(GGMLQuantizationType.BF16, 64)
    assert not served(GGMLQuantizationType.Q8_0, 48)
    assert served(GGMLQuantizationType.Q6_K, 256) and served(GGMLQuantizationType.Q4_0, 64)

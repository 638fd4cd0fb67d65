"""The fused CPU operations (backend/layers/decode_ops.py): each C++ loop against its PyTorch reference, then
whole decode steps of a quantized model with the loops against the same steps with PyTorch's operations.

The loops compute in float32 and round once: in float32 they agree with the reference to float32's
rounding, in bfloat16 to one bfloat16 rounding of the output (a relative 2^-8).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as glm_rotation

from backend.engine.engine import Engine
from backend.kernels import extension as kernels
from backend.layers import step_layout
from backend.layers.decode_ops import EAGER, FusedOps, Norm, decode_ops, interleaved_angles, rotate
from backend.layers.row_cache import KVShape, RowCache, cache_slots
from backend.layers.step_layout import visibility
from backend.messages import Submit
from backend.model.decoder_runner import DecoderRunner
from backend.model.step_plan import FORWARD, LOOP
from backend.quant.quantize import quantize_model
from backend.quant.smoothed_int8 import quantize_smoothed, smoothed_int8_matmul
from tests.backend.models import MarkerTokenizer, drive, tiny_model
from tests.backend.test_compiled_decode import greedy, record_decode_steps, replay_decode_steps
from tests.conftest import ROOT

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def fused() -> FusedOps:
    built = kernels.extension()
    assert built is not None, "the C++ extension did not build: see the log for why"
    return FusedOps(built)


def tolerance(dtype: torch.dtype) -> dict:
    """One rounding of the output in bfloat16 (the reference rounds several times), float32's own else."""
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("centered", [False, True])  # Cohere's LayerNorms
def test_norms_and_silu_mul_match_pytorch(fused, dtype, rows, centered):
    generator = torch.Generator().manual_seed(rows)
    # rows whose mean is far from 0, which a LayerNorm takes away and an RMSNorm does not
    x, delta = (torch.randn(rows, 576, generator=generator).add(2.0).to(dtype) for _ in range(2))
    norm = Norm(torch.randn(576, generator=generator).to(dtype), 1e-5, centered)
    torch.testing.assert_close(fused.norm(x, norm), EAGER.norm(x, norm), **tolerance(dtype))

    expected_sum, expected_norm = EAGER.add_norm(x, delta, norm)
    hidden = x.clone()
    got_sum, got_norm = fused.add_norm(hidden, delta, norm)
    assert got_sum is hidden  # the sum is written in place, as the decode step relies on
    torch.testing.assert_close(got_sum, expected_sum, atol=0, rtol=0)  # one rounding in both
    torch.testing.assert_close(got_norm, expected_norm, **tolerance(dtype))
    hidden = x.clone()  # no norm there (OLMo 2's sublayers' inputs): the sum is what the next sublayer takes
    got_sum, got_norm = fused.add_norm(hidden, delta, None)
    assert got_sum is hidden and got_norm is hidden and torch.equal(got_sum, expected_sum)
    assert fused.norm(x, None) is x and EAGER.norm(x, None) is x

    gate_up = torch.randn(rows, 2 * 1536, generator=generator).to(dtype)
    torch.testing.assert_close(fused.silu_mul(gate_up), EAGER.silu_mul(gate_up), **tolerance(dtype))
    gate_up = gate_up * 4  # GELU's tanh reaches its ends: gates to about +-16
    torch.testing.assert_close(fused.gelu_tanh_mul(gate_up), EAGER.gelu_tanh_mul(gate_up), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_centered_norm_is_coheres_layer_norm_bit_for_bit(dtype):
    """EAGER's centered norm is Cohere's module's arithmetic: the same numbers, float32 or bfloat16."""
    module = CohereLayerNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).add(3.0).to(dtype)
    norm = Norm.of(module)
    assert norm.centered and norm.eps == 1e-5
    assert torch.equal(EAGER.norm(x, norm), module(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 32, 4, 128), (7, 4, 1, 256), (3, 2, 2, 20)])
def test_head_norms_norm_each_query_and_key_head_in_place(
    fused, dtype, whole, rows, heads, kv_heads, head_dim
):
    """Qwen3's and Gemma 3's norms of each query head and each key head (each kind its own weight and
    epsilon), or OLMo 2's of all the queries and all the keys (`whole`: weights as wide), in place in q, k
    and v side by side: PyTorch's norms of the heads' views to one rounding, the values untouched; shapes
    that are not q, k and v of those heads, and weights of part of a head, are refused."""
    generator = torch.Generator().manual_seed(rows)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(rows, width, generator=generator) * 3).to(dtype)
    query_width, key_width = (heads * head_dim, kv_heads * head_dim) if whole else (head_dim, head_dim)
    query = Norm(torch.randn(query_width, generator=generator).to(dtype), 1e-6)
    key = Norm(torch.randn(key_width, generator=generator).to(dtype), 0.5)  # an epsilon that shows
    original = qkv.clone()
    expected = EAGER.head_norms(original, query, key, heads, kv_heads)
    if whole:  # the reference itself: one norm of all the queries side by side, one of all the keys
        split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        parts = zip(expected.split(split, -1)[:2], original.split(split, -1)[:2], (query, key), strict=True)
        for normed, part, norm in parts:
            assert torch.equal(normed, torch.rms_norm(part, (part.shape[-1],), norm.weight, norm.eps))
    got = fused.head_norms(qkv, query, key, heads, kv_heads)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(got, expected, **tolerance(dtype))
    values = (heads + kv_heads) * head_dim
    assert torch.equal(got[:, values:], original[:, values:])
    if query_width == key_width:  # each kind's own weight and epsilon
        swapped = EAGER.head_norms(original, key, query, heads, kv_heads)
        assert not torch.allclose(got.float(), swapped.float(), atol=0.1)
    with pytest.raises(RuntimeError, match="qkv must be"):
        fused.head_norms(torch.zeros(rows, width + 1, dtype=dtype), query, key, heads, kv_heads)
    part = Norm(query.weight[: head_dim // 2], 1e-6)
    with pytest.raises(RuntimeError, match="each weight must be"):
        fused.head_norms(qkv, part, key, heads, kv_heads)


@pytest.mark.parametrize("shape", [(1, 4, 16, 8), (5, 24, 64, 128), (2, 3, 8, 20)])  # 20: a tail of 4
def test_a_mamba_2_state_update_advances_the_state_in_place_as_pytorch_does(fused, shape):
    """[rows, heads, head_dim, state_size]: the loop's one pass against EAGER's (transformers' update)."""
    rows, heads, head_dim, size = shape
    generator = torch.Generator().manual_seed(sum(shape))
    state = torch.randn(shape, generator=generator)
    x = torch.randn(rows, heads, head_dim, generator=generator)
    dt, decay = torch.rand(rows, heads, generator=generator), torch.rand(rows, heads, generator=generator)
    B, C = (torch.randn(rows, heads, size, generator=generator) for _ in range(2))
    D = torch.randn(heads, generator=generator)
    expected_state, got_state = state.clone(), state.clone()
    expected = EAGER.ssm_update(expected_state, x, dt, decay, B, C, D)
    got = fused.ssm_update(got_state, x, dt, decay, B, C, D)
    assert not torch.equal(expected_state, state)  # advanced in place
    torch.testing.assert_close(got_state, expected_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 2, 16, 8), (6, 16, 128, 128), (3, 4, 16, 20)])
def test_a_gated_deltanet_state_update_advances_the_state_in_place_as_transformers_does(fused, shape):
    """[rows, heads, key_dim, value_dim]: EAGER's update is transformers' recurrent rule bit for bit (exact
    mode's), the loop's two passes the same to float32's rounding, the states advanced in place."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from backend.model.gated_delta import for_update

    rows, heads, key_dim, value_dim = shape
    generator = torch.Generator().manual_seed(sum(shape))
    state = torch.randn(shape, generator=generator)
    query, key = (torch.randn(rows, heads // 2 or 1, key_dim, generator=generator) for _ in range(2))
    value = torch.randn(rows, heads, value_dim, generator=generator)
    decay = -torch.rand(rows, heads, generator=generator)  # its log, as the layer gives it
    beta = torch.rand(rows, heads, generator=generator)
    reference, last = torch_recurrent_gated_delta_rule(
        *(part[:, None] for part in (query, key, value, decay, beta)),
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    prepared = for_update(query, key, value, decay, beta)
    eager_state, fused_state = state.clone(), state.clone()
    torch.testing.assert_close(
        EAGER.gated_delta_update(eager_state, *prepared), reference[:, 0], atol=0, rtol=0
    )
    torch.testing.assert_close(eager_state, last, atol=0, rtol=0)
    got = fused.gated_delta_update(fused_state, *prepared)
    assert not torch.equal(fused_state, state)  # advanced in place
    torch.testing.assert_close(fused_state, last, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, reference[:, 0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel, bias", [(3, False), (7, True)], ids=["LFM2's", "LFM3's, a bias"])
def test_a_short_convolution_advances_only_its_rows_states_as_transformers_module_does(
    fused, dtype, kernel, bias
):
    """[rows, hidden, kernel]: three of five rows take a token each, in the order the queries give them.
    EAGER's outputs are transformers' LFM2 layer's decode update's (its `causal_conv1d_update`) bit for bit,
    the loop's the same to one rounding; both leave the other rows' states as they were."""
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_update

    hidden, generator = 96, torch.Generator().manual_seed(kernel)
    states = torch.randn(5, hidden, kernel, generator=generator).to(dtype)
    rows = torch.tensor([3, 0, 4])
    projected = torch.randn(3, 3 * hidden, generator=generator).to(dtype)
    weight = torch.randn(hidden, kernel, generator=generator).to(dtype)
    conv_bias = torch.randn(hidden, generator=generator).to(dtype) if bias else None
    b, c, x = projected.chunk(3, dim=-1)
    reference_states = states[rows].clone()
    reference = c * causal_conv1d_update((b * x)[:, :, None], reference_states, weight, conv_bias)[:, :, 0]
    for ops, exact in ((EAGER, True), (fused, False)):
        advanced = states.clone()
        got = ops.short_conv(advanced, projected, rows, weight, conv_bias)
        torch.testing.assert_close(got, reference, **({"atol": 0, "rtol": 0} if exact else tolerance(dtype)))
        torch.testing.assert_close(advanced[rows], reference_states, atol=0, rtol=0)  # (B * x: one rounding)
        assert torch.equal(advanced[[1, 2]], states[[1, 2]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("rotated", [64, 48], ids=["whole heads", "part of each head"])  # (Phi-4-mini's)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "neighbours"])  # (GLM's, ERNIE 4.5's)
def test_rotate_and_store_rotates_and_writes_only_its_slots(fused, dtype, cache_dtype, rotated, interleaved):
    """Queries and keys rotated as EAGER rotates them, each element paired with the one half the rotated
    width on, or with its neighbour; keys and values written to their slots and nowhere else."""
    heads, kv_heads, head_dim, rows, max_seq_len, queries = 9, 3, 64, 8, 32, 5
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(queries, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    cos, sin = (torch.randn(queries, 1, rotated, generator=generator).to(dtype) for _ in range(2))
    slots = cache_slots(torch.tensor([0, 2, 3, 6, 7]), torch.tensor([0, 5, 31, 2, 9]), kv_heads, max_seq_len)
    caches = {}
    for name, ops in (("eager", EAGER), ("fused", fused)):
        keys = torch.full((rows, kv_heads, max_seq_len, head_dim), 7.0, dtype=cache_dtype)
        values = keys.clone()
        query = ops.rotate_and_store(qkv, cos, sin, slots, keys, values, heads, kv_heads, interleaved)
        caches[name] = (query, keys, values)
    (query, keys, values), (expected_query, expected_keys, expected_values) = caches["fused"], caches["eager"]
    assert query.shape == (queries, heads, head_dim) and query.dtype == cache_dtype
    close = tolerance(torch.bfloat16 if torch.bfloat16 in (dtype, cache_dtype) else torch.float32)
    torch.testing.assert_close(query, expected_query, **close)
    torch.testing.assert_close(keys, expected_keys, **close)
    torch.testing.assert_close(values, expected_values, atol=0, rtol=0)  # copied, not computed
    untouched = torch.ones(keys.numel() // head_dim, dtype=torch.bool)
    untouched[slots] = False
    assert (keys.view(-1, head_dim)[untouched] == 7).all() and (
        values.view(-1, head_dim)[untouched] == 7
    ).all()


@pytest.mark.parametrize("rotated", [64, 32], ids=["whole heads", "half of each head"])
def test_the_rotation_of_neighbouring_pairs_is_transformers(rotated):
    """EAGER's interleaved rotation, given a rotary module's cos and sin repeated pair by pair
    (`interleaved_angles`), is transformers' GLM `apply_rotary_pos_emb` (ERNIE 4.5's and Helium's are the
    same over whole heads) bit for bit, and not the rotation of halves."""
    generator = torch.Generator().manual_seed(rotated)
    query, key = (torch.randn(1, 4, 3, 64, generator=generator) for _ in range(2))
    angles = torch.rand(1, 3, rotated // 2, generator=generator) * 40  # [batch, tokens, half]: as a module's
    cos, sin = torch.cat([angles, angles], dim=-1).cos(), torch.cat([angles, angles], dim=-1).sin()
    expected = glm_rotation(query, key, cos, sin)
    cos, sin = (interleaved_angles(t)[:, None] for t in (cos, sin))
    for got, want in zip((rotate(query, cos, sin, True), rotate(key, cos, sin, True)), expected, strict=True):
        assert torch.equal(got, want)
    assert not torch.allclose(rotate(query, cos, sin), expected[0], atol=0.1)


def test_rotate_and_store_refuses_a_slot_outside_the_cache(fused):
    keys = torch.zeros(2, 1, 4, 8)
    qkv, cos, sin = torch.zeros(1, 3 * 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.rotate_and_store(qkv, cos, sin, torch.tensor([8]), keys, keys.clone(), 1, 1)


def test_shapes_the_loops_cannot_take_are_refused_with_the_reason(fused):
    """An odd head size (the rotation pairs element t with t + head_dim / 2, and one was left unwritten),
    a head size of 0 and no KV heads (divisions by zero): a clear error."""
    for head_dim in (7, 0):
        keys = torch.zeros(2, 1, 4, head_dim)
        qkv, cos, sin = torch.zeros(1, 3 * head_dim), torch.zeros(1, 1, head_dim), torch.zeros(1, 1, head_dim)
        with pytest.raises(RuntimeError, match="head_dim must be even and positive"):
            fused.rotate_and_store(qkv, cos, sin, torch.tensor([0]), keys, keys.clone(), 1, 1)
    keys = torch.zeros(2, 1, 4, 8)
    for rotated in (10, 5):  # wider than a head, odd
        cos = sin = torch.zeros(1, 1, rotated)
        with pytest.raises(RuntimeError, match="width must be even, positive and at most head_dim"):
            fused.rotate_and_store(
                torch.zeros(1, 3 * 8), cos, sin, torch.tensor([0]), keys, keys.clone(), 1, 1
            )
    keys, cos, sin = torch.zeros(2, 1, 4, 64), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)
    no_slots = torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="heads and kv_heads must be positive"):
        fused.rotate_and_store(torch.zeros(1, 64), cos, sin, no_slots, keys, keys.clone(), 1, 0)
    no_kv_heads = torch.zeros(2, 0, 4, 64)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="at least one KV head"):
        fused.extension.decode_attention(
            torch.zeros(1, 2, 64), no_kv_heads, no_kv_heads, one, one, 0.125, 0, None, 0.0
        )


def test_silu_mul_and_gelu_tanh_mul_take_nan_and_infinities_as_pytorch_does(fused):
    """silu(NaN) and silu(-inf) are NaN (-inf * sigmoid(-inf)), silu(inf) inf, and so GELU's: the loop's
    exponential keeps NaN and infinities as they are instead of clamping them (and casting NaN to an
    integer)."""
    gate = torch.tensor([float("nan"), float("inf"), float("-inf"), 100.0, -100.0, 0.0, 1.5, -3.0])
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)])[None]
    torch.testing.assert_close(fused.silu_mul(gate_up), EAGER.silu_mul(gate_up), equal_nan=True)
    torch.testing.assert_close(fused.gelu_tanh_mul(gate_up), EAGER.gelu_tanh_mul(gate_up), equal_nan=True)


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [
        (9, 3, 64),
        (32, 32, 96),  # Phi-3-mini's heads
        (4, 1, 128),
        (4, 1, 256),
        (8, 8, 64),
        (32, 2, 64),
        (34, 2, 64),
        (6, 2, 80),
    ],  # last two: no loop
)
@pytest.mark.parametrize("window", [None, 1, 12])
def test_attention_reads_each_querys_own_row_up_to_its_position(
    fused, cache_dtype, heads, kv_heads, head_dim, window
):
    """Queries of scattered rows (a free row among them, out of order) over cached spans of different
    lengths: the eager batch over the span's rows with its mask gives the same, for each head size and
    query group the loop is compiled for, and with a sliding window each query's last `window` positions
    only; the others are refused, and a runner attends by PyTorch's."""
    max_seq_len = 48
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(6, kv_heads, max_seq_len, head_dim, generator=generator) for _ in range(2))
    keys, values = keys.to(cache_dtype), values.to(cache_dtype)
    rows, positions = torch.tensor([4, 0, 1, 5]), torch.tensor([40, 0, 17, 3])
    query = torch.randn(4, heads, head_dim, generator=generator).to(cache_dtype)
    row_positions = torch.zeros(6, dtype=torch.long).index_copy_(0, rows, positions)
    visible = visibility(row_positions, int(positions.max()) + 1, cache_dtype)
    if not fused.attention_supports(head_dim, heads // kv_heads):
        with pytest.raises(RuntimeError, match="no loop for head size"):
            fused.attend(query, keys, values, rows, positions, visible, 0.125)
        return
    expected = EAGER.attend(query, keys, values, rows, positions, visible, 0.125, scatter=True, window=window)
    got = fused.attend(query, keys, values, rows, positions, visible, 0.125, window=window)
    assert got.shape == expected.shape and got.dtype == cache_dtype
    torch.testing.assert_close(got, expected, **tolerance(cache_dtype))
    if window is not None:  # a window that hides positions gives other outputs than none
        assert not torch.allclose(got, fused.attend(query, keys, values, rows, positions, visible, 0.125))
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.attend(query, keys, values, rows, torch.tensor([40, 0, 48, 3]), visible, 0.125)


@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_attention_takes_every_query_group_the_loop_has(fused, cache_dtype):
    """Each group of 1 to 16 query heads a KV head is its own compiled loop (up to 8 heads at once; 9 to 16
    in two passes over the keys): spans long enough for whole tiles of 16 positions and a rest, each
    query the eager batch's numbers."""
    max_seq_len, head_dim, kv_heads = 80, 64, 2
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(3, kv_heads, max_seq_len, head_dim, generator=generator) for _ in range(2))
    keys, values = keys.to(cache_dtype), values.to(cache_dtype)
    rows, positions = torch.tensor([2, 0]), torch.tensor([70, 31])
    row_positions = torch.zeros(3, dtype=torch.long).index_copy_(0, rows, positions)
    visible = visibility(row_positions, int(positions.max()) + 1, cache_dtype)
    for group in range(1, 17):
        query = torch.randn(2, group * kv_heads, head_dim, generator=generator).to(cache_dtype)
        expected = EAGER.attend(query, keys, values, rows, positions, visible, 0.125, scatter=True)
        got = fused.attend(query, keys, values, rows, positions, visible, 0.125)
        torch.testing.assert_close(got, expected, **tolerance(cache_dtype), msg=f"a group of {group}")


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("heads, window", [(6, None), (6, 700), (24, None)])
def test_attention_over_a_long_span_joins_its_parts(fused, cache_dtype, heads, window):
    """A span of over 512 positions is attended in parts of 512, each its own task, then joined: spans of
    one part and one position over, of several with a short last part, a window across parts, and a
    group of 12 (two passes of heads, each in parts) give the eager batch's numbers, and a row alone
    the same numbers as beside the others."""
    generator = torch.Generator().manual_seed(2)
    keys, values, rows, positions, query, visible = long_spans(
        cache_dtype, heads, [1290, 511, 512, 1100, 40], generator
    )
    expected = EAGER.attend(query, keys, values, rows, positions, visible, 0.125, scatter=True, window=window)
    got = fused.attend(query, keys, values, rows, positions, visible, 0.125, window=window)
    torch.testing.assert_close(got, expected, **tolerance(cache_dtype))
    alone = fused.attend(query[:1], keys, values, rows[:1], positions[:1], visible, 0.125, window=window)
    assert torch.equal(alone, got[:1])  # a row's parts are its own: the same numbers beside other rows


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("heads, window", [(6, None), (6, 700), (24, None), (24, 8)])
def test_attention_sinks_take_their_share_in_the_loop_as_in_float64(fused, cache_dtype, heads, window):
    """gpt-oss's sinks, one logit a query head in the softmax's sum and not in its output: the loop's
    attention with them is attention in float64 with each head's sink beside its scores, over spans of one
    position, of one part and of several (the sink joined once, with the parts), with a window, and a
    group of 12 query heads (two passes, each its own heads' sinks); the eager path's too. Sinks large
    enough to take most of the attention change the output; sinks of -inf give the loop's numbers without
    sinks, to the bit."""
    generator = torch.Generator().manual_seed(5)
    keys, values, rows, positions, query, visible = long_spans(
        cache_dtype, heads, [1290, 0, 512, 1100, 40], generator
    )
    sinks = torch.randn(heads, generator=generator) * 3  # some heads' sinks above their scores, some below
    got = fused.attend(query, keys, values, rows, positions, visible, 0.125, window=window, sinks=sinks)
    expected = attention_in_float64(query, keys, values, rows, positions, 0.125, sinks, window)
    torch.testing.assert_close(got.double(), expected, **tolerance(cache_dtype))
    eager = EAGER.attend(
        query, keys, values, rows, positions, visible, 0.125, scatter=True, window=window, sinks=sinks
    )
    torch.testing.assert_close(eager.double(), expected, **tolerance(cache_dtype))
    without = fused.attend(query, keys, values, rows, positions, visible, 0.125, window=window)
    assert (got.float() - without.float()).abs().max() > 0.1
    no_share = torch.full((heads,), float("-inf"))
    assert torch.equal(
        fused.attend(query, keys, values, rows, positions, visible, 0.125, window=window, sinks=no_share),
        without,
    )
    for wrong in (sinks[:-1], sinks.double()):
        with pytest.raises(RuntimeError, match="sinks must be float32, one a query head"):
            fused.attend(query, keys, values, rows, positions, visible, 0.125, sinks=wrong)


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("heads, window", [(6, None), (24, 8)])
def test_soft_capped_scores_in_the_loop_are_the_eager_attentions(fused, cache_dtype, heads, window):
    """Gemma 2's cap of the scaled scores (cap * tanh(score / cap)) in the loop, over spans of one position,
    of one part and of several, with a window: the eager attention's numbers (transformers' matmuls), and
    other numbers than without a cap; a negative cap is refused."""
    generator = torch.Generator().manual_seed(6)
    keys, values, rows, positions, query, visible = long_spans(
        cache_dtype, heads, [1290, 0, 512, 1100, 40], generator
    )
    query = (query.float() * 4).to(cache_dtype)  # scores well past the cap
    got = fused.attend(query, keys, values, rows, positions, visible, 0.125, window=window, softcap=2.0)
    eager = EAGER.attend(
        query, keys, values, rows, positions, visible, 0.125, scatter=True, window=window, softcap=2.0
    )
    torch.testing.assert_close(got, eager, **tolerance(cache_dtype))
    without = fused.attend(query, keys, values, rows, positions, visible, 0.125, window=window)
    assert (got.float() - without.float()).abs().max() > 0.1
    with pytest.raises(RuntimeError, match="softcap must be 0"):
        fused.attend(query, keys, values, rows, positions, visible, 0.125, softcap=-1.0)


def long_spans(
    cache_dtype: torch.dtype, heads: int, positions: list[int], generator: torch.Generator
) -> tuple:
    """A cache of 5 rows of 1,300 positions of 2 KV heads of 64, one query a row (rows out of order) at
    `positions`, with `heads` query heads: (keys, values, rows, positions, query, visible)."""
    max_seq_len, head_dim, kv_heads = 1300, 64, 2
    keys, values = (torch.randn(5, kv_heads, max_seq_len, head_dim, generator=generator) for _ in range(2))
    keys, values = keys.to(cache_dtype), values.to(cache_dtype)
    rows, positions = torch.tensor([3, 0, 4, 1, 2]), torch.tensor(positions)
    query = torch.randn(5, heads, head_dim, generator=generator).to(cache_dtype)
    row_positions = torch.zeros(5, dtype=torch.long).index_copy_(0, rows, positions)
    visible = visibility(row_positions, int(positions.max()) + 1, cache_dtype)
    return keys, values, rows, positions, query, visible


def attention_in_float64(query, keys, values, rows, positions, scaling, sinks=None, window=None):
    """Each query over its own row up to its position (its last `window` of them), in float64, with each
    head's sink logit in the softmax where there are sinks: [queries, heads, head_dim]."""
    group = query.shape[1] // keys.shape[1]
    out = []
    for i, (row, position) in enumerate(zip(rows.tolist(), positions.tolist(), strict=True)):
        start = 0 if window is None else max(0, position + 1 - window)
        k = keys[row, :, start : position + 1].double().repeat_interleave(group, dim=0)  # [heads, span, dim]
        v = values[row, :, start : position + 1].double().repeat_interleave(group, dim=0)
        scores = (k @ query[i].double()[:, :, None])[..., 0] * scaling
        if sinks is None:
            weights = scores.softmax(dim=-1)
        else:
            weights = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(dim=-1)[:, :-1]
        out.append((weights[:, None] @ v)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    "head_dim, kv_heads, group", [(64, 3, 3), (64, 1, 8), (128, 2, 4), (256, 1, 12), (64, 2, 1)]
)
def test_bfloat16_scores_by_dot_products_are_the_float_loops_to_its_rounding(
    fused, head_dim, kv_heads, group
):
    """Where the CPU has AVX-512 BF16, a bfloat16 cache's scores are dot products of the stored values
    (`attention_by_dots`): spans of one position, of a tile of 16 and one more, of tiles and a rest, and
    in parts, each head of the group, agree with attention in float64 as closely as the loop in float
    does (to the output's bfloat16 rounding), at a scaling that is not a power of two. Elsewhere the two
    are one loop."""
    extension = fused.extension
    generator = torch.Generator().manual_seed(3)
    keys, values = (
        torch.randn(3, kv_heads, 1100, head_dim, generator=generator).bfloat16() for _ in range(2)
    )
    rows, positions = torch.tensor([2, 0, 1, 2, 1]), torch.tensor([0, 16, 37, 300, 1090])
    query = torch.randn(5, group * kv_heads, head_dim, generator=generator).bfloat16()
    scaling = head_dim**-0.5 * 1.3
    by_dots = extension.decode_attention(query, keys, values, rows, positions, scaling, 0, None, 0.0)
    in_float = extension.decode_attention_in_float(
        query, keys, values, rows, positions, scaling, 0, None, 0.0
    )
    if not extension.attention_by_dots():
        assert torch.equal(by_dots, in_float)
    expected = attention_in_float64(query, keys, values, rows, positions, scaling)
    for got in (by_dots, in_float):
        torch.testing.assert_close(got.double(), expected, atol=4e-3, rtol=8e-3)


def test_a_nan_key_makes_its_own_heads_nan_by_dot_products_as_in_float(fused):
    """A NaN among a row's keys: the heads of its KV head, in each query of that row whose span holds it,
    come out NaN by dot products as in float (a tile's and a rest's position), and nothing else does."""
    extension = fused.extension
    generator = torch.Generator().manual_seed(4)
    keys, values = (torch.randn(2, 2, 64, 64, generator=generator).bfloat16() for _ in range(2))
    keys[1, 0, 5, 17] = float("nan")
    keys[1, 1, 40, 3] = float("nan")
    rows, positions = torch.tensor([1, 0, 1, 1]), torch.tensor([20, 60, 4, 45])
    query = torch.randn(4, 6, 64, generator=generator).bfloat16()
    expected = torch.zeros(4, 6, dtype=torch.bool)
    # row 1's queries that reach position 5 (a tile's): KV head 0's heads
    expected[0, :3] = expected[3, :3] = True
    expected[3, 3:] = True  # and position 40 (past the last whole tile), KV head 1's
    for attend in (extension.decode_attention, extension.decode_attention_in_float):
        got = attend(query, keys, values, rows, positions, 0.125, 0, None, 0.0)
        assert torch.equal(got.isnan().any(dim=-1), expected)
        assert torch.equal(got.isnan().all(dim=-1), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_smoothed_int8_path_gives_the_same_numbers_fused(fused, dtype, monkeypatch):
    """Rounding to int8 and scaling back are the same float32 operations in either form: equal."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 576, generator=generator).to(dtype)
    smoothing = torch.rand(576, generator=generator) + 0.5
    weight_int8, scales = quantize_smoothed(torch.randn(1536, 576, generator=generator) / 20, smoothing)
    with_loops = smoothed_int8_matmul(x, weight_int8, scales, smoothing, dtype)
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_unavailable", "switched off by the test")
    assert kernels.extension() is None
    without = smoothed_int8_matmul(x, weight_int8, scales, smoothing, dtype)
    assert with_loops.dtype == without.dtype == dtype
    torch.testing.assert_close(with_loops, without, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_are_rounded_to_int8_the_same_fused(fused, dtype, monkeypatch):
    """quantize_smoothed rounds a layer's channels by the loop that rounds activation rows: the same int8
    weights and scales as its PyTorch operations, a channel of zeros included."""
    generator = torch.Generator().manual_seed(1)
    dense = (torch.randn(96, 576, generator=generator) / 20).to(dtype)
    dense[5] = 0
    smoothing = torch.rand(576, generator=generator) + 0.5
    with_loop = quantize_smoothed(dense, smoothing)
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_unavailable", "switched off by the test")
    without = quantize_smoothed(dense, smoothing)
    for got, expected in zip(with_loop, without, strict=True):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    weight_int8, scales = without
    assert weight_int8.abs().amax(dim=1)[[0, 1, 95]].eq(127).all()  # each channel's largest at the end
    assert (weight_int8[5] == 0).all() and scales[5] > 0


def test_smoothed_int8_rows_with_a_nan_give_nan_fused_as_in_pytorch(fused, monkeypatch):
    """A NaN activation: PyTorch's largest magnitude is NaN, and so the row's scale and products; the loop's
    maximum skipped it and cast NaN to an integer. Now its row is NaN too, the other rows untouched."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=generator)
    smoothing = torch.rand(64, generator=generator) + 0.5
    weight_int8, scales = quantize_smoothed(torch.randn(48, 64, generator=generator) / 20, smoothing)
    clean = smoothed_int8_matmul(x, weight_int8, scales, smoothing)
    x[1, 37] = float("nan")
    with_loops = smoothed_int8_matmul(x, weight_int8, scales, smoothing)
    assert with_loops[1].isnan().all()
    torch.testing.assert_close(with_loops[[0, 2, 3]], clean[[0, 2, 3]], atol=0, rtol=0)
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_unavailable", "switched off by the test")
    assert smoothed_int8_matmul(x, weight_int8, scales, smoothing)[1].isnan().all()


def test_the_loops_serve_quantized_cpu_models_only(fused, monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(decode_ops(cpu, exact=False, compiled=False), FusedOps)
    assert decode_ops(cpu, exact=True, compiled=False) is EAGER  # transformers' arithmetic, bit for bit
    assert decode_ops(cpu, exact=False, compiled=True) is EAGER  # the compiler fuses them itself
    assert decode_ops(torch.device("meta"), exact=False, compiled=False) is EAGER

    exact = tiny_model("llama")
    assert DecoderRunner(exact).ops is EAGER
    quantize_model(exact, "int4")
    assert isinstance(DecoderRunner(exact).ops, FusedOps)

    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_unavailable", None)
    monkeypatch.setenv(kernels.DISABLE_VARIABLE, "0")
    assert decode_ops(cpu, exact=False, compiled=False) is EAGER


def test_without_a_compiler_the_server_runs_on_pytorchs_operations(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension 'fused_cpu_ops'\nc++: command not found")

    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_unavailable", None)
    monkeypatch.setattr(kernels, "build", no_compiler)
    model = tiny_model("llama")
    quantize_model(model, "int4")
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=32)
    assert engine.runner.decoder.ops is EAGER
    assert "fused CPU operations unavailable (RuntimeError: c++: command not found)" in caplog.text
    pieces = drive(engine, [(0, Submit("a", (5, 6, 7), greedy(4)))])
    assert pieces["a"][-1].finished and sum(p.completion_tokens for p in pieces["a"] if p.finished) == 4


def drive_mixed_decode_steps(engine: Engine) -> None:
    """Requests whose decode steps have one row, rows with a free one among them, then 17 more rows."""
    many = [(12, Submit(f"many-{i}", (20 + i, 21, 22), greedy(3))) for i in range(17)]
    drive(
        engine,
        [
            (0, Submit("a", (5, 6, 7), greedy(6))),
            (0, Submit("b", (8, 9), greedy(2))),
            (0, Submit("c", (10, 11, 12, 13), greedy(9))),
            *many,
        ],
    )


@pytest.mark.parametrize("dtype, architecture", [(d, "llama") for d in DTYPES] + [(torch.bfloat16, "qwen3")])
def test_decode_steps_with_the_loops_give_pytorchs_logits_and_cache_writes(fused, dtype, architecture):
    """Every decode step of an engine on PyTorch's operations, replayed through a runner on the loops
    from the same cache: the same logits and keys and values, to the tolerance of the dtype, for one
    row, rows with a free one among them, and a step of many rows (the loops serve all of them).
    Qwen3's heads are normed before the loops rotate them."""
    model = tiny_model(architecture, head_dim=64).to(dtype)  # a head size the attention loop is compiled for
    quantize_model(model, "int4")
    engine = Engine(model, MarkerTokenizer(), rows=20, max_seq_len=64, speculative_tokens=0)  # a token a row
    engine.runner.decoder.use_ops(EAGER)  # as before the loops
    # The reference is PyTorch's operations at every step shape, not decode_layers.cpp below 16 rows.
    assert {path.layers for path in engine.runner.plan.decode} <= {LOOP, FORWARD}
    steps = record_decode_steps(engine)
    drive_mixed_decode_steps(engine)
    shapes = {layout.decode_queries for _, _, layout, *_ in steps}
    assert {1, 2, 3} <= shapes and max(shapes) >= 17
    assert any(layout.has_free_rows for _, _, layout, *_ in steps)

    runner = DecoderRunner(model)
    assert isinstance(runner.ops, FusedOps)
    cache = RowCache(
        KVShape.of(model.config), 20, 64, engine.runner.cache_dtype, engine.device, spare_rows=1
    )  # as the engine\'s: its embedding row too
    close = tolerance(dtype)["atol"]
    # Qwen3's keys are normed per head, elements of 1 to 3 where the tiny Llama's are about 0.1: PyTorch's
    # operations round each intermediate of the rotation to bfloat16 (the loops do not), an error that
    # grows with them (0.04 measured).
    cached = close * (4 if architecture == "qwen3" else 1)
    replay_decode_steps(runner, cache, steps, logits_tolerance=close, cache_tolerance=cached)


def test_steps_with_prompts_and_long_rows_attend_by_the_loops(fused, monkeypatch):
    """Steps that prefill while rows decode, and a long row among short ones (PyTorch's batch over the
    span reads it apart, step_layout.long_rows): with the loops each decode query reads its own row
    up to its own position in those steps too, no row goes apart, and every step's logits are the
    ones PyTorch's operations give."""
    monkeypatch.setattr(step_layout, "LONG_ROW_SAVES_POSITIONS", 8)  # a long row at this size
    model = tiny_model("llama", head_dim=64)  # a head size the attention loop is compiled for
    quantize_model(model, "int4")

    def steps(engine: Engine) -> list[tuple]:
        """(layout, logits) of each forward pass, serving the same requests at the same steps (a fixed
        prefill budget: the same plan of steps in both)."""
        taken, forward = [], engine._forward

        def recording(inputs):
            taken.append((inputs.layout, forward(inputs)))
            return taken[-1][1]

        engine._forward = recording
        arrivals = [
            (0, Submit("long", tuple(range(5, 125)), greedy(12))),
            (1, Submit("a", (5, 6, 7), greedy(10))),
            (3, Submit("b", (8, 9), greedy(8))),
            (5, Submit("c", tuple(range(20, 60)), greedy(6))),
        ]
        drive(engine, arrivals)
        return taken

    # No drafts (speculation.py): the two engines must run the same steps, a token a row.
    with_loops = Engine(
        model, MarkerTokenizer(), rows=4, max_seq_len=256, max_prefill_tokens=512, speculative_tokens=0
    )
    assert with_loops.runner.reads_own_positions
    # Short prompts as chunks, as they go where a step has no room for them as decode queries
    # (test_prompt_queries.py has them as queries).
    with_loops._prompts_as_queries = lambda prefilling, queries: 0
    without = Engine(
        model, MarkerTokenizer(), rows=4, max_seq_len=256, max_prefill_tokens=512, speculative_tokens=0
    )
    without.runner.decoder.use_ops(EAGER)  # as before the loops
    assert not without.runner.reads_own_positions

    expected, got = steps(without), steps(with_loops)
    assert len(got) == len(expected)
    for (_, expected_logits), (_, logits) in zip(expected, got, strict=True):
        torch.testing.assert_close(logits, expected_logits, **tolerance(torch.float32))
    assert any(layout.long_rows for layout, _ in expected)
    assert not any(layout.long_rows for layout, _ in got)
    # Short new prompts ("a", "b") attend by the loop with the decode queries; long ones by PyTorch's kernel.
    chunks = [(layout, chunk) for layout, _ in got for chunk in layout.prompts]
    assert {chunk.length for layout, chunk in chunks if layout.loop_takes(chunk)} == {3, 2}
    assert any(layout.by_position[0].shape[0] > layout.decode_queries for layout, _ in got)
    assert sum(bool(layout.prompts and layout.decode_queries) for layout, _ in got) >= 3


def test_a_start_gets_past_a_lock_a_killed_build_left(fused, tmp_path):
    """The extension's directory (built by the fixture: a fresh machine's first build is that) holding the
    lock file of a build killed a moment ago: a start, in a process of its own as a server's is, finds
    no build running (no process holds `build_lock`), clears it and loads the extension instead of
    waiting for ever. The directory is a copy in extensions' root of its own (TORCH_EXTENSIONS_DIR): in
    the shared one, a server another worker started at that moment cleared the lock first, and said so
    in its own log. (In an empty directory this test built everything again: half a minute.)"""
    built = kernels.build_directory()
    directory = tmp_path / built.name
    shutil.copytree(built, directory, ignore=shutil.ignore_patterns("lock", "build.flock"))
    lock = directory / "lock"
    lock.touch()
    script = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "from backend.kernels import extension as kernels\nfrom backend.layers import decode_ops\n"
        "x = torch.randn(3, 64)\n"
        "norm = decode_ops.Norm(torch.ones(64), 1e-5)\n"
        "built = kernels.extension()\n"
        "assert built is not None\n"
        "fused, eager = decode_ops.FusedOps(built).norm(x, norm), decode_ops.EAGER.norm(x, norm)\n"
        "torch.testing.assert_close(fused, eager)\n"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr
    assert f"removing {lock}, left by a build that did not finish" in result.stderr
    assert "fused CPU operations ready in" in result.stderr
    assert not lock.exists() and list(directory.glob("*.so"))


def test_two_checkouts_build_in_directories_of_their_own(tmp_path):
    """PyTorch writes a build's absolute paths into its build.ninja: two checkouts of the same sources
    sharing one directory rebuilt it at every start, each in turn. Same sources elsewhere, another
    directory; the same checkout, the same one."""
    copies = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        for source in kernels.SOURCES + kernels.HEADERS:
            shutil.copy(source, tmp_path / name / source.name)
        copies.append([tmp_path / name / source.name for source in kernels.SOURCES])
    directories = {kernels.build_directory(), *(kernels.build_directory(copy) for copy in copies)}
    assert len(directories) == 3
    assert kernels.build_directory() == kernels.build_directory(list(kernels.SOURCES))


def hold_build_lock(directory: Path) -> subprocess.Popen:
    """Another process holding the build lock, as a start in the middle of its build does."""
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom backend.kernels import extension as kernels\n"
        "with kernels.build_lock(Path(sys.argv[1])):\n    print('holding', flush=True)\n    time.sleep(300)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(directory)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_start_waits_for_a_build_in_progress_saying_so_and_not_for_one_that_died(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=kernels.__name__)
    holder = hold_build_lock(tmp_path)
    try:
        started = time.monotonic()
        waiting = kernels.build_lock(tmp_path, wait_seconds=1.0)
        with pytest.raises(TimeoutError, match="another process has been building"), waiting:
            pass
        assert time.monotonic() - started >= 1.0
        assert "s for another process's build of the fused CPU operations" in caplog.text
    finally:
        holder.kill()  # SIGKILL: no chance to let go of anything itself
        holder.wait()
    started = time.monotonic()
    with kernels.build_lock(tmp_path, wait_seconds=30.0):
        assert time.monotonic() - started < 5  # the kernel let go of the dead holder's lock


def test_a_build_held_past_the_wait_leaves_the_server_on_pytorchs_operations(fused, monkeypatch, caplog):
    holder = hold_build_lock(kernels.build_directory())
    try:
        monkeypatch.setattr(kernels, "_extension", None)
        monkeypatch.setattr(kernels, "_unavailable", None)
        monkeypatch.setattr(kernels, "BUILD_WAIT_SECONDS", 0.5)
        assert kernels.extension() is None
        assert "unavailable (TimeoutError: another process has been building" in caplog.text
    finally:
        holder.kill()
        holder.wait()


def test_warm_up_loads_the_extension_even_where_only_sampling_uses_it(fused, monkeypatch):
    """In the exact mode decode steps run PyTorch's operations, and only the nucleus sampler's loop is
    the extension's: warm-up samples a nucleus, so that its first load (or, on a new machine, its
    build: half a minute) happens before the server is ready, not inside a step every row waits on."""
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_unavailable", None)
    engine = Engine(tiny_model("llama"), MarkerTokenizer(), rows=2, max_seq_len=32)
    assert engine.runner.decoder.ops is EAGER and kernels._extension is None
    engine.warm_up()
    assert kernels._extension is not None

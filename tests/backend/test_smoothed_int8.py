"""The int8 path for many rows: int8 activations times int8 weights, smoothed and calibrated at load time."""

import weakref

import pytest
import torch

from backend.messages import BackendConfig
from backend.model import loader
from backend.model.loader import load_model
from backend.quant import block_weights, calibration
from backend.quant.blocks_embedding import BlocksEmbedding
from backend.quant.calibration import int8_multiplies_faster, smooth_many_rows_path  # the real one, kept
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import DENSE_FROM_ROWS, Int4Linear, fuse_linears
from backend.quant.smoothed_int8 import quantize_smoothed, smoothed_int8_matmul, smoothing_factors
from tests.backend.models import tiny_model


@pytest.fixture(autouse=True)
def int8_is_faster(monkeypatch):
    """These tests are about the int8 path itself, so they take it whatever this CPU's speeds; the
    choice by speed has tests of its own (they call the function imported above)."""
    monkeypatch.setattr(calibration, "int8_multiplies_faster", lambda layer: True)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def test_smoothing_moves_an_outlier_channel_into_the_weights():
    """One input channel 50 times larger than the rest sets every row's int8 scale; smoothed, it does not."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=generator) / 10
    x = torch.randn(32, 128, generator=generator)
    x[:, 5] *= 50
    expected = x @ weight.T
    smoothing = smoothing_factors(x.abs().amax(dim=0), weight.abs().amax(dim=0))
    plain = torch.ones(128)
    smoothed_error = relative_error(
        smoothed_int8_matmul(x, *quantize_smoothed(weight, smoothing), smoothing), expected
    )
    plain_error = relative_error(smoothed_int8_matmul(x, *quantize_smoothed(weight, plain), plain), expected)
    assert smoothed_error < 0.02
    assert smoothed_error < plain_error / 2


def calibrated_tiny_model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny Llama with int4 projections, calibrated; with an input of many rows and its logits before."""
    model = tiny_model("llama")
    quantize_model(model, "int4")
    x = torch.randint(2, 500, (1, 2 * DENSE_FROM_ROWS))
    before = model(x).logits
    token_ids = torch.randint(2, 500, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    assert smooth_many_rows_path(model, token_ids) == 2 * 7  # random weights: no outliers to refuse
    return model, x, before


def test_calibration_holds_a_groups_int8_weights_at_a_time(monkeypatch):
    """Each group of layers is settled as the calibration pass reaches its last layer: the int8 weights
    made and not yet given to a layer are never more than a group's. Made for every layer before the
    pass, they were a byte a parameter beside the dense copies, a 1B's load at its peak."""
    model = tiny_model("llama")
    quantize_model(model, "int4")
    made, most_pending, quantize = [], [0], calibration.quantize_smoothed

    def quantize_counting(dense: torch.Tensor, smoothing: torch.Tensor):
        served = {
            id(layer.dense_int8)
            for layer in model.modules()
            if getattr(layer, "dense_int8", None) is not None
        }
        pending = [weight for ref in made if (weight := ref()) is not None and id(weight) not in served]
        most_pending[0] = max(most_pending[0], len(pending))
        weight_int8, scales = quantize(dense, smoothing)
        made.append(weakref.ref(weight_int8))
        return weight_int8, scales

    monkeypatch.setattr(calibration, "quantize_smoothed", quantize_counting)
    token_ids = torch.randint(2, 500, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    assert smooth_many_rows_path(model, token_ids) == 2 * 7
    assert len(made) == 2 * 7 and most_pending[0] == 2  # q and k made, v next; gate made, up next


def test_calibration_gives_layers_that_read_one_input_one_smoothing():
    model, x, before = calibrated_tiny_model()
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert attention.q_proj.smoothing is attention.k_proj.smoothing is attention.v_proj.smoothing
    assert mlp.gate_proj.smoothing is mlp.up_proj.smoothing
    assert not torch.equal(attention.q_proj.smoothing, mlp.gate_proj.smoothing)  # other inputs, other ranges
    assert attention.o_proj.smoothing is not attention.q_proj.smoothing
    assert all(module.dense is None for module in model.modules() if type(module) is Int4Linear)
    assert relative_error(model(x).logits, before) < 0.05


def test_smoothed_layers_still_fuse_and_multiply_as_their_parts():
    model, _, _ = calibrated_tiny_model()
    mlp = model.model.layers[1].mlp
    parts = [mlp.gate_proj, mlp.up_proj]  # (the tiny k and v are too narrow for the packed layout)
    x = torch.randn(DENSE_FROM_ROWS, parts[0].in_features)
    separately = torch.cat([part(x) for part in parts], dim=-1)
    fused = fuse_linears(parts)
    assert fused is not None and fused.dense_int8 is not None
    torch.testing.assert_close(fused(x), separately)


def test_layers_with_other_smoothings_are_not_fused():
    model, _, _ = calibrated_tiny_model()
    attention = model.model.layers[0].self_attn
    assert fuse_linears([attention.q_proj, attention.o_proj]) is None  # same width, other smoothings


def test_a_layer_int8_would_move_too_far_keeps_its_dense_copy(monkeypatch):
    monkeypatch.setattr(calibration, "MAX_ERROR", 0.0)
    model = tiny_model("llama")
    quantize_model(model, "int4")
    assert smooth_many_rows_path(model, list(range(2, 66))) == 0
    assert all(module.dense is not None for module in model.modules() if type(module) is Int4Linear)


def test_a_cpu_faster_in_bfloat16_keeps_the_dense_copies(monkeypatch):
    monkeypatch.setattr(calibration, "int8_multiplies_faster", lambda layer: False)
    model = tiny_model("llama")
    quantize_model(model, "int4")
    assert smooth_many_rows_path(model, list(range(2, 66))) == 0
    layers = [module for module in model.modules() if type(module) is Int4Linear]
    assert all(layer.dense is not None and layer.dense_int8 is None for layer in layers)


@pytest.mark.parametrize(("min_speedup", "expected"), [(1e-3, True), (1e3, False)])
def test_int8_goes_in_only_when_timed_faster(monkeypatch, min_speedup, expected):
    """Neither path is a thousand times faster than the other, so the timing decides both ways."""
    monkeypatch.setattr(calibration, "MIN_SPEEDUP", min_speedup)
    layer = Int4Linear.quantize(torch.nn.Linear(128, 256, bias=False))
    assert int8_multiplies_faster(layer) is expected


def test_the_default_model_multiplies_many_rows_in_int8_but_its_head(monkeypatch):
    # Where the projections are in blocks, their copies go if they do not pay (test_many_rows_copies.py).
    monkeypatch.setattr(calibration, "copies_pay_off", lambda layer, paths: True)
    # The calibration text's first 128 tokens, not its 570: without VNNI, int8 products run 20x slower
    # than float32's, and the whole text took 70 s of this suite on an AVX2 CPU.
    whole_text = loader.calibration_token_ids
    monkeypatch.setattr(loader, "calibration_token_ids", lambda tokenizer: whole_text(tokenizer)[:128])
    model = load_model(BackendConfig(rows=1, max_seq_len=64)).model
    projections = [module for module in model.modules() if type(module) is Int4Linear]
    smoothed = [module for module in projections if module.dense_int8 is not None]
    assert len(projections) == 30 * 7
    assert len(smoothed) >= 30 * 4  # q, k, v and o or gate and up in every layer, or near it
    assert all(module.dense is None for module in smoothed)
    assert model.lm_head.dense_int8 is None
    if block_weights.available(torch.device("cpu")):  # its blocks hold the embedding tied to it: no floats
        assert model.lm_head.dense is None and isinstance(model.get_input_embeddings(), BlocksEmbedding)
        return
    assert model.lm_head.dense is not None
    assert model.lm_head.dense_from_rows in calibration.HEAD_TIMED_ROWS  # timed at load


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_int8_path_keeps_the_activations_dtype(dtype):
    layer = Int4Linear.quantize(torch.nn.Linear(64, 32, bias=False))
    smoothing = torch.ones(64)
    layer.use_smoothed_int8(*quantize_smoothed(layer.dense, smoothing), smoothing)
    x = torch.randn(DENSE_FROM_ROWS, 64, dtype=getattr(torch, dtype))
    assert layer(x).dtype == x.dtype

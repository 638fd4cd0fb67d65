"""Beside blocks, the quantized projections' copies for many rows go unless they pay (calibration.py)."""

import time

import pytest
import torch

from backend.quant import block_weights, calibration
from backend.quant.calibration import copies_pay_off, drop_copies_blocks_match
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import BlocksLinear, Int4Linear, Int8Linear
from backend.quant.smoothed_int8 import quantize_smoothed
from tests.backend.models import tiny_model


@pytest.mark.parametrize("pays", ["none", "down", "all"])
def test_projections_in_blocks_drop_their_copies_unless_a_copy_pays(monkeypatch, weight_layout, pays):
    """Decided for each kind of projection, timed once on its largest: q, k, v and o; gate and up; down.
    Where the copies go, every number of rows is multiplied in blocks; the head keeps its copy; a layout
    without blocks (PyTorch's kernels, slow for many rows) keeps every copy."""
    timed = []

    def copies_pay(layer, paths):
        assert paths == ("dense", "int8")
        timed.append(layer)
        return pays == "all" or (pays == "down" and layer is model.model.layers[0].mlp.down_proj)

    monkeypatch.setattr(calibration, "copies_pay_off", copies_pay)
    model = tiny_model("llama")  # 2 layers; q and o 64 x 64, k and v 32 x 64, gate and up 128 x 64
    quantize_model(model, "int4")
    x = torch.randint(2, 500, (1, 40))  # more rows than any crossover: the path for many rows
    before = model(x).logits
    layers = model.model.layers
    projections = [module for module in model.modules() if type(module) is Int4Linear]
    keeps = (
        {
            "none": [],
            "down": [layer.mlp.down_proj for layer in layers],
            "all": projections,
        }[pays]
        if weight_layout == "blocks"
        else projections
    )
    dropped = drop_copies_blocks_match(model)
    assert dropped == len(projections) - len(keeps)
    assert all((layer.dense is not None) == any(layer is kept for kept in keeps) for layer in projections)
    if weight_layout == "blocks":  # the largest of each kind, the first layer's where sizes tie
        first = layers[0]
        assert timed == [first.self_attn.q_proj, first.mlp.gate_proj, first.mlp.down_proj]
    else:
        assert timed == []
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.dense is not None
    if dropped:
        layer = layers[0].self_attn.q_proj
        rows = torch.randn(40, layer.in_features)
        packed = layer.packed_matmul(rows.to(layer.compute_dtype)).float()
        assert torch.equal(layer(rows), packed)
        after = model(x).logits
        assert (after - before).abs().max() < 0.05 * before.abs().max()  # blocks round activations to int8


@pytest.mark.parametrize(("min_speedup", "expected"), [(1e-3, True), (1e3, False)])
def test_a_copy_is_kept_only_when_timed_faster_than_the_blocks(
    monkeypatch, weight_layout, min_speedup, expected
):
    """Neither is a thousand times faster than the other, so the timing decides both ways."""
    monkeypatch.setattr(calibration, "COPY_MIN_SPEEDUP", min_speedup)
    layer = Int4Linear.quantize(torch.nn.Linear(128, 256, bias=False))
    assert copies_pay_off(layer, rows=64) is expected


def test_a_copy_whose_first_call_shows_it_cannot_pay_is_not_timed_again(monkeypatch, weight_layout):
    """As int8 products are without VNNI (20x slower than float32's): its one call is all it costs."""
    real, int8_calls = calibration.smoothed_int8_matmul, []

    def slow_int8(*args):
        int8_calls.append(None)
        time.sleep(0.2)  # far more than the blocks take for 64 rows of 128 inputs
        return real(*args)

    monkeypatch.setattr(calibration, "smoothed_int8_matmul", slow_int8)
    layer = Int4Linear.quantize(torch.nn.Linear(128, 256, bias=False))
    copies_pay_off(layer, rows=64)  # the float32 copy still timed against the blocks, either way
    assert len(int8_calls) == 1
    # Where even a copy a million times slower than the blocks would pay, the slow one is timed (at 1e-3,
    # 0.2 s a call was hopeless beside blocks whose first call took under 50 us).
    monkeypatch.setattr(calibration, "COPY_MIN_SPEEDUP", 1e-6)
    assert copies_pay_off(layer, rows=64, paths=("int8",)) is True and len(int8_calls) > 2


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="no blocks on this CPU")
@pytest.mark.parametrize("lean", [False, True])
def test_a_large_projection_is_timed_on_its_first_outputs(monkeypatch, lean):
    """Both paths take time in proportion to the outputs at a prompt chunk's rows, so a layer of more
    than COPY_TIMED_WEIGHTS weights is timed on its first outputs: the same weights, the copy made from
    the blocks where a lean load left it to be made on demand."""
    monkeypatch.setattr(calibration, "COPY_TIMED_WEIGHTS", 64 * 128)
    layer = Int4Linear.quantize(torch.nn.Linear(128, 256, bias=False))
    if lean:
        layer.make_dense_on_demand(torch.float32)
    whole = layer.dense_weight().clone()  # lean: made from the blocks
    part = calibration.timed_part(layer)
    assert (part.out_features, part.in_features) == (64, 128)
    assert torch.equal(part.dense_weight(), whole[:64])
    rows = torch.randn(8, 128)
    assert torch.equal(part(rows), layer(rows)[:, :64])  # the blocks' products
    small = Int4Linear.quantize(torch.nn.Linear(64, 128, bias=False))  # 128 x 64: at the limit, whole
    assert calibration.timed_part(small) is small
    real, timed_shapes = calibration.smoothed_int8_matmul, []

    def int8_matmul(x, weights, *rest):
        timed_shapes.append(tuple(weights.shape))
        return real(x, weights, *rest)

    monkeypatch.setattr(calibration, "smoothed_int8_matmul", int8_matmul)
    copies_pay_off(layer, rows=64)
    assert timed_shapes and set(timed_shapes) == {(64, 128)}


def test_copies_that_int8_would_move_too_far_go_unless_they_pay_as_themselves(monkeypatch, weight_layout):
    """After the int8 path replaced the copies it could, those left (int8 moved their outputs too far) are
    timed as bfloat16 copies alone: without AMX slower than the blocks, they go."""
    timed = []

    def dense_pays(layer, paths):
        timed.append(paths)
        return False

    monkeypatch.setattr(calibration, "copies_pay_off", dense_pays)
    model = tiny_model("llama")
    quantize_model(model, "int4")
    gate = model.model.layers[0].mlp.gate_proj
    smoothing = torch.ones(gate.in_features)
    gate.use_smoothed_int8(*quantize_smoothed(gate.dense, smoothing), smoothing)  # as smooth_many_rows_path
    dropped = drop_copies_blocks_match(model, paths=("dense",))
    projections = [module for module in model.modules() if type(module) is Int4Linear]
    if weight_layout != "blocks":
        assert dropped == 0 and timed == []
        return
    assert timed and all(paths == ("dense",) for paths in timed)
    assert dropped == len(projections) - 1
    assert gate.dense_int8 is not None and gate.has_many_rows_path  # its int8 path stays
    assert all(layer.dense is None for layer in projections)


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="no 6-bit blocks on this CPU")
def test_six_bit_projections_decide_apart_from_four_bit_ones(monkeypatch):
    """A Q4_K_M file's Q6_K down projections sit beside its Q4_K ones and are slower in blocks: timed as a
    kind of their own, their copies stay where the 4-bit ones' go."""
    model = tiny_model("llama")
    quantize_model(model, "int4")
    second = model.model.layers[1].mlp
    down = second.down_proj
    q = torch.randint(0, 64, (down.out_features, down.in_features))
    scale = torch.full((down.out_features, down.in_features // 32), 0.001)
    sub_scale = torch.ones(down.out_features, down.in_features // 16, dtype=torch.int8)
    second.down_proj = BlocksLinear.int6(q, sub_scale, scale)
    monkeypatch.setattr(calibration, "copies_pay_off", lambda layer, paths: layer.bits == 6)
    drop_copies_blocks_match(model)
    assert second.down_proj.dense is not None
    assert model.model.layers[0].mlp.down_proj.dense is None

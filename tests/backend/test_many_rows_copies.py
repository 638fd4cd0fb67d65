"""Beside blocks, the quantized projections' copies for many rows go unless they pay (calibration.py)."""

import pytest
import torch

from backend.quant import calibration
from backend.quant.calibration import copies_pay_off, drop_copies_blocks_match
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import Int4Linear, Int8Linear
from tests.backend.models import tiny_model


@pytest.mark.parametrize("pays", [False, True])
def test_projections_in_blocks_drop_their_copies_unless_a_copy_pays(monkeypatch, weight_layout, pays):
    """Where the copies go, every number of rows is multiplied in blocks; the head keeps its copy; a
    layout without blocks (PyTorch's kernels, slow for many rows) keeps every copy."""
    timed = []

    def copies_pay(layer):
        timed.append(layer)
        return pays

    monkeypatch.setattr(calibration, "copies_pay_off", copies_pay)
    model = tiny_model("llama")
    quantize_model(model, "int4")
    x = torch.randint(2, 500, (1, 40))  # more rows than any crossover: the path for many rows
    before = model(x).logits
    projections = [module for module in model.modules() if type(module) is Int4Linear]
    largest = max(projections, key=lambda layer: layer.dense.numel())
    drops = weight_layout == "blocks" and not pays
    assert drop_copies_blocks_match(model) == (2 * 7 if drops else 0)
    assert timed == ([largest] if weight_layout == "blocks" else [])
    assert all((layer.dense is None) == drops for layer in projections)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.dense is not None
    if drops:
        layer = projections[0]
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

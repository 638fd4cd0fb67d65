"""From how many rows quantized layers multiply by their dense copy, timed at load (calibration.py)."""

import time

import pytest
import torch

from backend.quant import calibration
from backend.quant.calibration import HEAD_TIMED_OUTPUTS, dense_pays_at, dense_pays_from
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import Int4Linear, Int8Linear, fuse_linears
from tests.backend.models import tiny_model


def test_the_crossover_is_the_fewest_timed_rows_at_which_the_dense_copy_pays(monkeypatch):
    asked = []

    def dense_pays_from_12(layer, rows, dtype):
        asked.append(rows)
        return rows >= 12

    monkeypatch.setattr(calibration, "dense_pays_at", dense_pays_from_12)
    layer = Int8Linear.quantize(torch.nn.Linear(64, 32, bias=False))
    assert dense_pays_from(layer, (4, 8, 12, 16), torch.float32) == 12
    assert asked == [4, 8, 12]  # it stops at the first that pays: timing costs start-up
    monkeypatch.setattr(calibration, "dense_pays_at", lambda layer, rows, dtype: False)
    # the packed kernel all the way: the last
    assert dense_pays_from(layer, (4, 8, 12, 16), torch.float32) == 16


def test_a_loaded_head_switches_to_its_dense_copy_at_the_timed_crossover(monkeypatch):
    timed = []

    def dense_pays_from_6(layer, rows, dtype):
        timed.append(layer)
        return rows >= 6

    monkeypatch.setattr(calibration, "HEAD_TIMED_ROWS", (3, 6, 9))
    monkeypatch.setattr(calibration, "dense_pays_at", dense_pays_from_6)
    model = tiny_model("llama")
    quantize_model(model, "int8")
    head = model.lm_head
    assert calibration.time_head_crossover(model) == 6 == head.dense_from_rows
    sample = timed[0]  # a slice of the head's own outputs, its dense copy a view of the head's
    assert sample.out_features == min(HEAD_TIMED_OUTPUTS, head.out_features)
    assert sample.dense.data_ptr() == head.dense.data_ptr()
    x = torch.randn(6, head.in_features)
    kernel, weights = head.kernel()
    packed = kernel(x[:5].to(head.compute_dtype), *weights).float()
    assert torch.equal(head(x[:5]), packed)  # five rows: the int8 kernel
    assert torch.equal(head(x), torch.nn.functional.linear(x, head.dense))  # six: the dense copy
    assert not torch.equal(packed, head(x)[:5])  # the two paths are told apart


def test_a_head_without_a_choice_is_left_alone():
    model = tiny_model("llama")
    assert calibration.time_head_crossover(model) is None  # a float head
    quantize_model(model, "int4")
    model.lm_head.dense = None  # as on a GPU: no dense copy
    assert calibration.time_head_crossover(model) is None
    assert Int4Linear.dense_from_rows == model.model.layers[0].mlp.down_proj.dense_from_rows


def test_a_heads_own_copy_goes_where_it_pays_only_past_a_steps_rows():
    """An untied head's dense copy is let go where the timed crossover is past the rows a decode step has
    (the packed weights then multiply every number of rows), kept where a step reaches it; a tied head's
    copy is the embedding's floats, which stay."""
    model = tiny_model("llama")  # untied
    quantize_model(model, "int8")
    head = model.lm_head
    head.dense_from_rows = 6  # as timed
    assert not calibration.drop_unpaid_head_copy(model, rows=6) and head.dense is not None
    x = torch.randn(18, head.in_features)
    assert calibration.drop_unpaid_head_copy(model, rows=5)
    assert head.dense is None and not head.has_many_rows_path
    kernel, weights = head.kernel()
    assert torch.equal(head(x), kernel(x.to(head.compute_dtype), *weights).float())  # 18 rows, packed
    tied = tiny_model("llama", tie_word_embeddings=True)
    quantize_model(tied, "int8")
    tied.lm_head.dense_from_rows = 6
    assert tied.lm_head.dense.data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    assert not calibration.drop_unpaid_head_copy(tied, rows=5) and tied.lm_head.dense is not None


@pytest.mark.parametrize(("slow", "pays"), [("packed", True), ("dense", False)])
def test_the_timing_decides_both_ways(monkeypatch, slow, pays):
    """A path slowed by 20 ms a call loses, whichever it is: the timing, not a constant, decides."""
    layer = Int8Linear.quantize(torch.nn.Linear(64, 32, bias=False))

    def slowed(call):
        def slow_call(*args, **kwargs):
            time.sleep(0.02)
            return call(*args, **kwargs)

        return slow_call

    if slow == "dense":
        monkeypatch.setattr(torch.nn.functional, "linear", slowed(torch.nn.functional.linear))
    else:
        kernel, weights = layer.kernel()
        monkeypatch.setattr(layer, "kernel", lambda: (slowed(kernel), weights))
    assert dense_pays_at(layer, 4, torch.float32) is pays


def test_the_projections_switch_to_their_many_rows_path_at_their_timed_crossover(monkeypatch):
    """Every projection, and the fused layers a runner makes of them, take the timed number; the head
    keeps its own."""
    timed = []

    def dense_pays_from_48(layer, rows, dtype):
        timed.append(layer)
        return rows >= 48

    monkeypatch.setattr(calibration, "dense_pays_at", dense_pays_from_48)
    model = tiny_model("llama")
    quantize_model(model, "int4")
    assert calibration.time_projection_crossover(model) == 48
    projections = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert timed[0] is max(projections, key=lambda layer: layer.in_features * layer.out_features)
    assert {layer.dense_from_rows for layer in projections} == {48}
    assert model.lm_head.dense_from_rows == Int8Linear.dense_from_rows  # not the head's number
    gate, up = model.model.layers[0].mlp.gate_proj, model.model.layers[0].mlp.up_proj
    fused = fuse_linears([gate, up])
    assert fused.dense_from_rows == 48
    for rows, path in ((47, "packed"), (48, "dense")):
        x = torch.randn(rows, gate.in_features)
        packed = fused.packed_matmul(x.to(fused.compute_dtype)).float()
        many = torch.nn.functional.linear(x, fused.dense)
        assert torch.equal(fused(x), packed if path == "packed" else many), rows
    assert not torch.equal(fused.packed_matmul(x.to(fused.compute_dtype)).float(), many)

"""A mixture of experts' router computing in float32 on a CPU (backend/layers/float_router.py)."""

import copy

import pytest
import torch

from backend.layers.float_router import FloatRouter, routers_in_float32
from backend.model.decoder_runner import DecoderRunner, mlp_of
from backend.quant.quantize import quantize_model
from tests.backend.models import tiny_model


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "gpt_oss", "minimax_m2", "granitemoe"])
def test_a_bfloat16_models_routers_route_as_in_float64(architecture):
    """On the decoder runner, a bfloat16 model's routers hold float32 copies of their weights (the same
    values) and route in float32: for 64 tokens the same experts as the router in float64 over the same
    weights and inputs, and weights for them within float32's rounding of float64's, where the router in
    bfloat16 is a hundred times further off. Runners built on the model again wrap none twice. MiniMax-M2's
    block hands its router a correction of the scores that choose besides the input: handed on."""
    model = tiny_model(architecture).to(torch.bfloat16)
    quantize_model(model, "int4")
    block = mlp_of(model.model.layers[0])
    name = "router" if architecture in ("gpt_oss", "granitemoe") else "gate"
    in_bfloat16 = copy.deepcopy(getattr(block, name))
    DecoderRunner(model)
    router = getattr(block, name)
    assert isinstance(router, FloatRouter) and router.router.weight.dtype == torch.float32
    assert torch.equal(router.router.weight, in_bfloat16.weight.float())
    in_float64 = copy.deepcopy(in_bfloat16).double()
    hidden = (
        torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    ).bfloat16()
    correction = (block.e_score_correction_bias,) if architecture == "minimax_m2" else ()
    with torch.no_grad():
        _, scores, chosen = router(hidden, *correction)
        _, exact_scores, exact_chosen = in_float64(hidden.double(), *correction)
        _, rounded_scores, _ = in_bfloat16(hidden, *correction)
    assert torch.equal(chosen, exact_chosen)
    error = (scores.double() - exact_scores).abs().max()
    assert error < 1e-5 and (rounded_scores.double() - exact_scores).abs().max() > 100 * error
    DecoderRunner(model)
    assert getattr(block, name) is router and routers_in_float32(
        [mlp_of(layer) for layer in model.model.layers]
    ) == len(model.model.layers)


def test_float32_models_and_dense_models_keep_their_routers():
    """The exact mode's float32 model routes as transformers' module does (its router untouched); a dense
    model has none to wrap."""
    model = tiny_model("qwen3_moe")
    DecoderRunner(model)
    assert not isinstance(model.model.layers[0].mlp.gate, FloatRouter)
    dense = tiny_model("llama").to(torch.bfloat16)
    assert routers_in_float32([layer.mlp for layer in dense.model.layers]) == 0

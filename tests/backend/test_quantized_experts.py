"""A mixture of experts' weights in weight-only layers (backend/quant/quantized_experts.py): what
`--quantize int4|int8` makes of Qwen3-MoE's, Mixtral's, Gemma 4's, LFM2-MoE's and gpt-oss's experts, which
are nearly all of such a model, of the thirty families' whose experts are Qwen3-MoE's, and Llama 4's."""

import copy
import inspect

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from backend.engine.engine import Engine
from backend.kernels import extension as kernels
from backend.messages import SamplingParams, Submit
from backend.quant.quantize import quantize_model
from backend.quant.quantized_experts import (
    PLAIN_EXPERTS,
    Llama4Mixture,
    PlainGLU,
    QuantizedExperts,
    as_linear,
    expert_weight,
    is_gpt_oss,
    route_llama4_mixtures,
)
from backend.quant.quantized_linear import QUANTIZERS, resident_bytes
from tests.backend.models import MarkerTokenizer, drive, reference_greedy, text_of, tiny_model

MOE = ["qwen3_moe", "mixtral", "gemma4_text", "lfm2_moe", "gpt_oss"]
LATENT_ATTENTION = {"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "axk1"}
# The other served families whose experts' module is Qwen3-MoE's under another name (`PLAIN_EXPERTS`)
LIKE_QWEN3_MOE = [
    "qwen2_moe",
    "olmoe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "ernie4_5_moe",
    "glm4_moe",
    "glm4_moe_lite",
    "deepseek_v2",
    "deepseek_v3",
    "minimax_m2",
    "hunyuan_v1_moe",
    "phimoe",
    "granitemoe",
    "granitemoeshared",
    "granitemoehybrid",
    "granitemoe_swa",
    "jamba",
    "solar_open",
    "exaone_moe",
    "afmoe",
    "laguna",
    "cohere2_moe",
    "flex_olmo",
    "hy_v3",
    "mellum",
    "flint",
    "kolibri1",
    "deepseek_v32",
    "glm_moe_dsa",
    "axk1",
]


def experts_of(model) -> list:
    """Each layer's experts, where it has them: in its MLP, or beside it (Gemma 4's)."""
    return [module for name, module in model.named_modules() if name.endswith(".experts")]


@pytest.mark.parametrize("architecture", MOE + LIKE_QWEN3_MOE)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_experts_give_transformers_output_over_the_quantized_weights(architecture, mode):
    """Each expert's projections become a weight-only layer, routed as transformers routes: for tokens
    sent to several experts, the output is transformers' module's over the weights the layers hold
    (to the kernels' rounding of activations to int8 a block). gpt-oss's: its [in, out] weights, biases
    and clamped activation over interleaved gate and up, as its module computes them."""
    model = tiny_model(architecture)
    experts = experts_of(model)[0]
    if is_gpt_oss(experts):  # biases and pre-activations large enough that the clamps bite
        with torch.no_grad():
            experts.gate_up_proj_bias.normal_(0, 4)
            experts.down_proj_bias.normal_(0, 1)
            experts.gate_up_proj.mul_(30)
    quantized = QuantizedExperts.quantized(experts, QUANTIZERS[mode])
    reference = copy.deepcopy(experts)
    with torch.no_grad():  # the weights the layers hold, as transformers' module's own
        for part in ("gate_up", "down"):
            held = [
                QUANTIZERS[mode](as_linear(expert_weight(experts, part, e))).dense
                for e in range(experts.num_experts)
            ]
            stacked = torch.stack(held)
            getattr(reference, f"{part}_proj").copy_(
                stacked.transpose(1, 2) if is_gpt_oss(experts) else stacked
            )
        assert not torch.equal(reference.gate_up_proj, experts.gate_up_proj)  # rounded, so a real test
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(24, expert_weight(experts, "gate_up", 0).shape[1], generator=generator)
    chosen = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:2] for _ in range(24)])
    weights = torch.rand(24, 2, generator=generator)
    with torch.no_grad():
        expected, got = reference(hidden, chosen, weights), quantized(hidden, chosen, weights)
    assert len({int(e) for e in chosen.flatten()}) == experts.num_experts  # every expert multiplied
    if is_gpt_oss(experts):  # the clamps bit: gate and up past the limit, both ways for up
        gate_up = hidden @ reference.gate_up_proj[0] + reference.gate_up_proj_bias[0]
        assert (gate_up[:, ::2] > experts.limit).any() and (gate_up[:, 1::2].abs() > experts.limit).any()
    scale = expected.abs().max()
    torch.testing.assert_close(got, expected, atol=0.02 * scale, rtol=0)


@pytest.mark.parametrize("architecture", MOE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_through_its_experts_gives_the_masks_numbers_to_the_bit(architecture, dtype):
    """A one-row decode step's token takes `one_token`, its chosen experts read off at once: the same
    numbers as the masks' path (`by_masks`, transformers' loop) in float32 and bfloat16, its experts given
    in any order (summed in ascending order, as the masks give them), with weights of another dtype than
    the hidden states (Mixtral's float32 routing), and with transformers' index for no expert among them."""
    model = tiny_model(architecture).to(dtype)
    experts = experts_of(model)[0]
    quantized = QuantizedExperts.quantized(experts, QUANTIZERS["int4"])
    generator = torch.Generator().manual_seed(2)
    width = expert_weight(experts, "gate_up", 0).shape[1]
    for weights_dtype in (dtype, torch.float32):
        for _ in range(8):
            hidden = torch.randn(1, width, generator=generator).to(dtype)
            chosen = torch.randperm(experts.num_experts + 1, generator=generator)[None, :3]
            weights = torch.rand(1, 3, generator=generator).to(weights_dtype)
            with torch.no_grad():
                got = quantized(hidden, chosen, weights)
                expected = quantized.by_masks(hidden, chosen, weights)
            assert got.dtype == expected.dtype and torch.equal(got, expected), (chosen, weights_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_glu_on_a_cpu_is_the_extensions_loop_to_a_rounding(dtype):
    """An expert's SiLU(gate) * up on a CPU is the C++ extension's `silu_mul` (one rounding): PyTorch's
    three operations' numbers to bfloat16's rounding; another activation keeps PyTorch's, exactly."""
    gate_up = (torch.randn(3, 128, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    silu = PlainGLU(ACT2FN["silu"])
    assert silu.silu and torch.equal(silu(gate_up), kernels.extension().silu_mul(gate_up))
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(silu(gate_up), torch.nn.functional.silu(gate) * up, **tolerance)
    gelu = PlainGLU(ACT2FN["gelu_pytorch_tanh"])
    assert not gelu.silu and torch.equal(gelu(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


def test_the_experts_bound_kernels_are_made_again_after_a_move_or_cast():
    """`few_rows` binds each expert's kernel with its weights once a dtype; moving or casting the module
    drops them, so none holds weights as they were."""
    quantized = QuantizedExperts.quantized(experts_of(tiny_model("qwen3_moe"))[0], QUANTIZERS["int8"])
    bound = quantized.few_rows(torch.float32)
    assert quantized.few_rows(torch.float32) is bound
    quantized.to("cpu")
    assert quantized.bound == {} and quantized.few_rows(torch.float32) is not bound


@pytest.mark.parametrize("architecture", ["qwen3_moe", *LIKE_QWEN3_MOE])
def test_experts_taken_under_another_name_are_qwen3_moes_line_for_line(architecture):
    """Each family whose experts `--quantize` takes as Qwen3-MoE's: its module's forward is Qwen3-MoE's
    word for word, and it holds the same two stacked parameters, so `QuantizedExperts` computes what it
    computed (a transformers release that changed one would fail here, not serve it wrong)."""
    experts = experts_of(tiny_model(architecture))[0]
    assert type(experts).__name__ in PLAIN_EXPERTS
    assert inspect.getsource(type(experts).forward) == inspect.getsource(Qwen3MoeExperts.forward)
    count, hidden = experts.num_experts, experts.gate_up_proj.shape[-1]
    intermediate = experts.gate_up_proj.shape[1] // 2
    assert experts.down_proj.shape == (count, hidden, intermediate)
    assert {name for name, _ in experts.named_parameters()} == {"gate_up_proj", "down_proj"}


def test_llama_4s_mixture_over_quantized_experts_gives_its_modules_output_over_the_quantized_weights():
    """Llama 4's experts ([in, out] weights) quantized, its mixture `Llama4Mixture`: each token through its
    chosen expert alone, its input scaled by the expert's score, the shared expert beside; the output is
    transformers' module's (every token through every expert) over the weights the layers hold, to the
    kernels' rounding, and its router's logits are the module's."""
    model = tiny_model("llama4_text")
    block = model.model.layers[1].feed_forward
    quantized = QuantizedExperts.quantized(block.experts, QUANTIZERS["int4"])
    reference = copy.deepcopy(block)
    with torch.no_grad():  # the weights the layers hold, [in, out] as the module keeps them
        for part in ("gate_up", "down"):
            held = [
                QUANTIZERS["int4"](as_linear(expert_weight(block.experts, part, e))).dense
                for e in range(block.num_experts)
            ]
            getattr(reference.experts, f"{part}_proj").copy_(torch.stack(held).transpose(1, 2))
        assert not torch.equal(reference.experts.gate_up_proj, block.experts.gate_up_proj)
    mixture = Llama4Mixture(block, quantized)
    hidden = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        (expected, expected_logits), (got, logits) = reference(hidden), mixture(hidden)
    assert len(set(expected_logits.argmax(dim=1).tolist())) == block.num_experts  # every expert chosen
    assert torch.equal(logits, expected_logits)
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max(), rtol=0)


def test_llama_4s_float_mixture_routed_to_each_tokens_expert_is_its_modules_and_serves_generates_tokens():
    """Llama 4's float mixture, each token through its chosen expert alone (`Llama4Mixture` over
    `SlicedExperts`, as the engine's model runner makes it), gives what transformers' module does
    multiplying every token by every expert, to float32's rounding, every expert chosen; and the engine
    over the routed model gives `generate`'s tokens over the model as transformers built it."""
    model = tiny_model("llama4_text", initializer_range=0.2)
    reference = copy.deepcopy(model)
    block = model.model.layers[1].feed_forward
    hidden = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected, expected_logits = block(hidden)
        assert route_llama4_mixtures(model) == 1
        routed = model.model.layers[1].feed_forward
        got, logits = routed(hidden)
    assert isinstance(routed, Llama4Mixture) and len(set(logits.argmax(dim=1).tolist())) == block.num_experts
    assert torch.equal(logits, expected_logits)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    prompt, params = (5, 9, 14, 3, 22, 7, 30), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=64, speculative_tokens=0)
    tokens = MarkerTokenizer.ids(text_of(drive(engine, [(0, Submit("r", prompt, params))])["r"]))
    assert tokens == reference_greedy(reference, prompt, 12, engine.eos_ids)


@pytest.mark.parametrize("architecture", [*MOE, *LIKE_QWEN3_MOE, "llama4_text"])
def test_quantize_model_leaves_no_expert_in_floats_and_serves_generates_tokens(architecture):
    """After `quantize_model` the experts hold at most a quarter of their float bytes (int4 and the
    groups' scales, against float32), no dense copies, and the engine's greedy tokens are `generate`'s
    on the same quantized model."""
    model = tiny_model(architecture)
    floats_before = resident_bytes(model)["floats"]
    expert_bytes = sum(e.gate_up_proj.nbytes + e.down_proj.nbytes for e in experts_of(model))
    replaced = quantize_model(model, "int4")
    assert all(isinstance(e, QuantizedExperts) for e in experts_of(model))
    assert replaced >= sum(2 * e.num_experts for e in experts_of(model))
    assert resident_bytes(model)["floats"] <= floats_before - expert_bytes
    layers = [layer for e in experts_of(model) for layer in [*e.gate_up, *e.down]]
    assert all(layer.dense is None for layer in layers)
    held = sum(t.nbytes for layer in layers for t in layer.buffers())
    assert held <= expert_bytes / 4  # 4 bits a weight and a scale and zero a group, against float32's 32
    prompt, params = (5, 9, 14, 3, 22), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=64, speculative_tokens=0)
    tokens = MarkerTokenizer.ids(text_of(drive(engine, [(0, Submit("r", prompt, params))])["r"]))
    if architecture in LATENT_ATTENTION:
        # The engine attends over the latents with kv_b_proj's weights read once through the quantized layer
        # (latent_attention.py), transformers multiplies each token's activations, rounded a block: their
        # first layer's attention parts by 0.01 whatever the experts hold, which turns a near tie of these
        # tiny models. The experts' numbers are the test above's; here, that the engine serves them.
        assert len(tokens) == 12
    else:
        assert tokens == reference_greedy(model, prompt, 12, engine.eos_ids)


def test_experts_of_another_kind_stay_floats():
    """An experts' module of a class not known here (its forward may differ: biases, another activation)
    stays transformers' own module, floats."""
    model = tiny_model("mixtral")
    other = type("SomeOtherExperts", (type(experts_of(model)[0]),), {})
    for experts in experts_of(model):
        experts.__class__ = other
    quantize_model(model, "int4")
    assert all(type(e) is other for e in experts_of(model))


def test_an_experts_slice_is_handed_to_the_quantizers_without_a_copy():
    """A transposed slice (gpt-oss's [in, out] weights) stays a view: of an MXFP4 checkpoint's placeholders
    (stride 0, no memory), a copy would be floats the model never held, 33 MB an expert of gpt-oss-20b."""
    placeholder = torch.zeros(()).expand(4, 64, 256)  # [experts, in, out]
    linear = as_linear(placeholder[1].T, torch.ones(256))
    assert linear.weight.shape == (256, 64) and linear.weight.stride() == (0, 0)
    assert (
        linear.in_features == 64 and linear.out_features == 256 and torch.equal(linear.bias, torch.ones(256))
    )

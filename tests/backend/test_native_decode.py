"""A decode step's layers in one C++ call (native_decode.py, decode_layers.cpp): the Python loop's numbers."""

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.decode_ops import EAGER
from backend.layers.row_cache import KVShape, RowCache
from backend.model.decoder_runner import DecoderRunner, QueryScaling
from backend.model.native_decode import LayerForm, NativeDecode
from backend.quant import block_weights, quantized_experts
from backend.quant.gguf_types import SixBitWeight
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import BlocksLinear
from tests.backend.models import FAMILY_EXTRAS, TINY_WINDOW, MarkerTokenizer, tiny_model
from tests.backend.test_compiled_decode import record_decode_steps, replay_decode_steps
from tests.backend.test_fused_ops import drive_mixed_decode_steps

pytestmark = pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")),
    reason="this CPU has no AVX2 (or no compiler): no weights in blocks, so no native decode steps",
)


def served_like_the_default(
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    k_quant_mix: bool = False,
    family: str = "llama",
    **extras,
) -> torch.nn.Module:
    """A tiny model as the default mode serves one: bfloat16, 4-bit projections in blocks, int8 head;
    its norms' weights and biases random (a fresh model's are ones and zeros, and a loop that took one for
    another, or left a bias out, would pass).
    `k_quant_mix`: each layer's v, up and down in 6-bit super-blocks, as a Q4_K_M file's Q6_K v and down
    sit beside its Q4_K q, k and gate (rows of 256 inputs and more): neither q, k and v nor gate and up
    fuse into one call. `extras`: config fields over the tiny model's."""
    wide = dict(hidden_size=256, intermediate_size=512) if k_quant_mix else {}
    model = tiny_model(family, head_dim=head_dim, **wide, **extras).to(dtype)
    generator = torch.Generator().manual_seed(5)
    for name, parameter in model.named_parameters():
        if "norm" in name:
            parameter.data.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
        elif "bias" in name:  # (zeros to start: a bias left out would pass)
            parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    quantize_model(model, "int4")
    if k_quant_mix:
        for layer in model.model.layers:
            layer.self_attn.v_proj = six_bit_like(layer.self_attn.v_proj, generator)
            layer.mlp.up_proj = six_bit_like(layer.mlp.up_proj, generator)
            layer.mlp.down_proj = six_bit_like(layer.mlp.down_proj, generator)
    return model


def six_bit_like(layer: torch.nn.Module, generator: torch.Generator) -> BlocksLinear:
    """Random 6-bit super-blocks (Q6_K's) of `layer`'s shape, weights of about its size (some 0.03), without a
    copy for many rows (as the loader leaves blocks where none pays)."""
    out, inputs = layer.out_features, layer.in_features
    q = torch.randint(0, 64, (out, inputs), generator=generator, dtype=torch.uint8)
    sub_scale = torch.randint(1, 8, (out, inputs // 16), generator=generator).to(torch.int8)
    d = torch.full((out, inputs // 256), 0.0003).half().float()
    six_bit = BlocksLinear.of(SixBitWeight(q, sub_scale, d))
    assert six_bit.super_blocks
    six_bit.dense = None
    return six_bit


# Ministral 3's queries' factor from position 4 on (the steps below reach position 11)
EARLY_QUERY_FACTOR = {
    "rope_parameters": FAMILY_EXTRAS["ministral3"]["rope_parameters"]
    | {"original_max_position_embeddings": 4, "factor": 128.0}
}


@pytest.mark.parametrize(
    "family, k_quant_mix, extras",
    [
        ("llama", False, {}),
        ("llama", True, {}),
        ("qwen2", False, {}),  # biases on q, k and v (its greedy tokens repeat: no drafts, for one row)
        ("qwen3", False, {}),
        ("qwen3_moe", False, {}),
        ("qwen3_moe", False, {"norm_topk_prob": True, "num_experts_per_tok": 3}),  # 3: a sum's order shows
        ("mixtral", False, {}),
        ("gemma3_text", False, {}),
        ("gpt_oss", False, {}),
        ("mistral", False, {"sliding_window": TINY_WINDOW}),  # every layer's window, the config's
        # q, k and v in one layer, gate and up in another; Phi-3-mini's heads of 96, three quarters of each
        # rotated (Phi-4-mini's)
        ("phi3", False, {"head_dim": 96, "partial_rotary_factor": 0.75, "sliding_window": TINY_WINDOW}),
        ("ministral", False, {}),  # a window layer beside a global one
        ("smollm3", False, {}),  # its second layer without rotary positions
        ("granite", False, {}),  # its multipliers (models.FAMILY_EXTRAS)
        ("gemma2", False, {}),  # its soft caps, a window layer beside a global one
        ("olmo2", False, {}),  # norms of each sublayer's output, none of its input; q and k normed whole
        ("olmo3", False, {}),  # OLMo 2's layer, a window layer beside a global one
        ("exaone4", False, {}),  # OLMo 2's layer with head norms; a window layer, then a global one unrotated
        ("seed_oss", False, {"attention_out_bias": True}),  # biases on q, k, v and o
        ("ernie4_5", False, {}),  # neighbouring pairs rotated
        ("glm4", False, {}),  # the same over half of each head; biases on q, k and v; norms of each output
        ("gemma", False, {}),  # Gemma 1: GELU, norms of 1 + weight, no norms of the sublayers' outputs
        # Qwen3-MoE's experts, OLMo 2's norms of q and k whole (as wide as the hidden states: 4 heads of 64)
        ("olmoe", False, {"hidden_size": 256}),
        ("granitemoe", False, {}),  # Granite's layer, its experts routed as gpt-oss's
        ("granite_swa", False, {}),  # Granite's layer with a window layer and every layer's sinks
        ("cohere", False, {}),  # LayerNorms, the MLP beside attention, neighbouring pairs rotated
        ("cohere2", False, {}),  # Cohere's layer; a window layer, then a global one unrotated
        ("ministral3", False, EARLY_QUERY_FACTOR),  # its queries' factor biting past position 4
        ("arcee", False, {}),  # an MLP without a gate: ReLU(up)^2
    ],
)
def test_native_steps_give_the_python_loops_logits_and_cache_writes_bit_for_bit(
    monkeypatch, k_quant_mix, family, extras
):
    """Every decode step of an engine running the Python loop, replayed through a runner with the
    native one from the same cache: the same logits and keys and values exactly, for one row, rows
    with a free one among them, and a step of more rows than the native loop takes (the Python loop's).
    A K-quant mix's layers take q and k in one call and v in another, gate and up in two. Qwen3's norms
    of each query and key head (random weights) in both loops. Qwen3-MoE's and Mixtral's experts (4-bit
    blocks, a float32 router), one token's and several tokens' routing, with and without renormalizing.
    Gemma 3's layer: its window and global layers' rotations, a window in play, its norms of each
    sublayer's output and GELU. Biases (Qwen2's q, k and v; gpt-oss's everywhere, its router's too),
    gpt-oss's sinks, window layers, top k before the softmax and clamped SwiGLU. Mistral's and Phi-3's
    window, in every layer, Ministral's in one; Phi-3's projections and its rotation of part of each head;
    SmolLM3's layer without rotary positions. Granite's multiplier of each sublayer's output. Gemma 2's cap
    of attention's scores. OLMo 2's norms of each sublayer's output and of its queries and keys whole, and
    none of its sublayers' inputs; OLMo 3's window layer, with a rotation of its own; EXAONE 4's global
    layer without rotary positions beside its window layer. Seed-OSS's bias of o. ERNIE 4.5's and GLM-4's
    rotation of neighbouring pairs, GLM-4's of half of each head and its norms of each sublayer's output.
    Gemma 1's layer, Llama's with GELU. OLMoE's experts beside its norms of q and k whole. Granite MoE's
    experts, top k first; Granite's window model's windows and sinks. Cohere's LayerNorms and MLP beside
    attention, and Cohere 2's global layer without rotary positions. Ministral 3's factor of its queries.
    Arcee's MLP without a gate."""
    model = served_like_the_default(k_quant_mix=k_quant_mix, family=family, **extras)
    drafts = 0 if family in ("qwen2", "smollm3", "ernie4_5") else None  # (their greedy tokens repeat: drafts)
    engine = Engine(model, MarkerTokenizer(), rows=20, max_seq_len=64, speculative_tokens=drafts)
    engine.runner.decoder.native = None  # the Python loop for every step
    engine.runner.decoder.replan()
    steps = record_decode_steps(engine)
    drive_mixed_decode_steps(engine)
    runner = DecoderRunner(model)
    assert runner.native is not None and runner.native.rows_below == 16
    head_norms = family.startswith(("qwen3", "gemma3", "olmo", "exaone"))
    assert len(runner.native.head_norms) == (2 * len(model.model.layers) if head_norms else 0)
    if family == "gemma3_text":  # a window layer (its own rotation) beside a global one; four norms a layer
        assert runner.native.form == LayerForm([1, 0], [TINY_WINDOW, 0], sandwich=True, gelu=True)
        assert max(max(positions.tolist()) for _, positions, *_ in steps) > TINY_WINDOW
    windows = {
        "mistral": [TINY_WINDOW] * 2,
        "phi3": [TINY_WINDOW] * 2,
        "ministral": [TINY_WINDOW, 0],
        "gemma2": [TINY_WINDOW, 0],
        "olmo3": [TINY_WINDOW, 0],
        "exaone4": [TINY_WINDOW, 0],
        "granite_swa": [TINY_WINDOW, 0],
        "cohere2": [TINY_WINDOW, 0],
    }
    if family in windows:
        assert runner.native.form.windows == windows[family]
        assert max(max(positions.tolist()) for _, positions, *_ in steps) > TINY_WINDOW
    assert runner.native.form.residual == (0.22 if family == "granite" else 1.0)
    assert runner.native.form.softcap == (1.0 if family == "gemma2" else 0.0)
    no_input_norms = ("olmo2", "olmo3", "exaone4")
    if family in no_input_norms:  # none: the first, and each layer's after its attention and its MLP
        assert runner.native.form.sandwich and runner.native.norms[0].numel() == 0
        assert [norm.numel() > 0 for norm in runner.native.norms[1:5]] == [True, False, True, False]
    if head_norms:  # OLMo's of q whole, the others' of each head
        heads_normed = model.config.num_attention_heads if family.startswith("olmo") else 1
        assert runner.native.head_norms[0].numel() == heads_normed * runner.head_dim
    if family == "olmo3":  # the window layer's rotation, then the global one's
        assert runner.native.form.rotations == [1, 0]
    if family in ("smollm3", "exaone4", "cohere2"):  # the first layer's rotation, then none
        assert runner.native.form.rotations == [0, 1] and runner.rope_kinds[1] == "unrotated"
    calls = [2, 2] if k_quant_mix else [1, 1]  # q and k with v apart, gate and up apart; else one each
    mixture = family in ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "granitemoe")
    assert runner.native.calls == ([1, 0] if mixture else calls) * len(model.model.layers)  # 0: experts
    assert len(runner.native.routers) == (len(model.model.layers) if mixture else 0)
    if family == "gpt_oss":  # biases on q, k, v and o and on every expert's projections; each layer's sinks
        assert all(bias is not None for bias in runner.native.biases) and len(runner.native.form.sinks) == 2
        assert len(runner.native.router_biases) == 2
    biased = ("qwen2", "gpt_oss", "seed_oss", "glm4")
    assert any(bias is not None for bias in runner.native.biases) == (family in biased)
    assert runner.native.form.interleaved == (family in ("ernie4_5", "glm4", "cohere", "cohere2"))
    cohere = family.startswith("cohere")  # one norm a layer, of its input: none after attention
    assert runner.native.form.centered == runner.native.form.parallel == cohere
    if cohere:
        assert [norm.numel() > 0 for norm in runner.native.norms[:5]] == [True, False, True, False, True]
    assert runner.native.form.sandwich == (
        family in no_input_norms or family.startswith(("gemma2", "gemma3", "glm4"))
    )
    assert runner.native.form.gelu == family.startswith("gemma")
    assert runner.native.form.squared_relu == (family == "arcee")
    if family == "seed_oss":  # q, k and v fused, then o: each with its bias
        assert all(bias is not None for bias in runner.native.biases[:2])
    if family == "ministral3":  # positions where its queries' factor is 1, and two where it is not
        assert runner.query_scaling == QueryScaling(0.5, 4)
        assert max(max(positions.tolist()) for _, positions, *_ in steps) >= 2 * 4
    shapes = {layout.decode_queries for _, _, layout, *_ in steps}
    assert {1, 2, 3} <= shapes and max(shapes) >= runner.native.rows_below
    assert any(layout.has_free_rows for _, _, layout, *_ in steps)

    native_steps, call = [], NativeDecode.__call__

    def counting(self, hidden, *args):
        native_steps.append(hidden.shape[0])
        return call(self, hidden, *args)

    monkeypatch.setattr(NativeDecode, "__call__", counting)
    cache = RowCache(
        KVShape.of(model.config), 20, 64, engine.runner.cache_dtype, engine.device, spare_rows=1
    )  # as the engine\'s: its embedding row too
    replay_decode_steps(runner, cache, steps, logits_tolerance=0, cache_tolerance=0)
    assert set(native_steps) == {rows for rows in shapes if rows < runner.native.rows_below}


def test_the_native_loop_runs_only_where_all_of_a_steps_work_is_the_extensions(monkeypatch):
    assert DecoderRunner(served_like_the_default()).native is not None
    # float32 activations: the Python loop rounds them to bfloat16 for the kernels, the native one would not
    assert DecoderRunner(served_like_the_default(dtype=torch.float32)).native is None
    assert DecoderRunner(served_like_the_default(head_dim=16)).native is None  # no attention loop for 16
    unquantized = tiny_model("llama", head_dim=64).to(torch.bfloat16)
    assert DecoderRunner(unquantized).native is None  # float projections
    assert DecoderRunner(served_like_the_default(), compile_decode=True).native is None  # inductor's own
    assert DecoderRunner(served_like_the_default(family="qwen3_moe")).native is not None
    # experts left in floats are the Python loop's
    monkeypatch.setattr(quantized_experts, "takes", lambda module: False)
    assert DecoderRunner(served_like_the_default(family="qwen3_moe")).native is None
    monkeypatch.undo()
    monkeypatch.setattr(block_weights, "available", lambda device: False)
    assert DecoderRunner(served_like_the_default()).native is None  # PyTorch's packing
    assert DecoderRunner(served_like_the_default()).ops is not EAGER  # the loops still run


@pytest.mark.parametrize(
    "family, extras",
    [("lfm2", {}), ("lfm3", {"use_attention_gate": False})],  # (LFM3's gates take the Python loop)
)
def test_convolution_layers_native_steps_give_the_python_loops_logits_bit_for_bit(
    monkeypatch, family, extras
):
    """LFM2's convolution layers in the native loop (short_conv over the rows' states, between in_proj and
    out_proj; its attention layers' head norms, none in its convolution layers): two engines over one model
    as the default mode serves it, one on the Python loop, one taking the native loop below 16 rows, step
    for step the same logits exactly, for one row, rows with a free one among them, and many rows. (A row's
    state advances in place: the steps are the engines' own, not replayed over one cache.) LFM3's without
    its gates too: its convolutions of 7, its window layer, its norms of each sublayer's output."""
    from tests.backend.test_speculation import decode_steps_seen

    model = served_like_the_default(family=family, **extras)
    convolving = [kind == "conv" for kind in model.config.layer_types]
    seen, native_steps, call = {}, [], NativeDecode.__call__

    def counting(self, hidden, *args, **kwargs):
        native_steps.append(hidden.shape[0])
        return call(self, hidden, *args, **kwargs)

    monkeypatch.setattr(NativeDecode, "__call__", counting)
    for native in (False, True):
        engine = Engine(model, MarkerTokenizer(), rows=20, max_seq_len=64)
        decoder = engine.runner.decoder
        assert decoder.native is not None and decoder.native.rows_below == 16
        assert [state.numel() > 0 for state in decoder.native.conv_states] == convolving
        assert [norm.numel() == 0 for norm in decoder.native.head_norms] == [
            c for c in convolving for _ in "qk"
        ]
        assert decoder.native.form.sandwich == (family == "lfm3")
        if not native:
            decoder.native = None  # the Python loop for every step
            decoder.replan()
        seen[native] = decode_steps_seen(engine, monkeypatch)
        drive_mixed_decode_steps(engine)
    assert native_steps and max(native_steps) < 16 and 1 in native_steps
    assert len(seen[True]) == len(seen[False]) and max(len(step) for step in seen[True]) >= 16
    for python_step, native_step in zip(seen[False], seen[True], strict=True):
        for (position, token, logits), (native_position, native_token, native_logits) in zip(
            python_step, native_step, strict=True
        ):
            assert (position, token) == (native_position, native_token)
            assert torch.equal(logits, native_logits)

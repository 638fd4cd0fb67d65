"""Greedy float32 decoding in a shared batch equals `model.generate` on each prompt alone (SPEC §5)."""

import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.decode_ops import decode_ops
from backend.layers.row_states import HYBRID_TYPES, STATE_SPACE_TYPES
from backend.messages import SamplingParams, Submit
from backend.model.architectures import SUPPORTED
from backend.model.decoder_runner import RUNNER_TYPES, is_dense, mlp_of
from backend.quant import block_weights
from backend.quant.quantize import quantize_model
from tests.backend.models import (
    TINY_VOCAB,
    TINY_WINDOW,
    MarkerTokenizer,
    drive,
    reference_greedy,
    text_of,
    tiny_model,
)

# 12 prompts of 16 tokens on 8 rows: rows join mid-flight, and are freed and refilled. The reference,
# transformers' `generate` on each prompt alone, is 80% of the time, which is why not more.
PROMPT_COUNT = 12


def staggered_greedy_requests(prompts, max_tokens, rng):
    """Requests arriving every few steps, so rows join while others are mid-flight."""
    arrivals, step = [], 0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        arrivals.append((step, Submit(f"r{i}", tuple(prompt), params)))
        step += rng.choice([0, 1, 2, 3])
    return arrivals


def assert_matches_reference(engine, model, prompts, max_tokens, rng):
    pieces = drive(engine, staggered_greedy_requests(prompts, max_tokens, rng))
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(model, prompt, max_tokens, engine.eos_ids)
        got = MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))
        assert got == expected, f"prompt {i} ({len(prompt)} tokens) diverged"


@pytest.mark.parametrize("architecture", sorted(SUPPORTED))  # every architecture the server takes
def test_tiny_models_match_generate_with_rows_joining_mid_flight(architecture):
    model = tiny_model(architecture)
    rng = random.Random(architecture)
    prompts = [
        [rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 60))] for _ in range(PROMPT_COUNT)
    ]
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128)
    # Llama-family and Gemma 3 layers run through the decoder runner, the others through transformers' own
    # modules over the row attention: both exact.
    assert (engine.runner.decoder is not None) == (architecture in RUNNER_TYPES)
    assert_matches_reference(engine, model, prompts, max_tokens=16, rng=rng)


def assert_chunked_prompts_sharing_a_prefix_match(model, reference, rng: random.Random) -> list[list[int]]:
    """Eight prompts sharing a 20-token prefix, prefilled in 8-token chunks on 4 rows, each giving what
    the reference model's `generate` gives on it alone; returns the prompts."""
    shared = [rng.randrange(2, TINY_VOCAB - 1) for _ in range(20)]
    prompts = [
        shared + [rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 30))] for _ in range(8)
    ]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=8)
    pieces = drive(engine, staggered_greedy_requests(prompts, 12, rng))
    for i, prompt in enumerate(prompts):
        got = MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))
        assert got == reference_greedy(reference, prompt, 12, engine.eos_ids), f"prompt {i} diverged"
    # Each piece says how much of its prompt was cached: the shared prefix, for rows after the first few.
    assert sum(request[-1].cached_tokens for request in pieces.values()) >= 20 * 3
    return prompts


@pytest.mark.parametrize(
    "architecture, extras",
    [("mistral", {}), ("phi3", {"partial_rotary_factor": 0.75})],  # (Phi-4-mini rotates part of each head)
)
def test_a_window_within_the_context_stays_exact_on_the_decoder_runner(architecture, extras):
    """Mistral and Phi-3 whose window (8, the config's, every layer's) is shorter than their rows (128):
    each query reads its last 8 positions, prompts of up to 60 tokens in chunks of 16."""
    model = tiny_model(architecture, sliding_window=TINY_WINDOW, **extras)
    rng = random.Random("window")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 60))] for _ in range(8)]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=16)
    assert [layer.window for layer in engine.runner.decoder.bound_layers] == [TINY_WINDOW] * 2
    assert_matches_reference(engine, model, prompts, max_tokens=24, rng=rng)


def test_smollm3s_layers_without_rotary_positions_stay_exact_on_the_decoder_runner():
    """SmolLM3's second layer has no rotary positions (the runner rotates it by none): weights large enough
    that attention sees positions (the default's small ones barely do, and a rotation there changed no
    token), each prompt what `generate` gives on it alone."""
    model = tiny_model("smollm3", initializer_range=0.3)
    rng = random.Random("no rotation")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=16)
    assert engine.runner.decoder.rope_kinds == [None, "unrotated"]
    assert_matches_reference(engine, model, prompts, max_tokens=12, rng=rng)


@pytest.mark.parametrize("architecture", ["ernie4_5", "glm4", "cohere", "cohere2"])
def test_rotations_of_neighbouring_pairs_stay_exact_on_the_decoder_runner(architecture):
    """ERNIE 4.5 rotates neighbouring pairs of each head's elements, GLM-4 those of half of each head, Cohere
    by angles its module gives paired already (Cohere 2 on its window layer alone): with weights large
    enough that attention sees positions (with the default's small ones, the pairs of the other form changed
    no token of ERNIE's), each prompt what `generate` gives on it alone."""
    model = tiny_model(architecture, initializer_range=0.3)
    rng = random.Random("neighbours")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=16)
    assert engine.runner.decoder.interleaved
    assert_matches_reference(engine, model, prompts, max_tokens=12, rng=rng)


def test_olmoe_clipping_q_k_and_v_takes_transformers_modules_and_stays_exact():
    """OLMoE clamps q, k and v where its `clip_qkv` says, which the runner does not: such a model runs on
    transformers' modules, each prompt still what `generate` gives on it alone (the clamp biting)."""
    model = tiny_model("olmoe", clip_qkv=0.02)
    rng = random.Random("clipped")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
    assert engine.runner.decoder is None
    assert_matches_reference(engine, model, prompts, max_tokens=12, rng=rng)


# A state-space model's rows (and a hybrid's) reuse no prefix (layers/row_states.py): test_mamba.py chunks
# their prompts.
@pytest.mark.parametrize("architecture", sorted(set(SUPPORTED) - set(STATE_SPACE_TYPES + HYBRID_TYPES)))
def test_tiny_models_match_generate_with_prompts_in_chunks_and_prefixes_reused(architecture):
    """Prompts of 8-token chunks (a prefill budget of 8) that share a 20-token prefix, so that rows
    joining later copy it from a busy row or find it in a freed one, and a second turn that extends the
    first's whole history: each still gives what `generate` gives on the prompt alone."""
    model = tiny_model(architecture)
    prompts = assert_chunked_prompts_sharing_a_prefix_match(
        model, model, random.Random(f"{architecture} chunks")
    )

    # A chat's second turn: the first turn's prompt and answer and more, its row's whole history.
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=128, max_prefill_tokens=8)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    first = drive(engine, [(0, Submit("first", tuple(prompts[0]), greedy))])["first"]
    history = prompts[0] + MarkerTokenizer.ids(text_of(first)) + [5, 6, 7]
    turn = drive(engine, [(0, Submit("turn", tuple(history), greedy))])
    assert MarkerTokenizer.ids(text_of(turn["turn"])) == reference_greedy(model, history, 12, engine.eos_ids)
    assert turn["turn"][-1].cached_tokens >= len(prompts[0])


def test_default_model_matches_generate_with_rows_joining_mid_flight(default_model):
    model, tokenizer = default_model.model, default_model.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a",
        "1, 2, 3, 4,",
        "Q: What is the boiling point of water?\nA:",
        "import numpy as np\n",
        "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
        "In 1969, astronauts",
        "SELECT * FROM",
        "Les fleurs du jardin sont",
        "A long time ago the internet was a smaller place, and people who used it knew each other by name. "
        "They wrote long messages on bulletin boards and",
    ]
    prompts = [tokenizer(text).input_ids for text in texts]
    engine = Engine(model, MarkerTokenizer(tokenizer), rows=6, max_seq_len=256)
    assert_matches_reference(engine, model, prompts, max_tokens=16, rng=random.Random(7))


def test_rows_stay_exact_when_free_rows_sit_between_them():
    """Rows 0, 2, 4, 6 end early, 1, 3, 5, 7 go on: the decode batch has holes the linear layers skip."""
    model = tiny_model("llama")
    rng = random.Random("holes")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    lengths = [3 if i % 2 == 0 else 24 for i in range(8)]
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128)
    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        engine.submit(Submit(f"r{i}", tuple(prompt), SamplingParams(temperature=0, max_tokens=length)))
    pieces, rows_seen = {}, set()
    while engine.has_work:
        rows_seen.add(tuple(row.index for row in engine.active_rows))
        for piece in engine.step():
            pieces.setdefault(piece.request_id, []).append(piece)
    assert (1, 3, 5, 7) in rows_seen
    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        expected = reference_greedy(model, prompt, length, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == expected, f"row {i} diverged"


@pytest.mark.parametrize(
    "architecture, extras",
    [
        ("qwen3_moe", {}),
        ("mixtral", {}),
        ("gpt_oss", {}),
        ("olmoe", {"hidden_size": 256}),  # (its q norm is as wide as the hidden states: 4 heads of 64)
        # their mixtures' own modules: shared experts (behind a sigmoid gate in Qwen2-MoE's), a correction of
        # the scores that choose (MiniMax-M2's, GLM-4.5's), a dense first layer (ERNIE 4.5 MoE's, GLM-4.5's)
        ("qwen2_moe", {}),
        ("ernie4_5_moe", {}),
        ("glm4_moe", {}),
        ("minimax_m2", {}),
        ("granitemoe", {}),  # (Granite's multipliers; its router's top k, then their softmax)
        # (a rotated layer with its L2 norms of heads, then one without rotary positions whose queries' factor
        # bites from position 3 on, and experts)
        ("llama4_text", {}),
        # (a convolution layer and its dense MLP, then an attention layer and experts)
        ("lfm2_moe", {"initializer_range": 0.02}),
    ],
)
def test_a_mixture_of_experts_on_the_decoder_runner_with_4_bit_projections_gives_transformers_logits(
    architecture, extras, monkeypatch
):
    """The default mode's path for an MoE model: 4-bit attention projections and experts
    (quantized_experts.py), the experts multiplied as the layer's own module does, decode steps through
    `decode_layers` with the CPU's fused operations where they build, rows decoding together: each
    step's logits are transformers' forward's over the same quantized model, to 0.03 (its prompt-length
    products take another path, the 4-bit kernels' for many rows; a Llama on its own path differs by
    0.02, and every expert's products round their activations too). gpt-oss's window layer and every
    layer's sinks are the CPU's loop's where it builds, its biases and half-width rotation the runner's.
    Qwen2-MoE's, ERNIE 4.5 MoE's, GLM-4.5's and MiniMax-M2's mixtures are their modules, their attention
    the runner's."""
    model = tiny_model(architecture, head_dim=64, **extras)
    quantize_model(model, "int4")
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, speculative_tokens=0)
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.native is None  # decode_layers.cpp has no experts
    # each layer's mixture its module, and a dense layer's MLP the runner's
    mixtures = [layer.experts is not None for layer in decoder.bound_layers]
    assert any(mixtures) and mixtures == [not is_dense(mlp_of(layer)) for layer in model.model.layers]
    if architecture == "gpt_oss":
        assert [layer.window for layer in decoder.bound_layers] == [TINY_WINDOW, None]
        assert all(layer.sinks is not None for layer in decoder.bound_layers) and decoder.reads_own_positions
    assert_decode_steps_give_transformers_logits(engine, model, architecture, monkeypatch)


@pytest.mark.parametrize(
    "architecture, extras, windows",
    [
        ("gemma3_text", {}, [TINY_WINDOW, None]),
        ("phi3", {"partial_rotary_factor": 0.75, "sliding_window": TINY_WINDOW}, [TINY_WINDOW] * 2),
        ("ministral", {}, [TINY_WINDOW, None]),
        ("smollm3", {}, [None, None]),
        ("granite", {}, [None, None]),
        ("olmo2", {}, [None, None]),
        ("olmo3", {}, [TINY_WINDOW, None]),
        ("exaone4", {}, [TINY_WINDOW, None]),
        ("seed_oss", {"attention_out_bias": True}, [None, None]),
        ("ernie4_5", {}, [None, None]),
        ("glm4", {}, [None, None]),
        ("gemma", {"initializer_range": 0.02}, [None, None]),
        ("cohere", {}, [None, None]),
        ("cohere2", {}, [TINY_WINDOW, None]),
        ("ministral3", {}, [None, None]),
        ("arcee", {}, [None, None]),
        ("hunyuan_v1_dense", {}, [None, None]),
        ("cwm", {}, [None, TINY_WINDOW]),
        ("lfm2", {"initializer_range": 0.02}, [None, None]),  # (a convolution layer, then an attention layer)
        # (its gates of each head's attention, 16 of them: a 4-bit layer too; its norms of each sublayer's
        # output, a window layer)
        ("lfm3", {"initializer_range": 0.02, "num_attention_heads": 16}, [None, None, None, TINY_WINDOW]),
        (
            "granite_swa",
            {},
            [TINY_WINDOW, None],
        ),  # (and every layer's sinks)  # (its tiny model's 0.2 parts 4-bit products)
    ],
)
def test_layer_forms_on_the_decoder_runner_with_4_bit_projections_give_transformers_logits(
    architecture, extras, windows, monkeypatch
):
    """Gemma 3, Phi-3, Ministral, SmolLM3, Granite, OLMo 2 and 3, EXAONE 4, Seed-OSS, ERNIE 4.5, GLM-4,
    Gemma, Cohere 1 and 2, Ministral 3, Arcee, Hunyuan and CWM in the default mode: 4-bit projections, decode
    steps through `decode_layers` with the CPU's fused operations (Gemma's GELU, its norms of 1 + weight;
    Phi-3's rotation of three quarters of each head; SmolLM3's layer without rotary positions; Granite's
    multipliers; OLMo's norms of each sublayer's output and of q and k whole; EXAONE 4's global layer
    without rotary positions; Seed-OSS's bias of o; ERNIE 4.5's and GLM-4's rotation of neighbouring
    pairs, GLM-4's of half of each head, and its norms of each sublayer's output; Cohere's LayerNorms and
    MLP beside attention, and its logits' scale; Ministral 3's factor of its queries past position 16;
    Arcee's MLP without a gate; Hunyuan's norms of each head after the rotation; CWM's window layer; LFM2's
    convolution layer over the rows' states, LFM3's gates of each head's attention output; window
    layers' attention by the CPU's loop, each query over its last 8 positions), to transformers' forward's
    logits as the MoE's above."""
    model = tiny_model(architecture, head_dim=64, **extras)
    quantize_model(model, "int4")
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, speculative_tokens=0)
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.native is None and decoder.reads_own_positions
    assert [layer.window for layer in decoder.bound_layers] == windows
    assert_decode_steps_give_transformers_logits(engine, model, architecture, monkeypatch)


def test_gemma_2s_soft_caps_in_the_cpus_loop_give_transformers_logits(monkeypatch):
    """Gemma 2 on the decoder runner with the CPU's fused operations (its attention's scores capped in the
    loop, a window layer beside a global one) and float32 weights, no quantization to blur them: each decode
    step's logits, soft-capped at 2, are transformers' forward's to 1e-4. (In 4 bits its large weights,
    which make the caps bite, part the one-row and many-row products by more than the test above allows.)"""
    model = tiny_model("gemma2", head_dim=64, final_logit_softcapping=2.0)
    engine = engine_with_fused_ops(model)
    decoder = engine.runner.decoder
    assert decoder.reads_own_positions and decoder.softcap == 1.0
    assert_decode_steps_give_transformers_logits(engine, model, "gemma2", monkeypatch, tolerance=1e-4)


def test_llama_4s_layers_in_float32_give_transformers_logits(monkeypatch):
    """Llama 4 on the decoder runner in float32, its decode steps with the CPU's fused operations: its
    rotated layer's L2 norms of each head after the rotation, its unrotated layer's queries multiplied by
    their temperature (from position 3 on, in steps of 4 positions), its experts: each decode step's logits
    are transformers' forward's to 1e-4, close enough that a temperature a position off fails."""
    model = tiny_model("llama4_text", head_dim=64, initializer_range=0.2)
    engine = engine_with_fused_ops(model)
    decoder = engine.runner.decoder
    assert decoder.reads_own_positions and decoder.query_scaling.unrotated_layers
    assert [layer.query_scaled for layer in decoder.bound_layers] == [False, True]
    assert [layer.head_norms is not None for layer in decoder.bound_layers] == [True, False]
    assert_decode_steps_give_transformers_logits(engine, model, "llama4_text", monkeypatch, tolerance=1e-4)


def test_lfm2s_convolution_layers_with_the_cpus_loop_keep_each_rows_state_as_prompts_join():
    """LFM2 on the decoder runner in float32 with the CPU's fused operations (attention by its loop, each
    query over its own row): rows join while others decode, yet a short prompt never goes as more decode
    queries of its row (its convolution layer would advance the row's state a token a query, from another
    prompt's last inputs), and every row gives `generate`'s tokens."""
    model = tiny_model("lfm2", head_dim=64)
    engine = engine_with_fused_ops(model)
    assert engine.runner.reads_own_positions and not engine.runner.takes_prompts_as_queries
    convolving = [layer.convolution is not None for layer in engine.runner.decoder.bound_layers]
    assert convolving == [True, False]
    rng = random.Random("lfm2 fused")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    assert_matches_reference(engine, model, prompts, max_tokens=12, rng=rng)


def engine_with_fused_ops(model) -> Engine:
    """An engine over a float32 model whose runner's decode steps take the CPU's fused operations (which
    float32 weights would not choose: exact mode's are PyTorch's); skipped where the CPU has none."""
    if not block_weights.available(torch.device("cpu")):
        pytest.skip("this CPU has no AVX2 (or no compiler): no C++ loops")
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, speculative_tokens=0)
    engine.runner.decoder.use_ops(decode_ops(torch.device("cpu"), exact=False, compiled=False))
    return engine


def assert_decode_steps_give_transformers_logits(
    engine, model, architecture, monkeypatch, tolerance: float = 0.03
):
    """Three rows of 5-30 prompt tokens decoding 8 tokens together: each step's logits of every row are
    transformers' forward's over the row's text so far, to `tolerance`."""
    from tests.backend.test_speculation import decode_steps_seen

    steps = decode_steps_seen(engine, monkeypatch)
    rng = random.Random(f"{architecture} 4-bit")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pieces = drive(engine, [(0, Submit(f"r{i}", tuple(p), params)) for i, p in enumerate(prompts)])
    texts = [[*prompt, *MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))] for i, prompt in enumerate(prompts)]
    compared = 0
    with torch.no_grad():
        for step in (step for step in steps if len(step) == len(prompts)):  # every row decoding
            for (position, token, logits), text in zip(step, texts, strict=True):
                assert text[position] == token
                expected = model(input_ids=torch.tensor([text[: position + 1]])).logits[0, -1]
                torch.testing.assert_close(logits.float(), expected, rtol=0, atol=tolerance)
                compared += 1
    assert compared >= 12

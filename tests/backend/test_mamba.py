"""Mamba, Falcon-Mamba and Mamba-2, whose rows are a recurrent state instead of keys and values
(model/mamba.py): greedy float32 decoding through the engine equals `model.generate` on each prompt alone
(SPEC §5) with long prompts prefilled a chunk a step, each chunk from the state its row's last one left
(rows joining mid-flight: test_exactness.py, which runs every served family)."""

import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.decode_ops import EAGER, FusedOps
from backend.layers.row_cache import KVShape
from backend.layers.row_states import HYBRID_TYPES, STATE_SPACE_TYPES, StateShape
from backend.messages import BackendConfig, SamplingParams, Submit
from backend.model.cache_size import size_row_states
from backend.model.loader import load_draft_model
from backend.model.mamba import MambaRunner, state_ops
from backend.model.resources import estimate_needs
from backend.quant import block_weights
from backend.quant.calibration import measure_inputs
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import WeightOnlyLinear
from tests.backend.models import (
    TINY_VOCAB,
    MarkerTokenizer,
    drive,
    load_on_cpu,
    reference_greedy,
    text_of,
    tiny_model,
    write_tiny_causal_lm,
)
from tests.backend.test_exactness import staggered_greedy_requests


@pytest.mark.parametrize("model_type", STATE_SPACE_TYPES + HYBRID_TYPES)
def test_mamba_matches_generate_with_prompts_in_chunks(model_type):
    """Prompts prefilled 5 tokens a step, longer than the convolution's reach (4), so that a chunk's
    convolution and scan both start from what the row's last chunk left; a shared prefix is not
    reused (a row's state holds no earlier position) and no draft is verified."""
    model = tiny_model(model_type)
    rng = random.Random(f"{model_type} chunks")
    shared = [rng.randrange(2, TINY_VOCAB - 1) for _ in range(20)]
    prompts = [
        shared + [rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 30))] for _ in range(8)
    ]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=5)
    assert isinstance(engine.runner, MambaRunner) == (model_type in STATE_SPACE_TYPES)
    assert engine.prefixes.whole_only and not engine.speculator.enabled
    pieces = drive(engine, staggered_greedy_requests(prompts, 12, rng))
    for i, prompt in enumerate(prompts):
        got = MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))
        assert got == reference_greedy(model, prompt, 12, engine.eos_ids), f"prompt {i} diverged"
    assert all(piece.cached_tokens == 0 for request in pieces.values() for piece in request)


@pytest.mark.parametrize(
    "model_type", ["mamba", "mamba2", "granitemoehybrid", "qwen3_5_text", "lfm2", "lfm3"]
)
def test_a_chats_next_turn_reuses_its_rows_whole_history_and_a_part_of_it_is_never_reused(model_type):
    """A row's state is that of its whole history: a second turn (the first turn's prompt and answer
    and more) continues from it, prefilling only what is new; a prompt sharing only part of it starts
    from zeros. Both give `generate`'s tokens on the prompt alone."""
    model = tiny_model(model_type)
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=128, max_prefill_tokens=8)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    first_prompt = list(range(5, 30))
    first = drive(engine, [(0, Submit("first", tuple(first_prompt), greedy))])["first"]
    history = first_prompt + MarkerTokenizer.ids(text_of(first))
    turn = history + [7, 8, 9]
    second = drive(engine, [(0, Submit("turn", tuple(turn), greedy))])["turn"]
    assert second[-1].cached_tokens == len(history) - 1  # all it fed: its last token was never fed
    assert MarkerTokenizer.ids(text_of(second)) == reference_greedy(model, turn, 12, engine.eos_ids)
    part = turn[:10] + [11, 12]  # the start of the row's history only
    third = drive(engine, [(0, Submit("part", tuple(part), greedy))])["part"]
    assert third[-1].cached_tokens == 0
    assert MarkerTokenizer.ids(text_of(third)) == reference_greedy(model, part, 12, engine.eos_ids)


def test_speculative_decoding_asked_for_is_off_with_a_warning(caplog):
    """A rejected draft would have to be taken back out of the rows' states, which cannot go back."""
    engine = Engine(tiny_model("mamba"), MarkerTokenizer(), rows=2, max_seq_len=64, speculative_tokens=4)
    assert not engine.speculator.enabled
    assert "speculative decoding is off" in caplog.text
    prompt = (5, 6, 7, 5, 6, 7, 5, 6)  # repeats: prompt lookup would have drafted
    pieces = drive(engine, [(0, Submit("r", prompt, SamplingParams(temperature=0, max_tokens=8)))])
    assert MarkerTokenizer.ids(text_of(pieces["r"])) == reference_greedy(
        engine.model, prompt, 8, engine.eos_ids
    )


def test_embedding_inputs_beside_decoding_rows_pool_the_states_of_one_whole_pass():
    """An embedding input prefilled in the spare row a chunk a step, beside a decoding row: its vector is
    the one a single pass of transformers' model gives."""
    model = tiny_model("mamba")
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=128, max_prefill_tokens=8)
    engine.submit(Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    engine.step()
    prompt = tuple(range(7, 27))
    engine.submit(Submit("e", prompt, SamplingParams(embedding="mean")))
    vectors = {}
    for _ in range(4):
        vectors |= {p.request_id: torch.tensor(p.embedding) for p in engine.step() if p.embedding is not None}
    with torch.no_grad():
        hidden = model.base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    expected = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
    torch.testing.assert_close(vectors["e"], expected, atol=1e-5, rtol=1e-4)


def test_calibrating_a_quantized_mamba_runs_without_its_quantized_head():
    """The int8 path's calibration runs the model over a text: transformers' Mamba forward reads its head's
    `weight`, which a quantized head has not; the calibration runs the base model, the head not needed."""
    model = tiny_model("mamba")
    quantize_model(model, "int8")
    assert isinstance(model.get_output_embeddings(), WeightOnlyLinear)
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear) and m is not model.lm_head]
    groups, ranges, _ = measure_inputs(model, layers, list(range(2, 200)))
    assert set(ranges) == set(layers) and sum(len(group) for group in groups) == len(layers)


def test_a_rows_state_takes_the_same_memory_at_any_length_and_what_the_start_up_line_says():
    config = tiny_model("mamba").config
    short = size_row_states(BackendConfig(rows=4, max_seq_len=64), config, torch.float32)
    long = size_row_states(BackendConfig(rows=4, max_seq_len=1024), config, torch.float32)
    assert (short.max_seq_len, long.max_seq_len) == (64, 1024)
    # 4 rows and the embedding row x 2 layers x (128 channels x 4 inputs + 128 x 8 states) x 4 bytes
    assert short.bytes == long.bytes == 5 * 2 * 128 * (4 + 8) * 4
    assert short.summary().startswith("recurrent state: 4 rows and 1 for embedding inputs, 60 KiB")
    engine = Engine(tiny_model("mamba"), MarkerTokenizer(), rows=4, max_seq_len=64)
    allocated = engine.runner.states.conv + engine.runner.states.ssm
    assert sum(t.numel() * t.element_size() for t in allocated) == short.bytes
    with pytest.raises(ValueError, match="does not hold the rows' recurrent states: 5 rows take 60 KiB"):
        size_row_states(BackendConfig(rows=4, kv_cache_memory=50_000), config, torch.float32)


def test_a_draft_model_beside_or_of_a_state_space_model_is_refused_at_start(tmp_path):
    mamba = write_tiny_causal_lm(tmp_path / "mamba", "mamba", tiny_model("mamba"))
    hybrid = write_tiny_causal_lm(tmp_path / "granite", "granitemoehybrid")
    llama = write_tiny_causal_lm(tmp_path / "llama", "llama")
    for served, draft in ((mamba, llama), (llama, mamba), (hybrid, llama), (llama, hybrid)):
        loaded = load_on_cpu(served, tmp_path)
        config = BackendConfig(
            model=str(served), draft_model=str(draft), device="cpu", cache_dir=str(tmp_path)
        )
        with pytest.raises(ValueError, match=r"state-space \(or hybrid\) model.*cannot go back to drop"):
            load_draft_model(config, loaded)


def test_a_hybrids_rows_keep_keys_and_values_for_its_attention_layers_only_and_a_state_for_the_others():
    model = tiny_model("granitemoehybrid")  # a Mamba-2 layer, then an attention layer
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=64)
    assert [layer.keys.shape[2] for layer in engine.runner.cache.layers] == [0, 64]
    states = engine.runner.states
    assert len(states.conv) == len(states.ssm) == 1 and states.ssm[0].shape == (5, 8, 16, 8)
    kv, state = KVShape.of(model.config), StateShape.of(model.config)
    assert (kv.layers, kv.without, state.layers) == (1, (0,), 1)
    needs = estimate_needs(model.config, torch.float32, rows=5, max_seq_len=64)
    assert needs.kv_cache == kv.bytes(5, 64, torch.float32) + state.bytes(5, torch.float32)


def test_nemotron_h_keeps_keys_and_values_for_its_attention_layer_alone():
    """Its layers are each one kind: a Mamba-2 mixer (a state), attention (keys and values), experts, an
    MLP (neither)."""
    config = tiny_model("nemotron_h").config
    assert KVShape.of(config).without == (0, 2, 3) and StateShape.of(config).layers == 1


@pytest.mark.parametrize("model_type", ["mamba2", "granitemoehybrid", "qwen3_5_text"])
def test_quantized_mamba_2_rows_advance_by_the_cpus_loop_and_give_its_pytorch_tokens(model_type, monkeypatch):
    """Out of exact mode a decoding row's Mamba-2 state goes through the C++ loop in one pass
    (decode_ops.FusedOps.ssm_update), the runner's own and a hybrid's, and a Gated DeltaNet's in two
    (`gated_delta_update`): the greedy tokens of PyTorch's operations, where exact mode keeps those
    (transformers' arithmetic)."""
    if not block_weights.available(torch.device("cpu")):
        pytest.skip("no C++ extension on this machine: every state goes through PyTorch's operations")
    assert state_ops(tiny_model(model_type)) is EAGER  # float32, nothing quantized: exact
    rng = random.Random(model_type)
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    arrivals = staggered_greedy_requests(prompts, 16, rng)  # the same steps both times
    texts = {}
    for loop in (True, False):
        model = tiny_model(model_type)
        quantize_model(model, "int8")
        if not loop:
            monkeypatch.setattr("backend.model.mamba.decode_ops", lambda *args, **kwargs: EAGER)
        engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
        runner_ops = engine.runner.ops if model_type == "mamba2" else mixers_ops(engine.model)
        assert isinstance(runner_ops, FusedOps) == loop
        pieces = drive(engine, arrivals)
        texts[loop] = {request: text_of(piece) for request, piece in pieces.items()}
        monkeypatch.undo()
    assert texts[True] == texts[False]


def mixers_ops(model: torch.nn.Module) -> object:
    (ops,) = {module.row_ops for module in model.modules() if hasattr(module, "row_ops")}
    return ops


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_mamba_whose_time_step_projection_is_quantized_too_serves(quantize):
    """A time-step rank of whole groups (mamba-2.8b's 160; 32 here) makes dt_proj a quantizable layer,
    without the `weight` the float path multiplies by: its layer multiplies, less its bias."""
    model = tiny_model("mamba", time_step_rank=32)
    quantize_model(model, quantize)
    assert isinstance(model.backbone.layers[0].mixer.dt_proj, WeightOnlyLinear)
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=64, max_prefill_tokens=5)
    pieces = drive(
        engine, [(0, Submit("r", tuple(range(5, 17)), SamplingParams(temperature=0, max_tokens=8)))]
    )
    assert len(MarkerTokenizer.ids(text_of(pieces["r"]))) == 8 and pieces["r"][-1].finish_reason == "length"

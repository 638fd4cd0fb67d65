"""LongRoPE's frequencies chosen once for the rows' length (model/long_rope.py): a row's tokens never follow
another row's length, and are `generate`'s where its own length chooses what the rows' length chose."""

import random

import pytest

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, reference_greedy, text_of, tiny_model

ORIGINAL = 24  # the tiny model's original context: its short factors up to here, its long ones past it


def long_rope_phi3(partial: float = 1.0, **extras):
    """A tiny Phi-3 with LongRoPE (Phi-3.5-mini's rotation, at a tiny original context), factors far from
    1, so that the two sets give other tokens; `partial`: the share of each head rotated (Phi-4-mini's
    0.75); `extras`: config fields over these."""
    rotated = int(16 * partial) // 2  # (the tiny model's heads are 16 wide)
    rng = random.Random("factors")
    return tiny_model(
        "phi3",
        initializer_range=0.3,  # (attention of the default's small weights barely sees positions)
        partial_rotary_factor=partial,
        original_max_position_embeddings=ORIGINAL,  # (Phi3Config's own, 4,096 else, overrides the one below)
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            "short_factor": [rng.uniform(1.0, 1.5) for _ in range(rotated)],
            "long_factor": [rng.uniform(4.0, 40.0) for _ in range(rotated)],
            "original_max_position_embeddings": ORIGINAL,
        },
        **extras,
    )


def greedy_tokens(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    pieces = drive(engine, [(0, Submit(name, tuple(prompt), params)) for name, prompt in prompts.items()])
    return {name: MarkerTokenizer.ids(text_of(pieces[name])) for name in prompts}


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rows_longer_than_the_original_context_rotate_by_the_long_factors_whatever_the_others_are(partial):
    """Rows of 128 positions: a short row's tokens are the same alone and beside rows past the original
    context (transformers' module would have switched it to the long factors in the steps they share, and
    back), and prompts past it give `generate`'s tokens, whose pass over them takes the long factors."""
    rng = random.Random("long")
    prompts = {f"long{i}": [rng.randrange(2, TINY_VOCAB - 1) for _ in range(30 + 9 * i)] for i in range(3)}
    short = {"short": [rng.randrange(2, TINY_VOCAB - 1) for _ in range(6)]}
    model = long_rope_phi3(partial)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
    beside = greedy_tokens(engine, short | prompts, max_tokens=10)
    assert greedy_tokens(engine, short, max_tokens=10) == {"short": beside["short"]}
    reference = long_rope_phi3(partial)  # (the engine's model keeps its choice)
    for name, prompt in prompts.items():
        assert beside[name] == reference_greedy(reference, prompt, 10, engine.eos_ids), name


def test_rows_within_the_original_context_rotate_by_the_short_factors_as_generate_does():
    """Rows of the original context's length: every prompt gives what `generate` gives on it alone."""
    rng = random.Random("short")
    prompts = {f"r{i}": [rng.randrange(2, TINY_VOCAB - 1) for _ in range(3 + 4 * i)] for i in range(4)}
    engine = Engine(long_rope_phi3(), MarkerTokenizer(), rows=4, max_seq_len=ORIGINAL)
    got = greedy_tokens(engine, prompts, max_tokens=6)
    reference = long_rope_phi3()
    for name, prompt in prompts.items():
        assert got[name] == reference_greedy(reference, prompt, 6, engine.eos_ids), name

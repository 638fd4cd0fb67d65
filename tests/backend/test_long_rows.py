"""A long row among short ones attends alone, so that the short ones do not read as far as it does."""

from __future__ import annotations

import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.step_layout import LONG_ROW_SAVES_POSITIONS, long_rows
from backend.messages import SamplingParams, Submit
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, reference_greedy, text_of, tiny_model


def test_one_long_row_among_short_ones_goes_alone():
    positions = {row: 20 + row for row in range(31)} | {31: 1999}
    assert long_rows(positions, span_rows=32) == {31}


def test_rows_of_like_lengths_stay_in_the_batch():
    assert long_rows({row: 300 + 5 * row for row in range(32)}, span_rows=32) == set()
    assert long_rows({0: 40}, span_rows=1) == set()  # alone already


def test_the_longest_rows_go_alone_while_that_saves_reading():
    positions = {0: 1500, 1: 30, 2: 1900, 3: 25, 4: 800} | {row: 10 for row in range(5, 20)}
    assert long_rows(positions, span_rows=20) == {0, 2, 4}
    # Two rows a little longer than the rest: going alone would save less than a call costs.
    near = {0: 30 + LONG_ROW_SAVES_POSITIONS // 4, 1: 30, 2: 30}
    assert long_rows(near, span_rows=3) == set()


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])  # the runner's attention and transformers'
def test_a_long_row_decoding_among_short_ones_gives_each_the_tokens_generate_gives(architecture):
    model = tiny_model(architecture)
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=512, max_prefill_tokens=512)
    rng = random.Random(3)
    prompts = {"long": tuple(rng.randrange(2, TINY_VOCAB - 1) for _ in range(420))}
    prompts |= {f"short{i}": tuple(rng.randrange(2, TINY_VOCAB - 1) for _ in range(3 + i)) for i in range(7)}
    forward, alone = engine._forward, []

    def recording_forward(inputs):
        alone.extend(long_row.row for long_row in inputs.layout.long_rows)
        return forward(inputs)

    engine._forward = recording_forward
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    pieces = drive(
        engine, [(0, Submit(request_id, prompt, greedy)) for request_id, prompt in prompts.items()]
    )
    assert alone and set(alone) == {0}  # the long prompt's row, which was admitted first
    for request_id, prompt in prompts.items():
        expected = reference_greedy(model, list(prompt), 10, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[request_id])) == expected, request_id
    # The logprobs too: a tiny random model's greedy tokens hardly depend on what it attends to.
    entries = [entry for piece in pieces["long"] for entry in piece.logprobs]
    with torch.no_grad():
        sequence = torch.tensor([[*prompts["long"], *(entry.token_id for entry in entries)]])
        reference = model(sequence).logits[0].log_softmax(-1)
    for i, entry in enumerate(entries):
        expected = float(reference[len(prompts["long"]) - 1 + i, entry.token_id])
        assert entry.logprob == pytest.approx(expected, abs=1e-4)

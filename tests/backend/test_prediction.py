"""Predicted Outputs (engine/prediction.py): where the answer stands in a request's prediction, the drafts it
gives, and that an answer with a prediction is the answer without one, only in fewer steps."""

import random
from dataclasses import replace

import pytest

from backend.engine.engine import Engine
from backend.engine.prediction import Prediction
from backend.messages import SamplingParams, Submit
from tests.backend.models import MarkerTokenizer, drive, text_of, tiny_model

# A file of similar lines: "x = 1\n" ... as tokens, each line [10, 11, n, 12].
LINES = [token for n in range(20, 28) for token in (10, 11, n, 12)]


def test_an_answer_that_follows_the_prediction_gets_its_next_tokens():
    prediction = Prediction(LINES, 2, 4)
    assert prediction.propose([], 3) == (10, 11, 20)  # nothing yet: the prediction's start
    assert prediction.propose([10, 11], 3) == (20, 12, 10)
    assert prediction.propose(LINES[:30], 8) == tuple(LINES[30:])  # to its end, no further
    assert prediction.propose(LINES, 4) == ()


def test_an_answer_that_departs_is_found_again_from_where_it_stood_not_at_the_latest_occurrence():
    """The edit: line 21 becomes two other tokens; the answer comes back at "12, 10, 11" (the end of a
    line and the start of the next), which every line has: the next line is where it goes on, where
    prompt lookup would take the latest occurrence (the last line)."""
    prediction = Prediction(LINES, 2, 4)
    answer = LINES[:6]  # 10 11 20 12 10 11
    assert prediction.propose(answer, 2) == (21, 12)
    answer += [99, 98]  # not the prediction's 21 12
    assert prediction.propose(answer, 2) == ()  # lost: nothing of it ends in the prediction
    answer += [12, 10, 11]
    assert prediction.propose(answer, 3) == (22, 12, 10)  # the line after the edit, not the last line
    answer += [22, 12, 10]
    assert prediction.propose(answer, 2) == (11, 23)  # and on, as it follows again


def test_an_answer_that_goes_back_is_found_at_the_last_place_before():
    prediction = Prediction([1, 2, 3, 4, 5, 6, 7, 8], 2, 3)
    assert prediction.propose([1, 2, 3, 4, 5, 6], 2) == (7, 8)
    assert prediction.propose([1, 2, 3, 4, 5, 6, 2, 3], 2) == (4, 5)  # "2 3" again: only before


def plain_answer(model, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=128, speculative_tokens=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return MarkerTokenizer.ids(text_of(drive(engine, [(0, Submit("r", prompt, params))])["r"]))


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_greedy_answers_with_a_prediction_are_the_answers_without_in_fewer_steps(architecture):
    """A prediction that is the answer, and one with an edit in it (tokens changed, some added), beside
    a request without one: each answer is plain decoding's token for token; the first comes in a
    fraction of the steps, with every predicted draft standing; the edited one's drafts stop at the
    edit and stand again after it."""
    model = tiny_model(architecture)
    rng = random.Random(architecture)
    prompt = tuple(rng.randrange(2, 500) for _ in range(12))
    other = tuple(rng.randrange(2, 500) for _ in range(9))
    answer = plain_answer(model, prompt, 60)
    edited = answer[:20] + [rng.randrange(2, 500) for _ in range(7)] + answer[24:]
    # rows to spare: a step's drafts take its free rows' queries (speculation.py)
    engine = Engine(model, MarkerTokenizer(), rows=16, max_seq_len=128, speculative_tokens=8)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    requests = [
        Submit("exact", prompt, replace(greedy, prediction=tuple(answer))),
        Submit("edited", prompt, replace(greedy, prediction=tuple(edited))),
        Submit("none", prompt, greedy),
        Submit("other", other, greedy),
    ]
    pieces = drive(engine, [(0, request) for request in requests])
    for name in ("exact", "edited", "none"):
        assert MarkerTokenizer.ids(text_of(pieces[name])) == answer, name
    assert MarkerTokenizer.ids(text_of(pieces["other"])) == plain_answer(model, other, 60)
    exact, edited_end, none = pieces["exact"][-1], pieces["edited"][-1], pieces["none"][-1]
    assert exact.accepted_predicted_tokens == exact.predicted_tokens > 40
    assert len(pieces["exact"]) < len(pieces["none"]) / 3  # a piece a step
    assert edited_end.accepted_predicted_tokens > 40  # 20 tokens come before the edit: after it too
    assert none.predicted_tokens == 0


def test_seeded_samples_with_a_prediction_are_the_samples_without():
    model = tiny_model("llama")
    prompt = (5, 6, 7, 8, 9)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=40, ignore_eos=True)
    engine = Engine(model, MarkerTokenizer(), rows=9, max_seq_len=128, speculative_tokens=8)
    plain = drive(engine, [(0, Submit("r", prompt, seeded))])["r"]
    sampled = tuple(MarkerTokenizer.ids(text_of(plain)))
    guessed = replace(seeded, prediction=sampled[:25] + (3, 3, 3) + sampled[25:])
    again = drive(engine, [(0, Submit("r", prompt, guessed))])["r"]
    assert text_of(again) == text_of(plain)
    assert 20 < again[-1].accepted_predicted_tokens < again[-1].predicted_tokens  # a draft of 3s missed


@pytest.mark.parametrize(
    "engine_tokens, params",
    [
        (0, {}),  # speculation off on this server
        (8, {"speculative": False}),
        (8, {"repetition_penalty": 1.2}),  # its sampling counts the tokens before: no drafts at all
    ],
)
def test_a_prediction_where_the_row_takes_no_drafts_is_not_drafted_and_changes_nothing(engine_tokens, params):
    model = tiny_model("llama")
    prompt = (5, 6, 7, 8, 9)
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=128, speculative_tokens=engine_tokens)
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **params)
    plain = drive(engine, [(0, Submit("r", prompt, base))])["r"]
    prediction = tuple(MarkerTokenizer.ids(text_of(plain)))
    guessed = drive(engine, [(0, Submit("r", prompt, replace(base, prediction=prediction)))])
    assert text_of(guessed["r"]) == text_of(plain)
    assert guessed["r"][-1].predicted_tokens == 0 and len(guessed["r"]) == len(plain)

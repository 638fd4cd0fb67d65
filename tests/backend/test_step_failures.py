"""A step that raises ends only the request at fault; every other request goes on (issue 15, item 6)."""

import pytest

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from tests.backend.models import MarkerTokenizer, drive, text_of, tiny_model

POISON = 77  # a token the broken "kernel" below cannot take


def engine_that_breaks_on_poison() -> Engine:
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=4, max_seq_len=64)
    forward = engine._forward

    def breaking_forward(inputs):
        if bool((inputs.token_ids == POISON).any()):
            raise RuntimeError("kernel failure")
        return forward(inputs)

    engine._forward = breaking_forward
    return engine


def greedy(max_tokens: int = 6, **fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def test_a_prompt_that_breaks_the_step_fails_alone_and_the_others_finish_as_if_it_were_not_there():
    healthy = [("a", (5, 6, 7)), ("b", (9, 10, 11, 12))]
    alone = drive(
        Engine(tiny_model(), MarkerTokenizer(), rows=4, max_seq_len=64),
        [(0, Submit(r, p, greedy())) for r, p in healthy],
    )
    engine = engine_that_breaks_on_poison()
    arrivals = [(0, Submit(r, p, greedy())) for r, p in healthy]
    arrivals.append((2, Submit("poisoned", (3, POISON, 4), greedy())))  # joins rows mid-flight
    pieces = drive(engine, arrivals)
    assert [p.finish_reason for p in pieces["poisoned"]] == ["error"]
    assert "kernel failure" in pieces["poisoned"][0].error
    for request_id, _ in healthy:
        assert text_of(pieces[request_id]) == text_of(alone[request_id])
        assert pieces[request_id][-1].finish_reason == "length"
    assert engine.rows == [None] * 4  # the failed row was freed too


def test_a_row_that_breaks_while_decoding_fails_alone():
    engine = engine_that_breaks_on_poison()
    forced = greedy(logit_bias=((POISON, 100.0),))  # its first token is the poison: its next step breaks
    pieces = drive(
        engine,
        [
            (0, Submit("a", (5, 6), greedy())),
            (0, Submit("forced", (8, 9), forced)),
            (0, Submit("c", (1, 2), greedy())),
        ],
    )
    assert pieces["forced"][-1].finish_reason == "error" and pieces["forced"][-1].completion_tokens == 1
    assert pieces["a"][-1].finish_reason == pieces["c"][-1].finish_reason == "length"
    assert pieces["a"][-1].completion_tokens == pieces["c"][-1].completion_tokens == 6


def test_pieces_decided_before_a_failure_are_delivered():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=2, max_seq_len=64)
    engine.submit(Submit("long", (5, 6), greedy(max_tokens=20)))
    engine.step()
    engine.submit(Submit("too-long", tuple(range(2, 100)), greedy()))  # rejected at once
    engine.cancel("long")  # its row is freed at the start of the next step

    def broken(*args) -> list:
        raise RuntimeError("device lost")

    engine.scheduler.schedule = broken  # a failure no retry can isolate
    with pytest.raises(RuntimeError):
        engine.step()
    del engine.scheduler.schedule
    delivered = {piece.request_id: piece.finish_reason for piece in engine.step()}
    assert delivered == {"too-long": "error", "long": "cancelled"}


def test_a_row_whose_logits_are_not_finite_ends_with_an_error_and_the_others_go_on():
    """A NaN in one row's logits (a broken kernel, an overflow) is that request's error: never a token
    drawn from it, never the other rows' loss."""
    healthy = [("a", (5, 6, 7)), ("b", (9, 10, 11, 12))]
    expected = drive(
        Engine(tiny_model(), MarkerTokenizer(), rows=4, max_seq_len=64),
        [(0, Submit(name, prompt, greedy())) for name, prompt in healthy],
    )
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=4, max_seq_len=64)
    forward = engine._forward

    def nan_for_poison(inputs):
        logits = forward(inputs)
        poisoned = (inputs.token_ids[inputs.keep] == POISON).nonzero().flatten()
        return logits.index_fill(0, poisoned, float("nan"))

    engine._forward = nan_for_poison
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, seed=1)
    arrivals = [(0, Submit(name, prompt, greedy())) for name, prompt in healthy]
    arrivals += [
        (1, Submit("nan-greedy", (POISON,), greedy())),
        (2, Submit("nan-sampled", (POISON,), sampled)),
    ]
    pieces = drive(engine, arrivals)
    for name in ("nan-greedy", "nan-sampled"):
        assert pieces[name][-1].finish_reason == "error"
        assert "not finite" in pieces[name][-1].error and not text_of(pieces[name])
    for name, _ in healthy:
        assert text_of(pieces[name]) == text_of(expected[name])
        assert pieces[name][-1].finish_reason == "length"


def test_an_embedding_input_that_breaks_the_step_fails_alone_beside_decoding_rows():
    """The embedding chunk rides in the rows' own forward pass: where it breaks the step, it runs apart,
    its request ends with an error, and the rows and the next embedding input go on as without it."""
    alone = drive(
        Engine(tiny_model(), MarkerTokenizer(), rows=4, max_seq_len=64),
        [(0, Submit("a", (5, 6, 7), greedy()))],
    )
    engine = engine_that_breaks_on_poison()
    pieces = drive(
        engine,
        [
            (0, Submit("a", (5, 6, 7), greedy())),
            (1, Submit("poisoned", (3, POISON, 4), SamplingParams(embedding="mean"))),
            (1, Submit("healthy", (3, 4, 5), SamplingParams(embedding="mean"))),
        ],
    )
    assert [p.finish_reason for p in pieces["poisoned"]] == ["error"]
    assert "kernel failure" in pieces["poisoned"][0].error
    assert pieces["healthy"][-1].finish_reason == "stop" and pieces["healthy"][-1].embedding is not None
    assert text_of(pieces["a"]) == text_of(alone["a"]) and pieces["a"][-1].finish_reason == "length"
    assert not engine.embedding_waiting and engine.embedding_job is None

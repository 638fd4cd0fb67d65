"""Rows are filled, reused and freed as requests come and go."""

import random

import pytest

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, tiny_model


def test_80_requests_on_32_rows_all_finish_and_no_row_idles_while_one_waits():
    # A prefill budget past any burst: this test is about rows, not about how fast they fill.
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=32, max_seq_len=128, max_prefill_tokens=10_000)
    rng = random.Random(3)
    # At least 3 tokens: shorter requests end within their admission step, unseen between steps.
    lengths = {f"r{i}": rng.randrange(3, 30) for i in range(80)}
    for request_id, max_tokens in lengths.items():
        prompt = tuple(rng.randrange(2, 500) for _ in range(rng.randrange(1, 20)))
        engine.submit(
            Submit(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        )

    finished: dict[str, int] = {}
    rows_used: dict[str, int] = {}
    step = 0
    while engine.has_work:
        for row in engine.active_rows:
            rows_used.setdefault(row.request.request_id, row.index)
        pieces = engine.step()
        step += 1
        for row in engine.active_rows:
            rows_used.setdefault(row.request.request_id, row.index)
        ended = [p for p in pieces if p.finished]
        for piece in ended:
            finished[piece.request_id] = piece.completion_tokens
        free_rows = engine.rows.count(None)
        # The only free rows while requests wait are those freed in this very step:
        # they are refilled at the next one, not when the batch drains.
        if engine.waiting:
            assert free_rows == len(ended), (
                f"step {step}: {free_rows} free rows, {len(engine.waiting)} waiting"
            )

    assert finished == lengths  # all finish, each with exactly max_tokens tokens
    assert len(set(rows_used.values())) == 32
    assert len(rows_used) == 80  # so rows were reused
    # Without waiting for the batch to drain, 80 requests of at most 29 tokens take far
    # fewer steps than three full rounds of the longest request.
    assert step < 3 * max(lengths.values())


def test_max_tokens_is_exact_and_reports_length():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=4, max_seq_len=128)
    pieces = drive(
        engine,
        [
            (0, Submit(f"r{n}", (5, 6, 7), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
            for n in (1, 2, 17)
        ],
    )
    for n in (1, 2, 17):
        last = pieces[f"r{n}"][-1]
        assert last.finish_reason == "length"
        assert last.completion_tokens == n
        assert len(MarkerTokenizer.ids("".join(p.text for p in pieces[f"r{n}"]))) == n


def test_a_row_ends_at_the_context_limit():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=2, max_seq_len=16)
    pieces = drive(
        engine,
        [
            (
                0,
                Submit(
                    "r", tuple(range(2, 12)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
                ),
            )
        ],
    )
    assert pieces["r"][-1].finish_reason == "length"
    assert pieces["r"][-1].completion_tokens == 16 - 10


def test_cancel_frees_the_row_at_the_next_step():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=2, max_seq_len=256)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for request_id in ("a", "b", "waiting"):
        engine.submit(Submit(request_id, (3, 4, 5), long))
    for _ in range(3):
        engine.step()
    assert list(engine.waiting) == ["waiting"]
    engine.cancel("a")
    pieces = engine.step()
    by_request = {p.request_id: p for p in pieces}
    assert by_request["a"].finish_reason == "cancelled"
    assert "waiting" in by_request  # admitted into a's row in the same step
    assert {row.request.request_id for row in engine.active_rows} == {"b", "waiting"}


def test_each_piece_says_how_long_its_request_waited_for_a_row():
    """Four requests on two rows: the first two take rows at once, the others wait until those end, and
    every piece of a request carries that wait (Piece.queued_seconds), which /metrics observes."""
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=2, max_seq_len=128)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pieces = drive(engine, [(0, Submit(f"r{i}", (5, 6, 7), params)) for i in range(4)])
    waits = {}
    for request_id, got in pieces.items():
        assert len({piece.queued_seconds for piece in got}) == 1 and got[0].queued_seconds is not None
        waits[request_id] = got[0].queued_seconds
    # The waiters' wait spans the first two's six steps; the first two's, none of them
    assert min(waits["r2"], waits["r3"]) > 5 * max(waits["r0"], waits["r1"])
    assert not engine.arrived  # nothing kept of the requests once they took rows


def test_cancelling_a_waiting_request_answers_at_once():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=1, max_seq_len=64)
    engine.submit(Submit("busy", (3,), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    engine.submit(Submit("queued", (3,), SamplingParams(temperature=0, max_tokens=5)))
    engine.cancel("queued")
    assert [p.finish_reason for p in engine.step() if p.request_id == "queued"] == ["cancelled"]
    assert "queued" not in engine.arrived


def test_bad_requests_get_an_error_piece_and_do_not_disturb_others():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=2, max_seq_len=32)
    ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    pieces = drive(
        engine,
        [
            (0, Submit("ok", (3, 4), ok)),
            (0, Submit("empty", (), ok)),
            (0, Submit("too-long", tuple(range(40)), ok)),
            (0, Submit("past-the-embedding", (3, TINY_VOCAB), ok)),
            (0, Submit("negative", (3, -1), ok)),
            (1, Submit("ok", (3, 4), ok)),  # the same id while the first is still running
        ],
    )
    assert "32" in pieces["too-long"][0].error and "40" in pieces["too-long"][0].error
    for name in ("past-the-embedding", "negative"):
        assert pieces[name][0].finish_reason == "error" and str(TINY_VOCAB) in pieces[name][0].error
    assert pieces["empty"][0].finish_reason == "error"
    # The request's own fault, which the frontend answers with a 400 naming its field...
    for name in ("empty", "too-long", "past-the-embedding", "negative"):
        assert pieces[name][0].invalid == "prompt_ids", name
    # ...but a request id already in use is the frontend's (a 503, as any failure of the server's).
    [reused] = [p for p in pieces["ok"] if p.finish_reason == "error"]
    assert reused.invalid is None
    assert pieces["ok"][-1].finish_reason == "length"


def test_a_prompt_as_long_as_the_context_is_refused_even_only_scored():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=1, max_seq_len=32)
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    pieces = drive(engine, [(0, Submit("full", tuple(range(3, 35)), scored))])
    assert pieces["full"][0].finish_reason == "error" and pieces["full"][0].invalid == "prompt_ids"


@pytest.mark.parametrize(
    "params, part",
    [
        (SamplingParams(logit_bias=((TINY_VOCAB, 1.0),)), "logit_bias"),
        (SamplingParams(stop_token_ids=(TINY_VOCAB,)), "stop_token_ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_their_field(params, part):
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=1, max_seq_len=32)
    [refused] = drive(engine, [(0, Submit("r", (3, 4), params))])["r"]
    assert refused.finish_reason == "error" and refused.invalid == part
    assert part in refused.error and str(TINY_VOCAB) in refused.error

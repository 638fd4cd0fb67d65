"""Decode steps launched before the last one's tokens are read (backend/engine/ahead.py).

On a CPU the decode graphs' static shapes run without capture and the step ahead runs at once, but its
bookkeeping is the GPU's: fed the unread tokens from the device, one position further, the next draw
number, its tokens dropped for rows that ended meanwhile. The text is the plain engine's, token for token.
"""

from __future__ import annotations

import pytest
import torch

from backend.engine.ahead import decodes_again
from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from tests.backend.models import MarkerTokenizer, tiny_model
from tests.backend.test_compiled_decode import greedy

MAX_SEQ_LEN = 160


def run(engine: Engine, actions: dict[int, list]) -> dict[str, list]:
    """Step the engine; at step i, submit each Submit in actions[i] and cancel each request id."""
    pieces: dict[str, list] = {}
    step = 0
    while step <= max(actions) or engine.has_work:
        for action in actions.get(step, ()):
            engine.submit(action) if isinstance(action, Submit) else engine.cancel(action)
        for piece in engine.step():
            pieces.setdefault(piece.request_id, []).append(piece)
        step += 1
        assert step < 2_000, "the engine did not finish"
    return pieces


def engines(rows: int = 4) -> tuple[Engine, Engine, list[int]]:
    """A plain engine and one whose decode steps run on the graphs' static shapes, which go ahead; and
    the sizes of the steps run ahead (their tokens read and taken)."""
    plain = Engine(tiny_model("llama"), MarkerTokenizer(), rows=rows, max_seq_len=MAX_SEQ_LEN)
    ahead = Engine(tiny_model("llama"), MarkerTokenizer(), rows=rows, max_seq_len=MAX_SEQ_LEN)
    ahead.runner.decoder.use_graphs(ahead.runner.cache, capture=False)
    return plain, ahead, steps_run_ahead(ahead)


def steps_run_ahead(engine: Engine) -> list[int]:
    """The sizes of the engine's steps run ahead from here on, as each is read and taken."""
    ran, continue_ahead = [], engine._continue_ahead

    def counting():
        ran.append(len(engine.ahead.rows))
        return continue_ahead()

    engine._continue_ahead = counting
    return ran


def outcome(pieces: dict[str, list]) -> dict[str, tuple]:
    return {
        key: ("".join(p.text for p in value), value[-1].finish_reason, value[-1].completion_tokens)
        for key, value in pieces.items()
    }


def test_rows_ending_by_length_by_a_stop_and_by_the_context_write_the_plain_engines_text():
    """Rows of several lengths, one ended by a stop sequence its step ahead had already gone past, one
    by a stop token, one seeded and sampled, one running into the context's end: the plain text."""
    plain, ahead, ran_ahead = engines()
    probe = run(
        Engine(tiny_model("llama"), MarkerTokenizer(), rows=4, max_seq_len=MAX_SEQ_LEN),
        {0: [Submit("probe", (9, 8, 7), greedy(12))]},
    )
    later = MarkerTokenizer.ids(outcome(probe)["probe"][0])
    new = [token for place, token in enumerate(later) if place >= 3 and token not in later[:place]]
    assert len(new) >= 2, later  # two tokens that first come late: one a stop sequence, one a stop token
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True)
    actions = {
        0: [
            Submit("short", (5, 6), greedy(3)),
            Submit("stop", (9, 8, 7), SamplingParams(temperature=0, max_tokens=12, stop=[f"<{new[0]}>"])),
            Submit("sampled", (11, 12), seeded),
            Submit("long", tuple(range(2, 130)), greedy(200)),  # ends at the context's end
        ],
        2: [
            Submit("token", (9, 8, 7), SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[new[1]]))
        ],
        5: [Submit("late", (13,), greedy(9))],
    }
    results = [outcome(run(engine, actions)) for engine in (plain, ahead)]
    assert results[0] == results[1]
    assert results[1]["stop"][1] == results[1]["token"][1] == "stop"
    assert (
        results[1]["stop"][2] == later.index(new[0]) + 1 and results[1]["token"][2] == later.index(new[1]) + 1
    )
    assert results[1]["long"][1] == "length" and results[1]["long"][2] == MAX_SEQ_LEN - 128
    assert len(ran_ahead) > 20 and set(ran_ahead) >= {4, 3}


def test_a_row_cancelled_while_its_step_ahead_runs_ends_and_the_others_go_on():
    plain, ahead, ran_ahead = engines()
    actions = {0: [Submit(f"r{i}", (5 + i, 6), greedy(25)) for i in range(4)], 6: ["r1"], 9: ["r3"]}
    results = [outcome(run(engine, actions)) for engine in (plain, ahead)]
    assert results[0]["r1"][1] == results[1]["r1"][1] == "cancelled"
    assert {key: value for key, value in results[1].items() if key not in ("r1", "r3")} == {
        key: value for key, value in results[0].items() if key not in ("r1", "r3")
    }
    assert results[1]["r0"][2] == 25 and len(ran_ahead) > 10


def test_a_waiting_request_takes_the_first_free_row_at_once():
    """With every row in use, a waiting request does not stop the steps ahead; when a row frees, the next
    step admits it, as a plain engine does."""
    plain, ahead, ran_ahead = engines(rows=2)
    actions = {0: [Submit("a", (5,), greedy(6)), Submit("b", (6,), greedy(20)), Submit("c", (7,), greedy(8))]}
    pieces = [run(engine, actions) for engine in (plain, ahead)]
    assert outcome(pieces[0]) == outcome(pieces[1])
    assert ran_ahead.count(2) >= 3


@pytest.mark.parametrize(
    "params, goes_on",
    [
        (SamplingParams(max_tokens=10), True),
        (SamplingParams(max_tokens=3), True),  # the step ahead makes its last
        (SamplingParams(max_tokens=2), False),  # its unread token is its last
        (SamplingParams(max_tokens=10, repetition_penalty=1.2), False),
        (SamplingParams(max_tokens=10, logprobs=1), False),
        (SamplingParams(max_tokens=10, grammar='{"grammars": []}'), False),
    ],
)
def test_which_rows_surely_decode_again(params, goes_on):
    from backend.engine.row import Row

    row = Row(0, Submit("r", (1, 2, 3), params), MarkerTokenizer(), frozenset({0}), MAX_SEQ_LEN)
    row.generated, row.cached = [7], 3  # one token taken, a second one unread
    assert decodes_again(row) is goes_on
    row.max_seq_len = 5  # the unread token fills the context
    assert decodes_again(row) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_steps_run_ahead_and_write_the_plain_engines_text_on_cuda():
    """Captured graphs, steps launched ahead from the tokens on the GPU and read through pinned memory:
    greedy and seeded rows, one ended by a stop sequence, a late arrival, against eager steps."""
    arrivals = {
        0: [Submit(f"r{i}", (5 + i, 6, 7), greedy(6 + 5 * i)) for i in range(4)],
        1: [Submit("sampled", (20, 21), SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=30))],
        2: [Submit("stop", (9, 8), SamplingParams(temperature=0, max_tokens=30, stop=["<9>"]))],
        8: [Submit("late", (22,), greedy(12))],
    }
    results, ran_ahead = [], []
    for graphs in (False, True):
        engine = Engine(
            tiny_model("llama").to("cuda"),
            MarkerTokenizer(),
            rows=8,
            max_seq_len=MAX_SEQ_LEN,
            cuda_graphs=graphs,
        )
        engine.warm_up()
        if graphs:
            ran_ahead = steps_run_ahead(engine)
        results.append(outcome(run(engine, arrivals)))
    assert results[0] == results[1]
    assert len(ran_ahead) > 10


def test_a_step_that_fails_after_launching_one_ahead_runs_its_rows_again_without_it():
    """A step that raises once its step ahead is launched runs its rows again one by one (Engine._step_rows);
    the step ahead, launched from tokens no row took, is dropped, not read into the rows."""
    plain, ahead, ran_ahead = engines()
    accept, failed = ahead._accept, []

    def failing_once(rows, *args):
        if ahead.ahead is not None and not failed:
            failed.append(len(rows))
            raise RuntimeError("a failure after the launch")
        return accept(rows, *args)

    step, left_ahead = ahead.step, []

    def stepping():
        pieces = step()
        if failed and not left_ahead:  # the step that failed, its rows run again
            left_ahead.append(ahead.ahead)
        return pieces

    ahead._accept, ahead.step = failing_once, stepping
    actions = {0: [Submit(f"r{i}", (5 + i, 6), greedy(12)) for i in range(3)]}
    results = [outcome(run(engine, actions)) for engine in (plain, ahead)]
    assert failed == [3] and left_ahead == [None]  # read later, its tokens would follow ones no row took
    assert results[0] == results[1]

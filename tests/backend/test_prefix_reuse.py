"""Prompts that start as a row's cached tokens prefill only the rest (issue 18, item 1).

Each case runs the same requests, in the same order, through an engine that
reuses nothing, and the greedy tokens must be the same.
"""

import random

from backend.engine.engine import Engine
from backend.engine.prefix_cache import MIN_COPIED_PREFIX
from backend.messages import SamplingParams, Submit
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, text_of, tiny_model

MODEL = tiny_model()
SYSTEM = tuple(random.Random(1).randrange(2, TINY_VOCAB - 1) for _ in range(24))  # a shared system prompt


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tail(seed: int, length: int = 5) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(2, TINY_VOCAB - 1) for _ in range(length))


def engines(rows: int = 2) -> tuple[Engine, Engine]:
    make = lambda reuse: Engine(MODEL, MarkerTokenizer(), rows=rows, max_seq_len=96, prefix_reuse=reuse)  # noqa: E731
    return make(True), make(False)


def run_both(arrivals: list[tuple[int, Submit]], rows: int = 2) -> dict[str, list]:
    """The pieces of the reusing engine, after checking that its text equals the other's."""
    reusing, fresh = engines(rows)
    pieces, reference = drive(reusing, arrivals), drive(fresh, arrivals)
    for request_id, expected in reference.items():
        assert text_of(pieces[request_id]) == text_of(expected), request_id
        assert expected[-1].cached_tokens == 0  # the other engine reused nothing
    return pieces


def cached(pieces: list) -> int:
    return pieces[-1].cached_tokens


def test_a_prompt_sharing_a_prefix_with_a_finished_row_prefills_only_the_rest():
    first, second = SYSTEM + tail(1), SYSTEM + tail(2)
    pieces = run_both([(0, Submit("first", first, greedy())), (12, Submit("second", second, greedy()))])
    assert cached(pieces["first"]) == 0
    assert cached(pieces["second"]) == len(SYSTEM) + (first[len(SYSTEM)] == second[len(SYSTEM)])


def test_a_prompt_sharing_a_prefix_with_a_busy_row_gets_a_copy_of_it():
    busy, newcomer = SYSTEM + tail(3), SYSTEM + tail(4)
    pieces = run_both([(0, Submit("busy", busy, greedy(30))), (3, Submit("newcomer", newcomer, greedy()))])
    assert cached(pieces["newcomer"]) >= len(SYSTEM) >= MIN_COPIED_PREFIX


def test_a_prompt_sharing_nothing_is_prefilled_whole():
    pieces = run_both([(0, Submit("a", tail(5, 20), greedy())), (12, Submit("b", tail(6, 20), greedy()))])
    assert cached(pieces["a"]) == cached(pieces["b"]) == 0


def test_a_chat_turn_reuses_the_history_its_row_generated():
    first_turn = SYSTEM + tail(7)
    reusing, fresh = engines()
    answer = [
        MarkerTokenizer.ids(text_of(drive(e, [(0, Submit("t1", first_turn, greedy(8)))])["t1"]))
        for e in (reusing, fresh)
    ]
    assert answer[0] == answer[1]
    second_turn = first_turn + tuple(answer[0]) + tail(8)  # the history, then the next user message
    turns = [drive(e, [(0, Submit("t2", second_turn, greedy()))])["t2"] for e in (reusing, fresh)]
    assert text_of(turns[0]) == text_of(turns[1])
    # The answer's last token was sampled but never fed: all but it comes from the cache.
    assert cached(turns[0]) == len(first_turn) + len(answer[0]) - 1


def test_a_prompt_without_a_cached_prefix_takes_the_lowest_free_row():
    reusing, _ = engines(rows=3)
    drive(reusing, [(0, Submit("a", SYSTEM + tail(9), greedy())), (0, Submit("b", tail(10, 30), greedy()))])
    assert reusing.prefixes.retained[0][1] and reusing.prefixes.retained[1][1]  # both rows hold tokens
    reusing.submit(Submit("unrelated", tail(11, 20), greedy(20)))
    reusing.step()
    assert reusing.rows[0].request.request_id == "unrelated"  # a short decode span before old prefixes
    pieces = run_both(
        [(0, Submit("first", SYSTEM + tail(9), greedy())), (12, Submit("again", SYSTEM + tail(12), greedy()))]
    )
    assert cached(pieces["again"]) >= len(SYSTEM)


def test_rows_joining_mid_flight_with_shared_prefixes_give_the_same_tokens():
    rng = random.Random(12)
    arrivals, step = [], 0
    for i in range(14):
        prompt = SYSTEM[: rng.choice([0, 8, 20, 24])] + tail(100 + i, rng.randrange(1, 10))
        arrivals.append((step, Submit(f"r{i}", prompt, greedy(rng.randrange(2, 12)))))
        step += rng.choice([0, 1, 2, 3])
    pieces = run_both(arrivals, rows=3)
    assert sum(cached(p) for p in pieces.values()) > 0  # some did reuse


def test_a_prefix_is_reused_within_its_cache_scope_only():
    """A team's cached prefix serves the team, never another (nor a request without a team, nor one
    with another cache_salt), whether the row that holds it is busy or free: the count of cached
    tokens, and the time a prefill saves, would tell another team what the prompt held."""
    secret = SYSTEM + tail(11, 12)
    arrivals = [
        (0, Submit("a-first", secret, greedy(), cache_scope="team-a\n")),  # row 0
        (2, Submit("b-guess", secret, greedy(), cache_scope="team-b\n")),  # row 0 busy: no copy of it
        (20, Submit("a-again", secret, greedy(), cache_scope="team-a\n")),  # row 0, free: its own
        (20, Submit("b-again", secret, greedy(), cache_scope="team-b\n")),  # row 1: its own
        (40, Submit("a-salted", secret, greedy(), cache_scope="team-a\nsalt")),
        (40, Submit("nobody", secret, greedy())),
    ]
    pieces = run_both(arrivals, rows=2)
    cached_tokens = {submit.request_id: cached(pieces[submit.request_id]) for _, submit in arrivals}
    assert cached_tokens == {
        "a-first": 0,
        "b-guess": 0,
        "a-again": len(secret) - 1,
        "b-again": len(secret) - 1,
        "a-salted": 0,
        "nobody": 0,
    }

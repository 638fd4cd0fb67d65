"""Short prompts as decode queries (engine._prompts_as_queries, step_inputs.pack): where each decode query
reads its own row up to its own position (the CPU's loop), a prompt's chunk of up to LOOP_PROMPT_TOKENS
tokens is more decode queries of its row, so that the step that admits it stays a decode step instead of
paying the prompts' path, which every decoding row waited on."""

import dataclasses

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.step_layout import LOOP_PROMPT_TOKENS
from backend.messages import SamplingParams, Submit
from backend.quant import block_weights
from tests.backend.models import MarkerTokenizer, drive, text_of
from tests.backend.test_native_decode import served_like_the_default

pytestmark = pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")),
    reason="this CPU has no AVX2 (or no compiler): no CPU attention loop, so prompts go as chunks",
)

PREFIX = tuple(range(7, 47))  # 40 tokens that two prompts share


@pytest.fixture(scope="module")
def model():
    return served_like_the_default(dtype=torch.float32)


def greedy(prompt: tuple[int, ...], request_id: str, **params) -> Submit:
    return Submit(request_id, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **params))


def run(model, arrivals, as_queries: bool = True):
    """Every request's pieces, and each step's (decode queries, prompt chunks, logits kept), from an
    engine whose prompt chunks go as queries where they may (or never, the path before)."""
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=256, speculative_tokens=0)
    assert engine.runner.reads_own_positions
    if not as_queries:
        engine._prompts_as_queries = lambda prefilling, queries: 0
    forward, steps = engine._forward, []

    def recording(inputs):
        logits = forward(inputs)
        steps.append((inputs.layout.decode_queries, len(inputs.layout.prompts), logits.shape[0]))
        return logits

    engine._forward = recording
    return drive(engine, arrivals), steps


def test_a_short_prompt_beside_decoding_rows_is_more_decode_queries_and_gives_the_chunks_tokens(model):
    """The step that admits a 12-token prompt beside two decoding rows carries no prompt chunk: 14 decode
    queries, of which 3 logits are kept (the rows' and the prompt's last token's). Every request's greedy
    tokens are those the prompts' path gives."""
    arrivals = [
        (0, greedy((3, 4, 5), "a")),
        (0, greedy((6, 5, 4, 3), "b")),
        (3, greedy(tuple(range(9, 21)), "new")),
    ]
    pieces, steps = run(model, arrivals)
    before, _ = run(model, arrivals, as_queries=False)
    assert (2 + 12, 0, 3) in steps
    assert all(prompt_chunks == 0 for _, prompt_chunks, _ in steps)
    assert {request: text_of(p) for request, p in pieces.items()} == {
        request: text_of(p) for request, p in before.items()
    }


def test_the_rest_of_a_prompt_after_its_cached_prefix_goes_as_queries_at_its_positions(model):
    """A prompt whose first 40 tokens another row holds: its last 5 go as queries at positions 40-44 of
    its own row, and its tokens are those it gets through the prompts' path."""
    first, second = greedy(PREFIX + (60, 61), "first"), greedy(PREFIX + (70, 71, 72, 73, 74), "second")
    arrivals = [(0, first), (6, second)]
    pieces, steps = run(model, arrivals)
    before, _ = run(model, arrivals, as_queries=False)
    assert (1 + 5, 0, 2) in steps  # the first row's query, and the second prompt's 5 past its prefix
    assert pieces["second"][-1].cached_tokens == len(PREFIX)
    assert text_of(pieces["second"]) == text_of(before["second"])


def test_a_long_prompt_goes_as_a_chunk_and_one_scored_as_queries_that_keep_every_logit(model):
    """Past LOOP_PROMPT_TOKENS a prompt takes the prompts' path. One whose every token's logits are asked
    for (prompt_logprobs) goes as queries too, which keep them all: its scores and its tokens are those
    of the prompts' path, within a rounding (the CPU's loop adds up its attention in another order)."""
    long = tuple(range(5, 6 + LOOP_PROMPT_TOKENS))
    arrivals = [
        (0, greedy((3, 4, 5), "a")),
        (2, greedy(long, "long")),
        (4, greedy((8, 9, 10, 11, 12, 13), "scored", prompt_logprobs=2)),
    ]
    pieces, steps = run(model, arrivals)
    before, chunked = run(model, arrivals, as_queries=False)
    assert sum(prompt_chunks for _, prompt_chunks, _ in steps) == 1  # the long prompt's
    assert sum(prompt_chunks for _, prompt_chunks, _ in chunked) == 3  # and the first prompt's
    scored, reference = pieces["scored"][0].prompt_logprobs, before["scored"][0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(reference) == 6
    for entry, expected in zip(scored[1:], reference[1:], strict=True):
        assert entry.token_id == expected.token_id and entry.rank == expected.rank
        assert abs(entry.logprob - expected.logprob) < 1e-4
        assert [token for token, _ in entry.top] == [token for token, _ in expected.top]
    assert text_of(pieces["scored"]) == text_of(before["scored"])


def team_request(request_id: str, team: str, prompt: tuple[int, ...], tokens: int = 12) -> Submit:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return Submit(request_id, prompt, params, cache_scope=team, team=team)


def rows_of_each_step(model, arrivals, alone: bool = True) -> tuple[dict, list[list[int]]]:
    """Every request's pieces, and the rows of each step's decode queries (with no prompt ever alone: the
    steps before `_first_tokens_alone`)."""
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=256, speculative_tokens=0)
    if not alone:
        engine._first_tokens_alone = lambda schedule: None
    forward, steps = engine._forward, []

    def recording(inputs):
        steps.append(inputs.layout.decode_index.tolist())
        return forward(inputs)

    engine._forward = recording
    return drive(engine, arrivals), steps


def test_a_lighter_teams_new_prompt_gets_a_step_of_its_own_while_a_flooding_teams_rows_wait(model):
    """Beside four rows of a flooding team, another team's short prompt is prefilled in a step of its
    own (its queries alone), and so is the next one that comes during that step, but never three steps
    in a row; the flood's own prompt, come with one of the other team's, waits a step with the flood's
    rows; prompts without teams go with the rows. Nobody's tokens change: the rows only wait."""
    flood = [(0, team_request(f"flood{i}", "flood", (3 + i, 4, 5), tokens=20)) for i in range(4)]
    chat = [
        (4, team_request("chat", "chat", tuple(range(9, 19)))),
        (5, team_request("next", "chat", (8, 9))),
        (6, team_request("third", "chat", (8, 10), tokens=2)),
    ]
    arriving_together = [
        (9, team_request("flood4", "flood", (6, 7))),
        (9, team_request("fourth", "chat", (8, 11))),
    ]
    arrivals = [*flood, *chat, *arriving_together]
    pieces, steps = rows_of_each_step(model, arrivals)
    assert steps[4:7] == [
        [4] * 10,  # row 4 is the chat's: its 10 tokens, no flood row beside them
        [5, 5],  # the next, come meanwhile: a second step alone
        [0, 1, 2, 3, 4, 5, 6, 6],  # the third waits for no more: it goes with the rows
    ]
    # "fourth" takes third's row, where its prompt's first token is cached: one query alone; the flood's
    # own prompt, admitted in the same step, goes with the flood's rows after it.
    assert steps[9:11] == [[6], [0, 1, 2, 3, 4, 5, 6, 7, 7]]
    together, steps_together = rows_of_each_step(model, arrivals, alone=False)
    assert [4] * 10 not in steps_together and [6] not in steps_together
    assert {request: text_of(p) for request, p in pieces.items()} == {
        request: text_of(p) for request, p in together.items()
    }
    _, untagged = rows_of_each_step(
        model, [(0, greedy((3, 4, 5), "a")), (2, greedy(tuple(range(9, 19)), "b"))]
    )
    assert [1] * 10 not in untagged and [0] + [1] * 10 in untagged


def test_a_lighter_teams_first_token_that_shows_no_text_gets_another_step_of_its_own(model):
    """A first token whose text a stop sequence holds back (it may be that sequence's start) has shown
    its client nothing: its row decodes alone once more, instead of waiting for the flood's step."""
    flood = [(0, team_request(f"flood{i}", "flood", (3 + i, 4, 5), tokens=20)) for i in range(4)]
    prompt = tuple(range(9, 19))
    plain, _ = rows_of_each_step(model, [*flood, (4, team_request("chat", "chat", prompt))])
    first = MarkerTokenizer.ids(text_of(plain["chat"]))[0]
    held = team_request("chat", "chat", prompt)
    held = dataclasses.replace(held, params=dataclasses.replace(held.params, stop=(f"<{first}>never",)))
    pieces, steps = rows_of_each_step(model, [*flood, (4, held)])
    assert steps[4:7] == [[4] * 10, [4], [0, 1, 2, 3, 4]]
    assert pieces["chat"][0].completion_tokens == 2  # its first piece came with its second token
    assert text_of(pieces["chat"]) == text_of(plain["chat"])
    _, shown = rows_of_each_step(model, [*flood, (4, team_request("chat", "chat", prompt))])
    assert steps != shown and shown[4:6] == [[4] * 10, [0, 1, 2, 3, 4]]  # shown at once: no second step

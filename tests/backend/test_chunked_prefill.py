"""Long prompts are prefilled a chunk a step while other rows keep decoding (issue 18, item 2)."""

import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, reference_greedy, text_of, tiny_model

BUDGET = 8


def greedy(max_tokens: int = 6, **fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def prompt_of(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(2, TINY_VOCAB - 1) for _ in range(length))


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])  # the runner's path and transformers' own
def test_a_prompt_of_three_chunks_gives_the_tokens_generate_gives(architecture):
    model = tiny_model(architecture)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=64, max_prefill_tokens=BUDGET)
    long_prompt, short_prompt = prompt_of(3 * BUDGET - 3, 1), prompt_of(3, 2)
    pieces = drive(
        engine,
        [(0, Submit("short", short_prompt, greedy(12))), (1, Submit("long", long_prompt, greedy(6)))],
    )
    for request_id, prompt, count in (("long", long_prompt, 6), ("short", short_prompt, 12)):
        expected = reference_greedy(model, list(prompt), count, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[request_id])) == expected, request_id


def test_rows_keep_decoding_every_step_while_a_long_prompt_prefills_within_the_budget():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=4, max_seq_len=64, max_prefill_tokens=BUDGET)
    forward, prefilled = engine._forward, []

    def counting_forward(inputs):
        prefilled.append(inputs.token_ids.shape[0] - inputs.decode_queries)
        return forward(inputs)

    engine._forward = counting_forward
    engine.submit(Submit("decoding", prompt_of(2, 3), greedy(30)))
    engine.step()
    prefilled.clear()
    engine.submit(Submit("long", prompt_of(5 * BUDGET, 4), greedy(2)))
    generated_before = len(engine.rows[0].generated)
    steps = 0
    while engine.rows[1] is None or not engine.rows[1].prefilled:
        engine.step()
        steps += 1
    assert steps == 5 and prefilled == [BUDGET] * 5  # a chunk a step, never more than the budget
    assert len(engine.rows[0].generated) == generated_before + 5  # the decoding row never waited


def engine_with_a_decoding_row(model=None, rows: int = 3) -> Engine:
    """Chunks apply while some row decodes (alone, a prompt is prefilled whole: nobody waits)."""
    engine = Engine(
        model or tiny_model(), MarkerTokenizer(), rows=rows, max_seq_len=64, max_prefill_tokens=BUDGET
    )
    engine.submit(Submit("decoding", prompt_of(2, 9), greedy(40)))
    engine.step()
    return engine


def test_a_request_cancelled_mid_prefill_frees_its_row():
    engine = engine_with_a_decoding_row()
    engine.submit(Submit("long", prompt_of(4 * BUDGET, 5), greedy()))
    engine.step()
    assert engine.rows[1].cached == BUDGET and not engine.rows[1].prefilled
    engine.cancel("long")
    assert ("long", "cancelled") in [(p.request_id, p.finish_reason) for p in engine.step()]
    assert engine.rows[1] is None
    pieces = drive(engine, [(0, Submit("next", prompt_of(3, 6), greedy(4)))])
    assert pieces["next"][-1].completion_tokens == 4


def test_with_no_row_decoding_a_long_prompt_is_prefilled_whole():
    engine = Engine(tiny_model(), MarkerTokenizer(), rows=2, max_seq_len=64, max_prefill_tokens=BUDGET)
    engine.submit(Submit("long", prompt_of(5 * BUDGET, 5), greedy()))
    engine.step()
    assert engine.rows[0].prefilled and len(engine.rows[0].generated) == 1


def test_a_scored_prompt_over_several_chunks_scores_every_token():
    model = tiny_model()
    engine = engine_with_a_decoding_row(model)
    prompt = prompt_of(2 * BUDGET + 3, 7)
    engine.submit(Submit("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1)))
    engine.step()
    assert engine.rows[1].cached == BUDGET  # in chunks
    [piece] = drive(engine, [])["score"]
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    scores = piece.prompt_logprobs
    assert scores[0] is None and [s.token_id for s in scores[1:]] == list(prompt[1:])
    expected = [float(reference[i, token]) for i, token in enumerate(prompt[1:])]
    assert [s.logprob for s in scores[1:]] == pytest.approx(expected, abs=1e-4)


def test_by_default_each_chunk_is_what_the_measured_step_times_allow():
    """No --max-prefill-tokens: the engine times its steps and each chunk is the budget they give
    (backend.engine.prefill_budget; its own tests hold the arithmetic), with the text of a whole prefill."""
    model = tiny_model()
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=512)
    budgets, prefilled = [], []
    tokens, forward = engine.prefill_budget.tokens, engine._forward

    def recording_tokens(decoding_rows):
        budgets.append(tokens(decoding_rows))
        return budgets[-1]

    def counting_forward(inputs):
        prefilled.append(inputs.token_ids.shape[0] - inputs.decode_queries)
        return forward(inputs)

    engine.prefill_budget.tokens, engine._forward = recording_tokens, counting_forward
    drive(engine, [(0, Submit("warm", prompt_of(2, 3), greedy(60)))])
    assert engine.prefill_budget.plain_steps  # it timed the steps of one row decoding
    budgets.clear()
    prefilled.clear()
    long_prompt = prompt_of(400, 4)
    pieces = drive(
        engine,
        [(0, Submit("decoding", prompt_of(3, 5), greedy(60))), (1, Submit("long", long_prompt, greedy(4)))],
    )
    # From the second step on a row decodes, and each step asks the budget once.
    chunks = [count for count in prefilled[1:] if count]
    assert sum(chunks) == len(long_prompt)
    for i, chunk in enumerate(chunks):
        assert chunk == min(budgets[i], len(long_prompt) - sum(chunks[:i]))
    expected = reference_greedy(model, list(long_prompt), 4, engine.eos_ids)
    assert MarkerTokenizer.ids(text_of(pieces["long"])) == expected

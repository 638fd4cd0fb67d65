"""The prefill budget follows the measured step times: a step with a chunk within STRETCH plain ones."""

from __future__ import annotations

from backend.engine.prefill_budget import (
    EMBEDDING_FLOOR,
    EMBEDDING_QUERIES,
    FIRST_GUESS,
    FLOOR,
    STRETCH,
    PrefillBudget,
)


def test_a_configured_number_is_kept_whatever_the_steps_take():
    budget = PrefillBudget(fixed=64)
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.500, decoding_rows=31, prompt_tokens=64)
    assert budget.tokens(31) == 64


def test_until_both_costs_are_timed_the_budget_is_the_first_guess():
    budget = PrefillBudget()
    assert budget.tokens(31) == FIRST_GUESS
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    assert budget.tokens(31) == FIRST_GUESS
    budget.observe(2.0, decoding_rows=0, prompt_tokens=1800)  # a whole prompt, nobody decoding: no cost
    assert budget.tokens(31) == FIRST_GUESS


def test_the_budget_fits_a_chunk_step_within_stretch_times_a_plain_one():
    budget = PrefillBudget()
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.110, decoding_rows=31, prompt_tokens=100)  # 0.5 ms a prompt token
    tokens = budget.tokens(31)
    assert tokens == int((STRETCH - 1) * 0.060 / 0.0005)  # 96
    assert 0.060 + tokens * 0.0005 <= STRETCH * 0.060 + 1e-9


def test_a_machine_twice_as_slow_at_prompts_gets_half_the_chunk():
    fast, slow = PrefillBudget(), PrefillBudget()
    for budget, chunk_step in ((fast, 0.110), (slow, 0.160)):
        budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
        budget.observe(chunk_step, decoding_rows=31, prompt_tokens=100)
    assert slow.tokens(31) == fast.tokens(31) // 2


def test_the_plain_step_is_that_of_the_nearest_number_of_rows():
    budget = PrefillBudget()
    budget.observe(0.008, decoding_rows=1, prompt_tokens=0)
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.110, decoding_rows=30, prompt_tokens=100)  # against 31 rows' 60 ms: 0.5 ms a token
    assert budget.tokens(29) == int((STRETCH - 1) * 0.060 / 0.0005)
    assert budget.tokens(1) == FLOOR  # 0.8 * 8 ms is 12 tokens' time: the floor still lets prompts on


def test_the_budget_stays_under_the_ceiling():
    budget = PrefillBudget()
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.0601, decoding_rows=31, prompt_tokens=100)  # prompts nearly free (a GPU)
    assert budget.tokens(31) == budget.ceiling


def test_a_short_prompt_in_the_noise_does_not_swing_the_cost_per_token():
    budget = PrefillBudget()
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.110, decoding_rows=31, prompt_tokens=100)
    before = budget.tokens(31)
    budget.observe(0.070, decoding_rows=31, prompt_tokens=2)  # 10 ms of jitter over a 2-token prompt
    assert budget.tokens(31) >= before * 0.8


def test_embeddings_take_the_time_left_at_their_own_cost_per_token():
    budget = PrefillBudget()
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.110, decoding_rows=31, prompt_tokens=100)  # prompts: 0.5 ms a token, a budget of 96
    assert budget.embedding_tokens(31, prompt_tokens=0) == 96  # embeddings' cost not yet measured
    assert budget.embedding_tokens(31, prompt_tokens=40) == 56  # what the prompts leave of the budget
    budget.observe_embedding(0.100, tokens=50)  # embeddings: 2 ms a token, four times a prompt's
    # 0.8 of a plain step's 60 ms pays for 24 such tokens, less those the prompts took (to the token:
    # 0.8 * 0.06 is not exact in floating point)
    assert budget.embedding_tokens(31, prompt_tokens=0) in (23, 24)
    assert budget.embedding_tokens(31, prompt_tokens=40) in (13, 14)


def test_embeddings_get_their_floor_when_prompts_take_the_whole_step():
    budget = PrefillBudget()
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.110, decoding_rows=31, prompt_tokens=100)
    budget.observe_embedding(0.100, tokens=50)
    assert budget.embedding_tokens(31, prompt_tokens=96) == EMBEDDING_FLOOR


def test_a_configured_budget_gives_embeddings_what_prompts_leave_of_it():
    budget = PrefillBudget(fixed=64)
    budget.observe_embedding(1.0, tokens=10)  # slow, but a configured number is kept
    assert budget.embedding_tokens(3, prompt_tokens=20) == 44
    assert budget.embedding_tokens(3, prompt_tokens=64) == EMBEDDING_FLOOR


def test_an_embedding_input_as_decode_queries_takes_as_many_as_keep_steps_within_the_stretch():
    """On the CPU's loop an embedding chunk is more decode queries: their number goes up by one after a
    step within STRETCH plain steps of the other queries, down below what it took after one past it."""
    budget = PrefillBudget()
    assert budget.embedding_queries(1, spare=31) == EMBEDDING_QUERIES  # nothing timed yet
    budget.observe(0.010, decoding_rows=1, prompt_tokens=0)  # a plain step of one row: 10 ms
    taken = []
    for _ in range(12):  # each query costs 1 ms: up to 8 keep a step within 18 ms
        queries = budget.embedding_queries(1, spare=31)
        budget.observe_embedding_queries(0.010 + queries * 0.001, 1, queries, prompt_tokens=0)
        taken.append(queries)
    assert taken[:5] == [4, 5, 6, 7, 8] and set(taken[5:]) <= {7, 8, 9}  # then about the most that fit
    assert budget.embedding_queries(1, spare=3) == 3  # never more than the step's spare queries
    budget.observe_embedding_queries(0.010 + 2 * 0.001, 1, 2, prompt_tokens=0)  # an input's short end
    assert budget.embedding_queries(1, spare=31) in (7, 8, 9)
    budget.observe_embedding_queries(0.100, 1, 8, prompt_tokens=40)  # a prompt's chunk too: no sign
    assert budget.embedding_queries(1, spare=31) in (7, 8, 9)
    assert PrefillBudget(fixed=16).embedding_queries(1, spare=31) == 16  # a configured budget: its number


def test_chunks_of_many_sizes_costing_per_token_alone_keep_the_budget_of_the_cost_per_token():
    budget = PrefillBudget()
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    for tokens in (100, 20, 60, 96, 33):  # 0.5 ms a token, nothing fixed
        budget.observe(0.060 + tokens * 0.0005, decoding_rows=31, prompt_tokens=tokens)
    assert budget.tokens(31) in (95, 96)  # int((STRETCH - 1) * 0.060 / 0.0005), to floating point


def test_a_fixed_cost_past_the_stretch_is_paid_for_as_many_tokens_as_it_costs():
    """A GPU: plain steps are replayed graphs of 3.5 ms, a step with a chunk runs eagerly, 10 ms more
    whatever its size. At the floor's 32 tokens the fixed cost would be paid again every 32 tokens."""
    budget = PrefillBudget()
    budget.observe(0.0035, decoding_rows=32, prompt_tokens=0)
    budget.observe(0.0035 + 0.0100 + 128 * 0.00002, decoding_rows=32, prompt_tokens=128)
    budget.observe(0.0035 + 0.0100 + 32 * 0.00002, decoding_rows=32, prompt_tokens=32)
    assert budget.tokens(32) == int(0.0100 / 0.00002)  # 500: as long for the tokens as the fixed cost
    fixed = PrefillBudget()  # with no fixed cost the same per-token cost fits 140 tokens in the stretch
    fixed.observe(0.0035, decoding_rows=32, prompt_tokens=0)
    fixed.observe(0.0035 + 128 * 0.00002, decoding_rows=32, prompt_tokens=128)
    fixed.observe(0.0035 + 32 * 0.00002, decoding_rows=32, prompt_tokens=32)
    assert fixed.tokens(32) in (139, 140)


def test_a_cost_per_token_that_noise_makes_negative_counts_as_none_and_the_fixed_cost_is_amortized():
    budget = PrefillBudget()
    budget.observe(0.060, decoding_rows=31, prompt_tokens=0)
    budget.observe(0.100, decoding_rows=31, prompt_tokens=20)  # a small chunk in a slow step
    budget.observe(0.080, decoding_rows=31, prompt_tokens=100)  # a large one in a quick one
    assert budget.prompt_token_seconds() == 0.0  # the fitted slope is negative: clamped
    assert budget.tokens(31) == budget.ceiling  # a fixed 30 ms, past the stretch: as many tokens as allowed

"""Speculative decoding by prompt lookup (engine/speculation.py): what it drafts, what it takes, and that
output is the output of plain decoding, greedy and sampled (SPEC §5)."""

import collections
import math
import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.prompt_lookup import PromptLookup
from backend.engine.row import Row
from backend.engine.speculation import PROBE_AFTER, Speculator, draft_length, verified
from backend.messages import SamplingParams, Submit
from backend.quant import block_weights
from tests.backend.models import MarkerTokenizer, drive, reference_greedy, text_of, tiny_model

# Prompts whose continuations repeat what came before (a random model loops, as an edit repeats its
# file), so drafts come often, and some are rejected.
LOOPING = [[5, 6, 7, 8, 9] * 6, [10, 11, 12] * 4 + [13], list(range(20, 60)), [3, 4], [7, 7, 7, 8] * 3]


def test_prompt_lookup_proposes_what_followed_the_suffixs_latest_earlier_occurrence():
    lookup = PromptLookup(shortest=2, longest=3)
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2]
    # (9, 1, 2) never came before; (1, 2) last came at places 4-5, followed by 3, 5, 9
    assert lookup.propose(tokens, 3) == (3, 5, 9)
    assert lookup.propose(tokens, 10) == (3, 5, 9, 1, 2)  # as far as the tokens go
    assert lookup.propose([*tokens, 8], 3) == ()  # (2, 8) and (1, 2, 8): nowhere before
    assert PromptLookup(2, 3).propose([1, 2], 3) == ()  # nothing before the suffix itself


def test_prompt_lookup_prefers_the_longest_match_and_indexes_as_tokens_grow():
    lookup = PromptLookup(shortest=1, longest=3)
    tokens = [4, 5, 6, 7, 8, 5, 6, 9, 4, 5, 6]
    # (4, 5, 6) came first at 0-2, followed by 7; the shorter (5, 6) came later, followed by 9
    assert lookup.propose(tokens, 2) == (7, 8)
    grown = [*tokens, 7, 1, 5]
    # only (5) matches: its latest earlier occurrence, at 9, was followed by 6, 7 (not 6, 9 at 5)
    assert lookup.propose(grown, 2) == PromptLookup(1, 3).propose(grown, 2) == (6, 7)
    with pytest.raises(ValueError, match="n-gram sizes"):
        PromptLookup(3, 2)


def test_a_row_takes_the_samples_up_to_the_first_that_differs_from_its_draft():
    assert verified([7], ()) == [7]  # no draft: the one token of plain decoding
    assert verified([1, 2, 3], (1, 2)) == [1, 2, 3]  # all of the draft stood, and one more
    assert verified([1, 5, 3], (1, 2)) == [1, 5]  # the second differs: it is the row's own token
    assert verified([4, 2, 3], (1, 2)) == [4]


def test_a_draft_is_as_long_as_its_tokens_chances_pay_for_their_share_of_the_step():
    assert draft_length(0.9, 0.2, 8) == 8  # 0.9**8 = 0.43: every token pays
    assert draft_length(0.9, 0.2, 3) == 3  # no more than the room
    assert draft_length(0.5, 0.2, 8) == 2  # 0.5, 0.25 over 0.2; 0.125 not
    assert draft_length(0.3, 0.5, 8) == 0  # a full step: a likely miss costs more than it brings
    with pytest.raises(ValueError, match="--prompt-lookup-min"):
        Speculator(8, 5, 4, step_queries=32)
    speculator = Speculator(8, 2, 4, step_queries=32)
    shares = [speculator.token_share(rows) for rows in (1, 4, 32)]
    assert shares[0] == pytest.approx(0.2) and shares == sorted(shares) and shares[-1] < 1


def test_a_row_probes_with_one_token_where_its_record_would_never_pay():
    """Where a draft token's share of the step is one half or more (a draft model whose guess costs half a
    step, as on an AVX2 CPU), a record starting at one half would never draft: a new row drafts one
    token, then as long as its record pays; one whose probe missed drafts again PROBE_AFTER steps on."""
    speculator = Speculator(8, 1, 2, step_queries=32)
    speculator.cost = 0.6  # at one row, a draft token's share of the step
    looping = (5, 6, 7) * 3
    row, lengths = looking_up(speculator, looping), []
    for _ in range(40):
        speculator.draft([row])
        lengths.append(len(row.draft))
        row.took_draft(len(row.draft))  # every guess stands: the text loops
        row.generated += [*row.draft, looping[(len(row.tokens) + len(row.draft)) % 3]]
    assert lengths[0] == 1 and lengths[1:] == sorted(lengths[1:]) and 1 < lengths[-1] <= 8, lengths
    missing, probes = looking_up(speculator, looping), []
    for step in range(2 * PROBE_AFTER + 3):
        speculator.draft([missing])
        if missing.draft:
            probes.append(step)
        missing.took_draft(0)  # none stands
        missing.generated.append(9)
    assert probes == [0, PROBE_AFTER + 1, 2 * PROBE_AFTER + 2]


def looking_up(speculator: Speculator, prompt: tuple[int, ...]) -> Row:
    """A greedy row past its prompt, with its prompt lookup."""
    request = Submit("r", prompt, SamplingParams(temperature=0, max_tokens=200))
    row = Row(0, request, MarkerTokenizer(), frozenset(), 256, cached=len(prompt))
    row.lookup = speculator.lookup_for(row)
    return row


def always_drafting(engine: Engine) -> Engine:
    """Drafts for every row that has one, however full the step and however its drafts fared: the
    mechanics under test, not whether a draft pays."""
    engine.speculator.cost = 0.0
    engine.speculator.step_queries = 1000
    return engine


def greedy_arrivals(prompts, max_tokens, rng, **params):
    arrivals, step = [], 0
    for i, prompt in enumerate(prompts):
        request = Submit(
            f"r{i}", tuple(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, **params)
        )
        arrivals.append((step, request))
        step += rng.choice([0, 1, 2])
    return arrivals


# The decoder runner, transformers' modules, and a latent attention's (drafts as more queries over its
# latents), at transformers' initial scale: its tiny models' own (0.15) repeat too little of the looping
# prompts for most drafts to stand.
@pytest.mark.parametrize(
    "architecture, extras", [("llama", {}), ("qwen3", {}), ("deepseek_v3", {"initializer_range": 0.02})]
)
def test_greedy_output_with_drafts_is_generates_alone_and_in_a_busy_batch(architecture, extras):
    """Exact mode: drafts verified as chunks of their rows, rows joining mid-flight, prompts prefilled in
    chunks of 8 beside them; every request's tokens are `generate`'s on its prompt alone, and most of
    the drafts stood, some not."""
    model = tiny_model(architecture, **extras)
    rng = random.Random(architecture)
    prompts = LOOPING + [[rng.randrange(2, 500) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    engine = Engine(
        model, MarkerTokenizer(), rows=6, max_seq_len=128, max_prefill_tokens=8, speculative_tokens=5
    )
    always_drafting(engine)
    assert engine.speculator.enabled and not engine.runner.reads_own_positions
    pieces = drive(engine, greedy_arrivals(prompts, 40, rng))
    for i, prompt in enumerate(prompts):
        got = MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))
        assert got == reference_greedy(model, prompt, 40, engine.eos_ids), f"prompt {i} diverged"
    drafted = sum(request[-1].draft_tokens for request in pieces.values())
    accepted = sum(request[-1].accepted_draft_tokens for request in pieces.values())
    assert 0 < accepted < drafted and accepted > drafted / 3


def test_drafts_end_where_the_row_ends_and_never_write_its_last_position():
    """A row with drafts up to the end of its context or of max_tokens takes exactly what plain decoding
    takes; a stop sequence met inside a step's verified tokens ends the text there."""
    model = tiny_model("llama")
    prompt = tuple(LOOPING[0])
    plain = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=80, speculative_tokens=0)
    drafting = always_drafting(Engine(model, MarkerTokenizer(), rows=8, max_seq_len=80, speculative_tokens=8))
    texts = []
    for params in (
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),  # to the context's end
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
    ):
        expected = drive(plain, [(0, Submit("r", prompt, params))])["r"]
        got = drive(drafting, [(0, Submit("r", prompt, params))])["r"]
        assert text_of(got) == text_of(expected) and got[-1].accepted_draft_tokens > 0
        assert got[-1].finish_reason == "length"
        assert got[-1].completion_tokens == expected[-1].completion_tokens
        texts.append(text_of(expected))
    whole = MarkerTokenizer.ids(texts[0])
    # the first pair of tokens not seen before, once the text loops (and drafts come): from token 12 on
    at = next(
        i
        for i in range(12, len(whole) - 1)
        if (whole[i], whole[i + 1]) not in zip(whole[:i], whole[1:i], strict=False)
    )
    stop = f"<{whole[at]}><{whole[at + 1]}>"
    params = SamplingParams(temperature=0, max_tokens=40, stop=(stop,))
    got = drive(drafting, [(0, Submit("r", prompt, params))])["r"]
    assert MarkerTokenizer.ids(text_of(got)) == whole[:at] and got[-1].stop_sequence == stop
    assert got[-1].accepted_draft_tokens > 0


def test_logprobs_with_drafts_are_plain_decodings():
    model = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=2)
    runs = []
    for tokens in (0, 6):
        engine = always_drafting(
            Engine(model, MarkerTokenizer(), rows=2, max_seq_len=128, speculative_tokens=tokens)
        )
        runs.append(drive(engine, [(0, Submit("r", tuple(LOOPING[1]), params))])["r"])
    plain, drafted = ([entry for piece in run for entry in piece.logprobs] for run in runs)
    assert runs[1][-1].accepted_draft_tokens > 0
    assert len(drafted) == len(plain) == 30
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_rows_whose_sampling_follows_their_tokens_do_not_draft():
    """Penalties, logit_bias and min_tokens count the tokens before each position, a grammar's mask
    follows them, and a request may turn speculation off: those rows decode a token a step."""
    model = tiny_model("llama")
    engine = always_drafting(Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, speculative_tokens=6))
    for params in (
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=30, logit_bias=((3, 1.0),)),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=2),
        SamplingParams(temperature=0, max_tokens=30, speculative=False),
    ):
        pieces = drive(engine, [(0, Submit("r", tuple(LOOPING[0]), params))])["r"]
        assert pieces[-1].draft_tokens == 0 and pieces[-1].completion_tokens == 30
    pieces = drive(
        engine, [(0, Submit("r", tuple(LOOPING[0]), SamplingParams(temperature=0, max_tokens=30)))]
    )
    assert pieces["r"][-1].draft_tokens > 0  # the same prompt drafts when nothing stops it


# A Markov chain over 16 tokens: from the chain's i-th token the next is its (i + step)-th, each step with
# its probability. Drafts from prompt lookup guess one step at a time; 0.6 of them stand.
CHAIN = list(range(10, 26))
STEPS = {1: 0.6, 2: 0.25, 5: 0.15}


def markov_model() -> torch.nn.Module:
    """A tiny Llama whose next token follows from its last alone, with CHAIN's known probabilities: its
    layers add nothing (zero output projections), each chain token embeds as a unit vector, which the
    final norm scales by sqrt(64), and the head maps it to the log-probabilities of its successors (-30
    for the rest of the vocabulary)."""
    model = tiny_model("llama")
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = torch.full_like(model.lm_head.weight, -30.0)
        for i, token in enumerate(CHAIN):
            model.model.embed_tokens.weight[token, i] = 1.0
            for step, probability in STEPS.items():
                head[CHAIN[(i + step) % len(CHAIN)], i] = math.log(probability)
        model.lm_head.weight.copy_(head / hidden**0.5)
    return model


def chain_steps(prompt: list[int], tokens: list[int]) -> list[int]:
    """The step of the chain each generated token took from the token before it."""
    places = [CHAIN.index(token) for token in [prompt[-1], *tokens]]
    return [(b - a) % len(CHAIN) for a, b in zip(places, places[1:], strict=False)]


def chi_square_against_steps(samples: list[list[int]]) -> tuple[float, int]:
    """Pearson's chi-square of the steps taken at each place against STEPS' probabilities (a step outside
    them counted against an expectation of almost nothing), and its degrees of freedom."""
    statistic, places = 0.0, len(samples[0])
    for place in range(places):
        counts = collections.Counter(steps[place] for steps in samples)
        outside = sum(count for step, count in counts.items() if step not in STEPS)
        statistic += outside * 1e9  # the model gives them e**-30 each
        for step, probability in STEPS.items():
            expected = probability * len(samples)
            statistic += (counts[step] - expected) ** 2 / expected
    return statistic, places * (len(STEPS) - 1)


def chi_square_critical(freedom: int, z: float = 3.09) -> float:
    """chi-square's 0.999 quantile at these degrees of freedom (Wilson and Hilferty's approximation)."""
    return freedom * (1 - 2 / (9 * freedom) + z * (2 / (9 * freedom)) ** 0.5) ** 3


def sampled_steps(engine: Engine, prompt: list[int], seeds: range, count: int) -> tuple[list[list[int]], int]:
    """The chain steps of one request per seed at temperature 1, and the draft tokens that stood."""
    params = [SamplingParams(temperature=1, seed=seed, max_tokens=count, ignore_eos=True) for seed in seeds]
    arrivals = [(0, Submit(f"s{seed}", tuple(prompt), p)) for seed, p in zip(seeds, params, strict=True)]
    pieces = drive(engine, arrivals)
    steps = [chain_steps(prompt, MarkerTokenizer.ids(text_of(pieces[f"s{seed}"]))) for seed in seeds]
    return steps, sum(request[-1].accepted_draft_tokens for request in pieces.values())


def test_sampled_tokens_with_drafts_come_from_the_models_own_distribution(monkeypatch):
    """On a model whose every next-token distribution is known, 300 seeded requests of 10 tokens with
    drafts: the steps taken at each place fit the model's probabilities (chi-square, p = 0.001), as
    plain decoding's do; a verifier that took every draft as it came fails the same test."""
    model, prompt = markov_model(), CHAIN * 2
    plain = Engine(model, MarkerTokenizer(), rows=16, max_seq_len=64, speculative_tokens=0)
    drafting = Engine(model, MarkerTokenizer(), rows=16, max_seq_len=64, speculative_tokens=4)
    always_drafting(drafting)
    critical = chi_square_critical(10 * (len(STEPS) - 1))

    steps, _ = sampled_steps(plain, prompt, range(300), 10)
    assert chi_square_against_steps(steps)[0] < critical
    steps, accepted = sampled_steps(drafting, prompt, range(1000, 1300), 10)
    assert accepted > 300 * 10 * 0.2  # drafts stood often: a fifth of the tokens came from them
    assert chi_square_against_steps(steps)[0] < critical

    monkeypatch.setattr(
        "backend.engine.engine.verified", lambda samples, draft: [*draft, samples[len(draft)]]
    )
    steps, _ = sampled_steps(drafting, prompt, range(1000, 1300), 10)
    assert chi_square_against_steps(steps)[0] > critical


def test_seeded_output_with_drafts_is_plain_decodings_token_for_token():
    """A draw is a function of the logits, the seed and the token's number (sampler.py), and each position
    is sampled with the number of the token it would be: a seeded request gives plain decoding's tokens,
    with top-k, top-p, min-p and typical-p cuts too."""
    model = markov_model()
    prompts = [CHAIN * 2, CHAIN[5:] + CHAIN, CHAIN[::2] * 3]
    for params in (
        SamplingParams(temperature=1, seed=7, max_tokens=40),
        SamplingParams(temperature=0.9, top_k=2, seed=8, max_tokens=40),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.2, seed=9, max_tokens=40),
        SamplingParams(temperature=1.1, top_k=3, typical_p=0.7, seed=10, max_tokens=40),
    ):
        texts, accepted = [], 0
        for tokens in (0, 5):
            engine = always_drafting(
                Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, speculative_tokens=tokens)
            )
            pieces = drive(engine, [(0, Submit(f"r{i}", tuple(p), params)) for i, p in enumerate(prompts)])
            texts.append([text_of(pieces[f"r{i}"]) for i in range(len(prompts))])
            accepted += sum(request[-1].accepted_draft_tokens for request in pieces.values())
        assert texts[0] == texts[1] and accepted > 0


needs_blocks = pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")),
    reason="this CPU has no AVX2 (or no compiler): no CPU attention loop, so drafts run as chunks",
)


def decode_steps_seen(engine, monkeypatch) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Each step's decode queries whose logits it keeps, as the engine runs them: position, token and
    logits (a short prompt's tokens as decode queries keep their last's only)."""
    steps = []
    forward = engine._forward

    def recording(inputs):
        logits = forward(inputs)
        positions, tokens = inputs.layout.positions.tolist(), inputs.token_ids.tolist()
        kept = {place: i for i, place in enumerate(inputs.keep.tolist())}
        steps.append(
            [
                (p, tokens[query], logits[kept[query]].clone())
                for query, p in enumerate(positions)
                if query in kept
            ]
        )
        return logits

    monkeypatch.setattr(engine, "_forward", recording)
    return steps


@needs_blocks
def test_on_the_cpus_loop_a_draft_is_more_queries_of_its_row_with_plain_decodings_logits(monkeypatch):
    """Where each decode query reads its own row up to its own position (the CPU's loop), a row's draft
    runs as more decode queries of that row, in the decode step's own path; each query fed the tokens
    plain decoding had up to there gets the logits plain decoding got."""
    from tests.backend.test_native_decode import served_like_the_default

    model = served_like_the_default(dtype=torch.float32)
    prompt, params = tuple(LOOPING[2]), SamplingParams(temperature=0, max_tokens=40)
    runs = []
    for tokens in (0, 6):
        engine = always_drafting(
            Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128, speculative_tokens=tokens)
        )
        assert engine.runner.reads_own_positions
        steps = decode_steps_seen(engine, monkeypatch)
        runs.append((drive(engine, [(0, Submit("r", prompt, params))])["r"], steps))
    (plain, plain_steps), (drafted, drafted_steps) = runs
    assert text_of(drafted) == text_of(plain) and drafted[-1].accepted_draft_tokens > 0
    true = [*prompt, *MarkerTokenizer.ids(text_of(plain))]
    plain_logits = {position: logits for step in plain_steps for position, _, logits in step}
    compared = 0
    for step in (step for step in drafted_steps if len(step) > 1):
        for position, token, logits in step:
            if token != true[position]:
                break  # this query and those after it read a rejected draft token
            torch.testing.assert_close(logits, plain_logits[position], rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared > 20

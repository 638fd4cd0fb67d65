"""Log-probabilities, prompt scoring, penalties, biases and the other per-row filters (issue 16)."""

import math

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.logits_processors import LogitsProcessors
from backend.layers.sampler import SamplingBatch, sample
from backend.messages import InvalidParams, SamplingParams, Submit
from tests.backend.models import TINY_EOS, TINY_VOCAB, MarkerTokenizer, drive, logprobs_of, tiny_model

PROMPT = (5, 17, 42, 99, 7, 300)


def engine_and_model(rows: int = 4):
    model = tiny_model()
    return Engine(model, MarkerTokenizer(), rows=rows, max_seq_len=64), model


def run(engine, *requests: tuple[str, tuple[int, ...], SamplingParams]) -> dict[str, list]:
    return drive(engine, [(0, Submit(request_id, prompt, params)) for request_id, prompt, params in requests])


def reference_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence: [len, vocab] log-probabilities."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_greedy_logprobs_are_the_models_log_softmax_with_the_top_alternatives():
    engine, model = engine_and_model()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    pieces = run(engine, ("a", PROMPT, params))["a"]
    entries = logprobs_of(pieces)
    generated = [entry.token_id for entry in entries]
    assert len(entries) == pieces[-1].completion_tokens == 6
    reference = reference_log_softmax(model, [*PROMPT, *generated])
    for i, entry in enumerate(entries):
        expected = reference[len(PROMPT) - 1 + i]
        assert entry.token_id == int(expected.argmax())  # greedy: the top token was chosen
        assert entry.rank == 1
        assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=1e-4)
        top_values, top_ids = expected.topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_sampled_logprobs_are_those_of_the_raw_logits_not_of_the_temperature():
    engine, model = engine_and_model()
    params = SamplingParams(temperature=1.7, top_k=5, max_tokens=4, ignore_eos=True, seed=3, logprobs=0)
    entries = logprobs_of(run(engine, ("a", PROMPT, params))["a"])
    reference = reference_log_softmax(model, [*PROMPT, *(e.token_id for e in entries)])
    for i, entry in enumerate(entries):
        assert entry.top == ()
        assert entry.logprob == pytest.approx(float(reference[len(PROMPT) - 1 + i, entry.token_id]), abs=1e-4)


def test_prompt_scoring_without_generating_gives_every_prompt_token_after_the_first():
    engine, model = engine_and_model()
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    # ignore_eos: a random model may sample EOS (a "stop" after fewer tokens; it happened once in CI)
    other = SamplingParams(max_tokens=3, ignore_eos=True)
    pieces = run(engine, ("score", PROMPT, params), ("other", PROMPT, other))
    [piece] = pieces["score"]
    assert piece.finish_reason == "length" and piece.completion_tokens == 0 and piece.text == ""
    scores = piece.prompt_logprobs
    assert scores[0] is None and len(scores) == len(PROMPT)
    reference = reference_log_softmax(model, list(PROMPT))
    for i, entry in enumerate(scores[1:]):
        assert entry.token_id == PROMPT[i + 1]
        assert entry.logprob == pytest.approx(float(reference[i, PROMPT[i + 1]]), abs=1e-4)
        assert len(entry.top) == 2
        # vLLM's rank: the tokens at least as likely as the prompt's, itself included
        sorted_ids = reference[i].argsort(descending=True).tolist()
        assert entry.rank == sorted_ids.index(PROMPT[i + 1]) + 1
    assert pieces["other"][-1].completion_tokens == 3  # a request in the same step was not disturbed


def test_max_tokens_below_zero_is_refused():
    with pytest.raises(InvalidParams) as error:
        SamplingParams(max_tokens=-1)
    assert error.value.param == "max_tokens"


def test_a_bias_of_minus_100_never_lets_a_token_out_and_plus_100_forces_one():
    engine, model = engine_and_model()
    free = run(engine, ("free", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    greedy_tokens = MarkerTokenizer.ids("".join(p.text for p in free["free"]))
    banned = greedy_tokens[0]
    params = SamplingParams(
        temperature=1.0, max_tokens=30, ignore_eos=True, seed=1, logit_bias=((banned, -100.0),), logprobs=0
    )
    forced = SamplingParams(
        temperature=1.0, max_tokens=5, ignore_eos=True, seed=1, logit_bias=((123, 100.0),)
    )
    pieces = run(engine, ("banned", PROMPT, params), ("forced", PROMPT, forced))
    assert banned not in [entry.token_id for entry in logprobs_of(pieces["banned"])]
    assert MarkerTokenizer.ids("".join(p.text for p in pieces["forced"])) == [123] * 5


def test_penalties_follow_their_formulas_per_row():
    processors = LogitsProcessors(rows=2, max_seq_len=16, vocab=TINY_VOCAB, device=torch.device("cpu"))
    frequency = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    repetition = SamplingParams(repetition_penalty=2.0)
    processors.admit(0, frequency, (1, 2))
    processors.admit(1, repetition, (3,))
    processors.record([0, 1], [2, 1], torch.tensor([7, 4]))  # each row's first generated token
    processors.record([0], [3], torch.tensor([7]))
    processors.record([0], [4], torch.tensor([9]))  # row 0 generated 7, 7, 9
    logits = torch.full((3, TINY_VOCAB), 2.0)
    logits[:, 3] = -2.0
    processors.apply(logits, [0, 2], [0, 1], [frequency, repetition], [2, 1], [[7, 7, 9], [4]], frozenset())
    expected_frequency = torch.full((TINY_VOCAB,), 2.0)
    expected_frequency[3] = -2.0
    expected_frequency[7] -= 0.5 * 2 + 0.25
    expected_frequency[9] -= 0.5 * 1 + 0.25  # the prompt (1, 2) counts for neither
    assert torch.equal(logits[0], expected_frequency)
    assert torch.equal(logits[1], torch.where(torch.arange(TINY_VOCAB) == 3, -2.0, 2.0))  # not penalized
    expected_repetition = torch.full((TINY_VOCAB,), 2.0)
    expected_repetition[3] = -4.0  # a prompt token, below zero: times the penalty
    expected_repetition[4] = 1.0  # a generated token, above zero: divided by it
    assert torch.equal(logits[2], expected_repetition)
    assert SamplingParams().penalized is False


def test_penalized_rows_in_one_step_each_get_their_own():
    engine, model = engine_and_model(rows=4)
    prompt = (9, 9, 9, 9)
    repetitive = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    penalized = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, frequency_penalty=2.0
    )
    alone = run(engine, ("alone", prompt, repetitive))
    together = run(engine, ("plain", prompt, repetitive), ("penalized", prompt, penalized))
    tokens = {name: [e.token_id for e in logprobs_of(pieces)] for name, pieces in together.items()}
    assert tokens["plain"] == [e.token_id for e in logprobs_of(alone["alone"])]  # untouched by its neighbour
    # Greedy under the penalty, by hand: each token the best after 2 off for each earlier use.
    reference = reference_log_softmax(model, [*prompt, *tokens["penalized"]])
    for i, token in enumerate(tokens["penalized"]):
        counts = torch.bincount(torch.tensor(tokens["penalized"][:i], dtype=torch.long), minlength=TINY_VOCAB)
        assert token == int((reference[len(prompt) - 1 + i] - 2.0 * counts).argmax())
    assert len(set(tokens["penalized"])) > len(set(tokens["plain"]))


def test_min_tokens_holds_back_eos_and_stop_token_ids():
    engine, _ = engine_and_model()
    stop_at_once = SamplingParams(
        temperature=1.0, max_tokens=20, seed=5, logit_bias=((TINY_EOS, 100.0), (77, 90.0)), min_tokens=4
    )
    stop_token = SamplingParams(
        temperature=1.0, max_tokens=20, seed=5, logit_bias=((77, 100.0),), stop_token_ids=(77,), logprobs=0
    )
    pieces = run(engine, ("eos", PROMPT, stop_at_once), ("stop-id", PROMPT, stop_token))
    assert pieces["eos"][-1].finish_reason == "stop" and pieces["eos"][-1].completion_tokens == 5
    last = pieces["stop-id"][-1]
    assert last.finish_reason == "stop" and last.completion_tokens == 1 and last.text == ""
    assert [entry.token_id for entry in logprobs_of(pieces["stop-id"])] == [77]


def test_min_p_cuts_tokens_below_its_share_of_the_best():
    logits = torch.tensor([[0.0, math.log(0.5), math.log(0.1), math.log(0.05)]] * 64)
    batch = SamplingBatch(
        temperature=[1.0] * 64,
        top_k=[0] * 64,
        top_p=[1.0] * 64,
        seeds=list(range(64)),
        counters=[0] * 64,
        min_p=[0.2] * 64,
    )
    drawn = set(sample(logits, batch).tolist())
    assert drawn == {0, 1}  # 0.1 and 0.05 of the best are under 0.2 of it; both others are drawn


def test_a_row_with_a_tiny_typical_p_takes_the_token_nearest_the_entropy_each_step_whatever_its_seed():
    """typical_p keeps the tokens whose surprise is nearest the distribution's entropy: at 0.001 that one
    alone, so two seeds give the same tokens, each the nearest in the model's own distribution there, and
    a row beside it without the cut draws from the whole vocabulary."""
    engine, model = engine_and_model()
    typical = [
        SamplingParams(temperature=1.0, typical_p=0.001, seed=seed, max_tokens=8, ignore_eos=True, logprobs=0)
        for seed in (1, 2)
    ]
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logprobs=0)
    pieces = run(engine, ("a", PROMPT, typical[0]), ("b", PROMPT, typical[1]), ("free", PROMPT, free))
    tokens = {name: [entry.token_id for entry in logprobs_of(pieces[name])] for name in pieces}
    assert tokens["a"] == tokens["b"] != tokens["free"] and len(tokens["a"]) == 8
    reference = reference_log_softmax(model, [*PROMPT, *tokens["a"]])[len(PROMPT) - 1 : -1]
    entropy = -(reference * reference.exp()).sum(-1, keepdim=True)
    distance = (-reference - entropy).abs()
    chosen = distance.gather(-1, torch.tensor(tokens["a"]).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(chosen, distance.min(-1).values, atol=1e-4)


def test_typical_p_must_be_over_0_and_at_most_1():
    for typical_p in (0.0, -0.5, 1.5):
        with pytest.raises(InvalidParams, match="typical_p"):
            SamplingParams(typical_p=typical_p)


def test_logprobs_taken_a_few_positions_at_a_time_are_those_of_the_whole(monkeypatch):
    """On a CPU token_logprobs takes as many positions as fit CPU_CHUNK_BYTES of float32 at once (3 here,
    so that 50 cross many chunks): each entry is still its position's log_softmax, rank and best."""
    from backend.layers import logprobs
    from backend.layers.logprobs import positions_at_a_time, token_logprobs

    torch.manual_seed(3)
    logits = torch.randn(50, 1000) * 4
    tokens = torch.randint(0, 1000, (50,))
    tops = [i % 6 for i in range(50)]
    monkeypatch.setattr(logprobs, "CPU_CHUNK_BYTES", 3 * 1000 * 4)
    assert positions_at_a_time(logits) == 3
    entries = token_logprobs(logits, tokens, tops)
    reference = logits.log_softmax(-1)
    for i, entry in enumerate(entries):
        best = reference[i].topk(tops[i])
        assert entry.token_id == tokens[i] and math.isclose(
            entry.logprob, reference[i, tokens[i]], abs_tol=1e-5
        )
        assert entry.rank == int((reference[i] >= reference[i, tokens[i]]).sum())
        assert [token for token, _ in entry.top] == best.indices.tolist()
    monkeypatch.undo()
    # The default model's 49,152 tokens: 21 positions in 4 MiB; a GPU's (here a meta tensor's) 256.
    assert positions_at_a_time(torch.empty(1, 49152)) == 21
    assert positions_at_a_time(torch.empty(1, 49152, device="meta")) == 256


def test_out_of_vocabulary_bias_and_stop_ids_are_rejected():
    engine, _ = engine_and_model()
    params = SamplingParams(logit_bias=((TINY_VOCAB + 5, 1.0),))
    [piece] = run(engine, ("bad", PROMPT, params))["bad"]
    assert piece.finish_reason == "error" and "vocabulary" in piece.error


def test_allowed_token_ids_are_the_only_tokens_a_row_samples_and_greedy_takes_the_best_of_them():
    """vLLM's allowed_token_ids, sampled and greedy, beside a row without it in the same steps; a bias
    of +100 on a token the list leaves out does not let it in."""
    engine, model = engine_and_model()
    allowed = (11, 23, 57, 301)
    sampled = SamplingParams(
        temperature=1.5, max_tokens=24, ignore_eos=True, seed=5, allowed_token_ids=allowed, logprobs=0
    )
    reference = reference_log_softmax(model, list(PROMPT))[-1]
    outside = int(reference.argmax())  # the model's own best, which the list leaves out
    allowed = tuple(t for t in allowed if t != outside)
    greedy = SamplingParams(
        temperature=0, max_tokens=1, allowed_token_ids=allowed, logit_bias=((outside, 100.0),), logprobs=0
    )
    plain = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    pieces = run(engine, ("sampled", PROMPT, sampled), ("greedy", PROMPT, greedy), ("plain", PROMPT, plain))
    tokens = [entry.token_id for entry in logprobs_of(pieces["sampled"])]
    assert len(tokens) == 24 and set(tokens) <= set(allowed) and len(set(tokens)) > 1
    best_allowed = max(allowed, key=lambda t: float(reference[t]))
    assert [entry.token_id for entry in logprobs_of(pieces["greedy"])] == [best_allowed]
    assert [entry.token_id for entry in logprobs_of(pieces["plain"])] == [outside]


def test_allowed_token_ids_outside_the_vocabulary_or_only_held_back_ends_are_refused():
    engine, _ = engine_and_model()
    outside = SamplingParams(allowed_token_ids=(5, TINY_VOCAB))
    ends_only = SamplingParams(allowed_token_ids=(TINY_EOS,), min_tokens=2)
    pieces = run(engine, ("outside", PROMPT, outside), ("ends", PROMPT, ends_only))
    for request_id in ("outside", "ends"):
        [piece] = pieces[request_id]
        assert piece.finish_reason == "error" and piece.invalid == "allowed_token_ids", piece.error
    with pytest.raises(InvalidParams) as error:
        SamplingParams(allowed_token_ids=(5,), grammar='{"grammars": []}')
    assert error.value.param == "allowed_token_ids"


def test_bad_words_ban_a_words_last_token_right_after_its_others_and_the_prompt_does_not_count():
    engine, model = engine_and_model()
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    free = [e.token_id for e in logprobs_of(run(engine, ("free", PROMPT, SamplingParams(**greedy)))["free"])]
    two_tokens = SamplingParams(**greedy, bad_words=((free[2], free[3]),))
    one_token = SamplingParams(**greedy, bad_words=((free[0],),))
    across_the_prompt = SamplingParams(**greedy, bad_words=((PROMPT[-1], free[0]),))
    after_another = SamplingParams(**greedy, bad_words=(((free[2] + 1) % TINY_VOCAB, free[3]),))
    requests = {"two": two_tokens, "one": one_token, "prompt": across_the_prompt, "another": after_another}
    pieces = run(engine, *((name, PROMPT, params) for name, params in requests.items()))
    tokens = {name: [e.token_id for e in logprobs_of(found)] for name, found in pieces.items()}
    assert tokens["prompt"] == tokens["another"] == free
    assert tokens["two"][:3] == free[:3]
    reference = reference_log_softmax(model, [*PROMPT, *free[:3]])[-1]
    reference[free[3]] = float("-inf")
    assert tokens["two"][3] == int(reference.argmax())
    assert tokens["one"][0] != free[0] and free[0] not in tokens["one"]


def test_bad_words_outside_the_vocabulary_are_refused():
    engine, _ = engine_and_model()
    [piece] = run(engine, ("bad", PROMPT, SamplingParams(bad_words=((5, TINY_VOCAB + 1),))))["bad"]
    assert piece.finish_reason == "error" and piece.invalid == "bad_words"
    for words in (((),), ((5,),)):
        with pytest.raises(InvalidParams) as error:
            SamplingParams(bad_words=words, grammar='{"grammars": []}' if words == ((5,),) else None)
        assert error.value.param == "bad_words"


def test_pieces_name_their_tokens_when_asked_and_add_up_to_the_requests():
    """SamplingParams.token_ids (vLLM's return_token_ids): each piece carries the ids of the tokens since
    the last one, which add up to the logprobs' tokens; a request that does not ask gets none."""
    engine, _ = engine_and_model()
    asked = SamplingParams(temperature=1.0, seed=2, max_tokens=9, ignore_eos=True, logprobs=0, token_ids=True)
    plain = SamplingParams(temperature=1.0, seed=2, max_tokens=9, ignore_eos=True)
    pieces = run(engine, ("asked", PROMPT, asked), ("plain", PROMPT, plain))
    named = [token for piece in pieces["asked"] for token in piece.token_ids]
    assert named == [entry.token_id for entry in logprobs_of(pieces["asked"])] and len(named) == 9
    assert all(piece.token_ids == () for piece in pieces["plain"])

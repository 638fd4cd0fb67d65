"""Speculative decoding with a draft model (engine/draft_model.py): a small model's greedy guesses are the
drafts, and output is still the output of plain decoding, greedy and seeded (SPEC §5)."""

import copy
import random

import pytest
import torch

from backend.engine import draft_model
from backend.engine.draft_model import DraftModel, Guessing, common_prefix
from backend.engine.engine import Engine
from backend.messages import BackendConfig, SamplingParams, Submit
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, reference_greedy, text_of, tiny_model
from tests.backend.test_speculation import (
    CHAIN,
    LOOPING,
    always_drafting,
    chi_square_against_steps,
    chi_square_critical,
    greedy_arrivals,
    markov_model,
    sampled_steps,
)


def nudged(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of `model` with noise added to its weights: a draft that mostly agrees with it, not always."""
    generator = torch.Generator().manual_seed(seed)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return copied


def drafting_engine(
    model, draft, rows: int = 4, max_seq_len: int = 128, tokens: int = 4, **options
) -> Engine:
    """An engine whose rows all draft with `draft`, however their drafts fare (the mechanics under test);
    `draft` None: prompt lookup's drafts."""
    engine = Engine(
        model,
        MarkerTokenizer(),
        rows=rows,
        max_seq_len=max_seq_len,
        speculative_tokens=tokens,
        draft_model=draft,
        **options,
    )
    return always_drafting(engine)


def drafted_and_accepted(pieces: dict) -> tuple[int, int]:
    return (
        sum(request[-1].draft_tokens for request in pieces.values()),
        sum(request[-1].accepted_draft_tokens for request in pieces.values()),
    )


def test_a_draft_equal_to_the_served_model_has_every_guess_stand():
    """The bookkeeping alone: the draft's cache holds what each row holds, so its guesses are the served
    model's own greedy tokens, and every one stands."""
    model = tiny_model("llama")
    engine = drafting_engine(model, nudged(model, 0))
    assert engine.speculator.draft_model is not None and engine.speculator.enabled
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    pieces = drive(engine, greedy_arrivals(prompts, 30, rng))
    for i, prompt in enumerate(prompts):
        assert MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == reference_greedy(
            model, prompt, 30, engine.eos_ids
        )
    drafted, accepted = drafted_and_accepted(pieces)
    assert drafted > 6 * 30 / 2 and accepted == drafted


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_greedy_output_with_a_draft_model_is_generates_in_a_busy_batch(architecture, monkeypatch):
    """Exact mode, a draft that mostly agrees: more requests than rows (a row's draft row serves several
    requests, some sharing a prefix), rows joining mid-flight, prompts prefilled in chunks of 8 and caught
    up by the draft 8 tokens a step, all rows together; every request's tokens are `generate`'s, some
    guesses missed."""
    monkeypatch.setattr(draft_model, "CATCH_UP_TOKENS", 8)
    model = tiny_model(architecture)
    rng = random.Random(architecture)
    shared = [rng.randrange(2, 500) for _ in range(20)]
    prompts = LOOPING + [
        shared + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 20))] for _ in range(5)
    ]
    engine = drafting_engine(model, nudged(model, 0.05), tokens=5, max_prefill_tokens=8)
    pieces = drive(engine, greedy_arrivals(prompts, 30, rng))
    for i, prompt in enumerate(prompts):
        got = MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))
        assert got == reference_greedy(model, prompt, 30, engine.eos_ids), f"prompt {i} diverged"
    drafted, accepted = drafted_and_accepted(pieces)
    assert 0 < accepted < drafted and accepted > drafted / 3


def test_seeded_output_with_a_draft_model_is_plain_decodings_and_sampled_tokens_keep_the_distribution():
    """A seeded request gives plain decoding's tokens with a draft model's guesses; 300 unseeded-like
    requests on a model whose next-token distributions are known fit them (chi-square, p = 0.001)."""
    model = markov_model()
    prompts = [CHAIN * 2, CHAIN[5:] + CHAIN, CHAIN[::2] * 3]
    params = SamplingParams(temperature=0.9, top_k=2, seed=8, max_tokens=40)
    texts, accepted = [], 0
    for draft in (None, nudged(model, 0)):
        engine = drafting_engine(model, draft, tokens=5)
        pieces = drive(engine, [(0, Submit(f"r{i}", tuple(p), params)) for i, p in enumerate(prompts)])
        texts.append([text_of(pieces[f"r{i}"]) for i in range(len(prompts))])
        accepted += drafted_and_accepted(pieces)[1]
    assert texts[0] == texts[1] and accepted > 0

    drafting = drafting_engine(model, nudged(model, 0), rows=16, max_seq_len=64)
    steps, accepted = sampled_steps(drafting, CHAIN * 2, range(2000, 2300), 10)
    assert accepted > 300 * 10 * 0.2  # the draft guesses the likeliest step, 0.6
    assert chi_square_against_steps(steps)[0] < chi_square_critical(10 * 2)


def test_a_failing_draft_pass_drafts_nothing_and_the_rows_go_on(monkeypatch):
    """The draft model's first three passes raise: those steps run without drafts, the row's text is
    plain decoding's, and its drafts come back once the draft model runs again."""
    model = tiny_model("llama")
    engine = drafting_engine(model, nudged(model, 0), rows=2)
    runner, failures = engine.speculator.draft_model.runner, []
    run = runner.run

    def failing_at_first(inputs):
        if len(failures) < 3:
            failures.append(inputs)
            raise RuntimeError("a kernel broke")
        return run(inputs)

    monkeypatch.setattr(runner, "run", failing_at_first)
    params = SamplingParams(temperature=0, max_tokens=30)
    pieces = drive(engine, [(0, Submit("r", tuple(LOOPING[0]), params))])
    assert MarkerTokenizer.ids(text_of(pieces["r"])) == reference_greedy(
        model, LOOPING[0], 30, engine.eos_ids
    )
    assert len(failures) == 3 and pieces["r"][-1].accepted_draft_tokens > 0


def test_guesses_stop_where_the_drafts_context_ends_and_where_the_served_model_has_no_logit():
    model = tiny_model("llama")
    drafts = DraftModel(nudged(model, 0), rows=2, max_seq_len=40, vocab_size=TINY_VOCAB)
    # 35 tokens: guesses at positions 35 to 38 of 40, the last never written
    guesses = drafts.propose([Guessing(0, tuple(range(2, 37)), 8), Guessing(1, (4, 5), 3)])
    assert [len(guess) for guess in guesses] == [4, 3]
    assert drafts.held[0] == (*range(2, 37), *guesses[0][:3]) and drafts.held[1] == (4, 5, *guesses[1][:2])
    drafts.vocab_size = 300  # a draft vocabulary padded past the served model's
    assert drafts._verifiable([3, 299, 300, 5]) == (3, 299)
    assert common_prefix((1, 2, 3), (1, 2, 4, 5), 9) == 2 and common_prefix((1, 2), (1, 2), 1) == 1


def test_a_draft_model_loads_in_the_default_mode_and_one_of_another_vocabulary_is_refused(tmp_path):
    """The served model in the exact mode, the draft model as `--draft-model` loads it: the default mode's
    dtype whatever --dtype says, a cache as long as the served model's; a draft model whose tokenizer
    gives other ids is refused at start-up with the reason."""
    from dataclasses import replace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from backend.model.loader import load_draft_model, pick_dtype
    from tests.backend.models import TINY_EOS, load_on_cpu, write_tiny_causal_lm

    served_dir = write_tiny_causal_lm(tmp_path / "served", "llama")
    draft_dir = write_tiny_causal_lm(tmp_path / "draft", "llama")
    served = load_on_cpu(served_dir, tmp_path)
    config = BackendConfig(
        model=str(served_dir),
        dtype="float32",
        quantize="none",
        device="cpu",
        rows=4,
        max_seq_len=128,
        cache_dir=str(tmp_path / "cache"),
        draft_model=str(draft_dir),
    )
    draft = load_draft_model(config, served)
    assert draft.max_seq_len == served.max_seq_len == 128
    assert draft.model.dtype == pick_dtype("auto", torch.device("cpu"))

    other = {f"[{i}]": i for i in range(TINY_VOCAB)}  # the same size, other words
    tokenizer = Tokenizer(models.WordLevel(other, unk_token="[0]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"[{TINY_EOS}]").save_pretrained(draft_dir)
    with pytest.raises(ValueError, match="vocabulary is not the served model's"):
        load_draft_model(replace(config, cache_dir=str(tmp_path / "cache2")), served)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_a_draft_model_on_cuda_with_captured_graphs_gives_plain_decodings_text():
    """The served model and its draft on a GPU, each with its decode steps captured as CUDA graphs (the
    draft's decode passes replay them, its catch-up chunks and the verifying steps run eagerly): greedy
    rows joining mid-flight give the text of plain eager decoding, and most guesses stand."""
    model = tiny_model("llama")
    rng = random.Random(5)
    prompts = LOOPING + [[rng.randrange(2, 500) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    arrivals = greedy_arrivals(prompts, 30, rng)
    plain = Engine(
        copy.deepcopy(model).to("cuda"), MarkerTokenizer(), rows=4, max_seq_len=128, cuda_graphs=False
    )
    drafting = drafting_engine(copy.deepcopy(model).to("cuda"), nudged(model, 0.05).to("cuda"))
    drafting.warm_up()
    assert drafting.speculator.draft_model.runner.decodes_in_graphs
    expected, got = drive(plain, arrivals), drive(drafting, arrivals)
    assert {r: text_of(p) for r, p in got.items()} == {r: text_of(p) for r, p in expected.items()}
    drafted, accepted = drafted_and_accepted(got)
    assert accepted > drafted / 3


def test_new_prompts_catch_up_in_the_draft_a_bounded_number_of_tokens_a_step():
    """Two new 400-token rows: the first step's pass takes CATCH_UP_TOKENS (512) of their tokens, so the
    second row drafts nothing yet; the next step it catches up the rest and guesses."""
    drafts = DraftModel(nudged(tiny_model("llama"), 0), rows=2, max_seq_len=512, vocab_size=TINY_VOCAB)
    rows = [Guessing(index, tuple(range(2 + index, 402 + index)), 2) for index in range(2)]
    first = drafts.propose(rows)
    assert len(first[0]) == 2 and first[1] == () and len(drafts.held[1]) == 512 - 400
    second = drafts.propose(rows)
    assert second[0] == first[0] and len(second[1]) == 2 and drafts.held[1][:400] == rows[1].tokens

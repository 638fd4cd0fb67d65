"""Embedding requests in the engine: pooled hidden states, batched beside decoding rows, from the served
model or from a separate embedding model (`--embedding-model`)."""

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from backend.engine.engine import Engine
from backend.messages import BackendConfig, SamplingParams, Submit
from backend.model.loader import load_embedding_model
from tests.backend.models import (
    TINY_BERT_POSITIONS,
    MarkerTokenizer,
    drive,
    reference_greedy,
    text_of,
    tiny_model,
    write_tiny_bert,
)

PROMPTS = [tuple(range(5, 5 + n)) for n in (3, 17, 9, 30)]


def alone(model, prompt: tuple[int, ...], pooling: str) -> torch.Tensor:
    """The prompt's embedding computed by itself, with no padding, straight from transformers."""
    with torch.no_grad():
        hidden = model.base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=-1)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_each_prompt_of_a_padded_batch_is_embedded_as_it_is_alone(architecture, pooling):
    model = tiny_model(architecture)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=1000)
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Submit(f"e{i}", prompt, SamplingParams(embedding=pooling)))
    pieces = {piece.request_id: piece for piece in engine.step()}  # all four in one batch
    assert not engine.has_work
    for i, prompt in enumerate(PROMPTS):
        piece = pieces[f"e{i}"]
        assert piece.finish_reason == "stop" and piece.prompt_tokens == len(prompt) and piece.text == ""
        vector = torch.tensor(piece.embedding)
        assert vector.shape == (model.config.get_text_config().hidden_size,)
        torch.testing.assert_close(vector, alone(model, prompt, pooling), atol=1e-5, rtol=1e-4)


def test_embeddings_are_served_beside_decoding_within_the_prefill_budget():
    model = tiny_model("llama")
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=20)
    engine.submit(Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    engine.step()  # prefilled: decoding from now on
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Submit(f"e{i}", prompt, SamplingParams(embedding="mean")))
    embedded_per_step = []
    for _ in range(4):
        pieces = engine.step()
        assert any(p.request_id == "decode" and p.text for p in pieces)  # the row got its token
        embedded_per_step.append([p.prompt_tokens for p in pieces if p.embedding is not None])
    # At most 20 prompt tokens a step, and at least one prompt: 3 + 17, then 9 (30 more would pass
    # 20), then 30 alone, over the budget.
    assert embedded_per_step == [[3, 17], [9], [30], []]
    # Timed beside the decoding row, for budgets sized by time (none here: the budget is a number).
    assert engine.prefill_budget.embedding_tokens_seen is not None


def test_a_cancelled_embedding_request_ends_cancelled():
    engine = Engine(tiny_model("llama"), MarkerTokenizer(), rows=2, max_seq_len=64)
    engine.submit(Submit("e", (1, 2, 3), SamplingParams(embedding="mean")))
    engine.cancel("e")
    assert [(p.request_id, p.finish_reason) for p in engine.step()] == [("e", "cancelled")]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A separate sentence-embedding model (`--embedding-model`) as the backend loads it."""
    directory = write_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")
    return directory, load_embedding_model(BackendConfig(embedding_model=str(directory), device="cpu"))


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_separate_embedding_model_embeds_while_the_served_model_generates(tiny_bert, pooling):
    directory, embedding_model = tiny_bert
    assert embedding_model.name == "tiny-bert" and embedding_model.max_tokens == TINY_BERT_POSITIONS
    assert embedding_model.tokenizer_path == str(directory.resolve())
    model = tiny_model("llama")
    engine = Engine(
        model,
        MarkerTokenizer(),
        rows=2,
        max_seq_len=128,
        max_prefill_tokens=1000,
        embedding_model=embedding_model,
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today!", "a"]
    prompts = [tuple(tokenizer(text).input_ids) for text in texts]
    assert len({len(prompt) for prompt in prompts}) == 3  # a right-padded batch
    generating = Submit("g", (3, 4, 5), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    pieces = drive(
        engine,
        [(0, generating)]
        + [
            (0, Submit(f"e{i}", prompt, SamplingParams(embedding=pooling)))
            for i, prompt in enumerate(prompts)
        ],
    )
    reference = AutoModel.from_pretrained(directory).eval()  # transformers, straight from the directory
    for i, prompt in enumerate(prompts):
        (piece,) = pieces[f"e{i}"]
        assert piece.finish_reason == "stop" and piece.prompt_tokens == len(prompt)
        vector = torch.tensor(piece.embedding)
        assert vector.shape == (reference.config.hidden_size,)
        torch.testing.assert_close(vector, alone(reference, prompt, pooling), atol=1e-5, rtol=1e-4)
    assert MarkerTokenizer.ids(text_of(pieces["g"])) == reference_greedy(model, (3, 4, 5), 8, engine.eos_ids)


def test_the_embedding_model_bounds_its_own_inputs(tiny_bert):
    _, embedding_model = tiny_bert
    engine = Engine(
        tiny_model("llama"), MarkerTokenizer(), rows=2, max_seq_len=128, embedding_model=embedding_model
    )
    past_its_vocabulary = (2, embedding_model.vocab_size, 3)  # within the served model's 512
    requests = {
        "longest": (2,) * TINY_BERT_POSITIONS,
        "too-long": (2,) * (TINY_BERT_POSITIONS + 1),
        "past-vocabulary": past_its_vocabulary,
    }
    for request_id, prompt in requests.items():
        engine.submit(Submit(request_id, prompt, SamplingParams(embedding="mean")))
    engine.submit(Submit("generating", past_its_vocabulary, SamplingParams(max_tokens=1)))
    pieces = {request_id: p[-1] for request_id, p in drive(engine, []).items()}
    assert pieces["longest"].embedding is not None
    assert (
        pieces["too-long"].finish_reason == "error" and str(TINY_BERT_POSITIONS) in pieces["too-long"].error
    )
    assert (
        pieces["past-vocabulary"].finish_reason == "error" and "vocabulary" in pieces["past-vocabulary"].error
    )
    assert pieces["generating"].finish_reason == "length"


def test_the_embedding_model_needs_a_name_of_its_own(tiny_bert):
    with pytest.raises(ValueError, match="tiny-bert"):
        Engine(tiny_model("llama"), MarkerTokenizer(), rows=1, name="tiny-bert", embedding_model=tiny_bert[1])


def test_a_model_that_cannot_embed_is_refused_at_start_up(tiny_bert, tmp_path):
    from transformers import T5Config, T5Model

    directory, _ = tiny_bert
    T5Model(T5Config(vocab_size=80, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)).save_pretrained(
        tmp_path / "t5"
    )
    AutoTokenizer.from_pretrained(directory).save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match="T5Model cannot embed"):  # an encoder-decoder wants decoder inputs
        load_embedding_model(BackendConfig(embedding_model=str(tmp_path / "t5"), device="cpu"))


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_prompt_longer_than_the_budget_is_embedded_a_chunk_a_step_as_it_is_whole(architecture, pooling):
    """Beside a decoding row, a prompt longer than the step's budget goes a chunk a step (each chunk
    reading the earlier ones from its own cache) instead of holding the row's next token for its whole
    pass: a step embeds at most the budget, and the vector is the one a single pass gives."""
    model = tiny_model(architecture)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=16)
    engine.submit(Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    engine.step()
    long = tuple(range(7, 7 + 50))
    engine.submit(Submit("long", long, SamplingParams(embedding=pooling)))
    engine.submit(Submit("short", (9, 8, 7), SamplingParams(embedding=pooling)))
    finished = []
    for step in range(5):
        pieces = engine.step()
        assert any(p.request_id == "decode" and p.text for p in pieces)  # the row got its token each step
        finished += [(step, p) for p in pieces if p.embedding is not None]
    assert [(step, piece.request_id) for step, piece in finished] == [(3, "long"), (3, "short")]
    # 16 tokens a step: 16, 16, 16, then the last 2 and the short one whole.
    vectors = {piece.request_id: torch.tensor(piece.embedding) for _, piece in finished}
    torch.testing.assert_close(vectors["long"], alone(model, long, pooling), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(vectors["short"], alone(model, (9, 8, 7), pooling), atol=1e-5, rtol=1e-4)


def test_a_cancelled_request_being_embedded_a_chunk_a_step_ends_and_frees_its_cache():
    engine = Engine(tiny_model("llama"), MarkerTokenizer(), rows=2, max_seq_len=128, max_prefill_tokens=8)
    engine.submit(Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    engine.step()
    engine.submit(Submit("long", tuple(range(5, 45)), SamplingParams(embedding="mean")))
    engine.step()
    assert engine.embedding_job is not None
    engine.cancel("long")
    pieces = engine.step()
    assert ("long", "cancelled") in [(p.request_id, p.finish_reason) for p in pieces]
    assert engine.embedding_job is None

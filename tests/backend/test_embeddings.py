"""Embedding requests in the engine: pooled hidden states, batched beside decoding rows, from the served
model or from a separate embedding model (`--embedding-model`)."""

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from backend.engine.engine import Engine
from backend.messages import BackendConfig, SamplingParams, Submit
from backend.model.loader import load_embedding_model
from backend.quant import block_weights
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

needs_blocks = pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")),
    reason="this CPU has no AVX2 (or no compiler): no CPU attention loop, so embedding inputs go as chunks",
)


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


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])  # the decoder runner, transformers' forward
def test_embeddings_beside_decoding_go_into_the_steps_own_forward_pass(architecture, monkeypatch):
    """While a row decodes, each step's one forward pass also carries an embedding input's chunk, within
    what the prefill budget leaves: one input at a time, no pass of its own (which would cost the
    decoding row about three steps), the row's tokens those of `generate` and each vector the one a
    single pass of the input gives."""
    model = tiny_model(architecture)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=20)
    engine.submit(Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    decoded = [p for p in engine.step() if p.request_id == "decode"]  # prefilled: decoding from now on
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Submit(f"e{i}", prompt, SamplingParams(embedding="mean")))

    def no_pass_of_its_own(*args, **kwargs):
        raise AssertionError("an embedding pass of its own while a row decodes")

    monkeypatch.setattr("backend.engine.engine.embed", no_pass_of_its_own)
    forward, passes = engine._forward, []

    def recording(inputs):
        passes.append(len(inputs.embedded or ()))
        return forward(inputs)

    engine._forward = recording
    embedded_per_step, vectors = [], {}
    for _ in range(6):
        passes.append("step")
        pieces = engine.step()
        decoded += [p for p in pieces if p.request_id == "decode"]
        assert any(p.request_id == "decode" and p.text for p in pieces)  # the row got its token
        embedded_per_step.append([p.prompt_tokens for p in pieces if p.embedding is not None])
        vectors |= {p.request_id: torch.tensor(p.embedding) for p in pieces if p.embedding is not None}
    # One input at a time, 20 tokens a step at most: 3, 17, 9, then 30 in two chunks.
    assert embedded_per_step == [[3], [17], [9], [], [30], []]
    assert passes == ["step", 3, "step", 17, "step", 9, "step", 20, "step", 10, "step", 0]
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(vectors[f"e{i}"], alone(model, prompt, "mean"), atol=1e-5, rtol=1e-4)
    tokens = MarkerTokenizer.ids(text_of(decoded))  # 7 of them: the prefill's, then a step's each
    assert len(tokens) == 7 and tokens == reference_greedy(model, (3, 4, 5), 12, engine.eos_ids)[:7]


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
    # ignore_eos: a sampled first token may be EOS (a "stop", one draw in 512 of a random model)
    engine.submit(Submit("generating", past_its_vocabulary, SamplingParams(max_tokens=1, ignore_eos=True)))
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


# (the decoder runner, transformers' forward, and LFM2's convolution layers on the runner: the embedding row's
# state carried from chunk to chunk)
@pytest.mark.parametrize("architecture", ["llama", "gpt2", "lfm2"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_prompt_longer_than_the_budget_is_embedded_a_chunk_a_step_as_it_is_whole(architecture, pooling):
    """Beside a decoding row, a prompt longer than the step's budget goes a chunk a step (each chunk
    reading the earlier ones from the cache's embedding row, and its convolutions' last inputs from the
    row's state) instead of holding the row's next token for its whole pass: a step embeds at most the
    budget, and the vector is the one a single pass gives."""
    model = tiny_model(architecture)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=16)
    engine.submit(Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    engine.step()
    long = tuple(range(7, 7 + 50))
    engine.submit(Submit("long", long, SamplingParams(embedding=pooling)))
    engine.submit(Submit("short", (9, 8, 7), SamplingParams(embedding=pooling)))
    finished = []
    for step in range(6):
        pieces = engine.step()
        assert any(p.request_id == "decode" and p.text for p in pieces)  # the row got its token each step
        finished += [(step, p) for p in pieces if p.embedding is not None]
    assert [(step, piece.request_id) for step, piece in finished] == [(3, "long"), (4, "short")]
    # 16 tokens a step: 16, 16, 16, then the last 2; then the short one whole.
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


@needs_blocks
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_on_the_cpus_loop_an_embedding_chunk_is_more_decode_queries_of_its_row(pooling):
    """Where each decode query reads its own row up to its own position (the CPU's loop), an embedding
    input's chunk runs as more decode queries of the embedding row, in the decode step's own path (a
    prompt chunk's path costs a one-row step several times over whatever its size): no step beside the
    decoding row carries a prompt chunk, the row's tokens are those it gets alone, and the vector is
    transformers' for the input, up to the rounding of the decode path's activations."""
    from tests.backend.test_native_decode import served_like_the_default

    model = served_like_the_default(dtype=torch.float32)
    decode = Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    alone_text = text_of(
        drive(Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128), [(0, decode)])["decode"]
    )
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128, speculative_tokens=0)
    assert engine.runner.reads_own_positions
    forward, steps = engine._forward, []

    def recording(inputs):
        steps.append((inputs.layout.decode_queries, len(inputs.layout.prompts), inputs.embedded))
        return forward(inputs)

    engine._forward = recording
    prompt = tuple(range(7, 47))
    pieces = drive(engine, [(0, decode), (1, Submit("e", prompt, SamplingParams(embedding=pooling)))])
    embedding_steps = [step for step in steps if step[2] is not None]
    assert len(embedding_steps) >= 3  # 40 tokens, 7 queries a step at most beside the decoding row
    for queries, prompt_chunks, embedded in embedding_steps:
        assert prompt_chunks == 0 and embedded.stop == queries and embedded.start == 1  # after the row's
    assert sum(len(embedded) for *_, embedded in embedding_steps) == len(prompt)
    assert text_of(pieces["decode"]) == alone_text
    # A decode query's projections round its activations to int8 a block of 32 (few rows' path), where
    # transformers' pass of the whole input multiplies by the dense copy: 4e-3 apart at most here.
    vector, reference = torch.tensor(pieces["e"][-1].embedding), alone(model, prompt, pooling)
    torch.testing.assert_close(vector, reference, atol=1e-2, rtol=0)
    assert float(vector @ reference) > 0.9995

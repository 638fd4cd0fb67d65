"""Score requests in the engine: (query, document) pairs read by a separate cross-encoder
(`--rerank-model`), batched beside the served model's decoding rows, each pair's score the one that
transformers' own model gives it alone."""

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForSequenceClassification,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
)

from backend.engine.engine import Engine
from backend.messages import SCORE, BackendConfig, SamplingParams, Submit
from backend.model.embeddings import score
from backend.model.loader import load_rerank_model
from tests.backend.models import (
    TINY_BERT_POSITIONS,
    MarkerTokenizer,
    drive,
    reference_greedy,
    text_of,
    tiny_model,
    write_tiny_bert,
)

QUERY = "where did the cat sit?"
DOCUMENTS = ["The cat sat on the mat.", "Stock markets fell sharply today!", "a cat", "mat"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny random cross-encoder as the backend loads it, and its directory."""
    directory = write_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-reranker", reranker=True)
    return directory, load_rerank_model(BackendConfig(rerank_model=str(directory), device="cpu"))


def pair(tokenizer, document: str) -> tuple[tuple[int, ...], int | None]:
    """The pair as the frontend sends it: its ids, and where its tokens of type 1 begin."""
    encoding = tokenizer(QUERY, document)
    types = encoding.token_type_ids
    return tuple(encoding.input_ids), types.index(1) if 1 in types else None


def alone(directory, document: str) -> float:
    """The pair's relevance logit computed by itself, straight from transformers."""
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        logit = model(**AutoTokenizer.from_pretrained(directory)(QUERY, document, return_tensors="pt")).logits
    return logit[0, 0].item()


def test_each_pair_of_a_padded_batch_scores_as_it_does_alone(reranker):
    directory, loaded = reranker
    tokenizer = AutoTokenizer.from_pretrained(directory)
    pairs = [pair(tokenizer, document) for document in DOCUMENTS]
    assert len({len(ids) for ids, _ in pairs}) == len(pairs)  # a right-padded batch
    with torch.no_grad():
        scores = score(loaded.model, pairs).tolist()
    expected = [alone(directory, document) for document in DOCUMENTS]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 0.5  # the documents are told apart
    # The document's token type counts: read as the query's type, each pair scores otherwise.
    with torch.no_grad():
        untyped = score(loaded.model, [(ids, None) for ids, _ in pairs]).tolist()
    assert all(abs(a - b) > 1e-3 for a, b in zip(untyped, expected, strict=True))


def test_pairs_are_scored_while_the_served_model_generates(reranker):
    directory, loaded = reranker
    assert loaded.name == "tiny-reranker" and loaded.max_tokens == TINY_BERT_POSITIONS
    model = tiny_model("llama")
    engine = Engine(
        model, MarkerTokenizer(), rows=2, max_seq_len=128, max_prefill_tokens=1000, rerank_model=loaded
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    generating = Submit("g", (3, 4, 5), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    scoring = [
        (2, Submit(f"s{i}", ids, SamplingParams(embedding=SCORE, pair_start=start)))
        for i, (ids, start) in enumerate(pair(tokenizer, document) for document in DOCUMENTS)
    ]
    # The served model still embeds its own inputs (it has the cache's spare row).
    embedding = (2, Submit("e", (3, 4, 5, 6), SamplingParams(embedding="mean")))
    pieces = drive(engine, [(0, generating), *scoring, embedding])
    for i, document in enumerate(DOCUMENTS):
        (piece,) = pieces[f"s{i}"]
        assert piece.finish_reason == "stop" and len(piece.embedding) == 1
        assert piece.embedding[0] == pytest.approx(alone(directory, document), abs=1e-5)
    (embedded,) = pieces["e"]
    assert len(embedded.embedding) == model.config.hidden_size
    assert MarkerTokenizer.ids(text_of(pieces["g"])) == reference_greedy(model, (3, 4, 5), 8, engine.eos_ids)


def decoding_engine(loaded, budget: int) -> Engine:
    """An engine whose one row decodes a long greedy stream, past its prompt's step: its steps then
    give a separate model's pass what `budget` tokens pay for."""
    engine = Engine(
        tiny_model("llama"),
        MarkerTokenizer(),
        rows=1,
        max_seq_len=128,
        max_prefill_tokens=budget,
        rerank_model=loaded,
    )
    engine.submit(Submit("g", (3, 4, 5), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)))
    engine.step()
    return engine


def test_while_rows_decode_a_pair_goes_a_layer_a_step_and_scores_as_it_does_alone(reranker):
    directory, loaded = reranker
    engine = decoding_engine(loaded, budget=8)
    ids, start = pair(AutoTokenizer.from_pretrained(directory), DOCUMENTS[0])
    assert len(ids) > 8 and loaded.model.config.num_hidden_layers == 2
    engine.submit(Submit("s", ids, SamplingParams(embedding=SCORE, pair_start=start)))
    first = engine.step()
    assert [p.request_id for p in first] == ["g"]  # the stream's token, and the pair's first layer
    assert engine.encoder_pass.staged.layers_run == 1
    second = {p.request_id: p for p in engine.step()}
    assert set(second) == {"g", "s"} and engine.encoder_pass is None
    assert second["s"].embedding[0] == pytest.approx(alone(directory, DOCUMENTS[0]), abs=1e-5)


def test_a_pair_cancelled_during_its_pass_ends_at_once_and_the_others_of_the_pass_score(reranker):
    directory, loaded = reranker
    engine = decoding_engine(loaded, budget=24)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    for i, document in enumerate(DOCUMENTS[2:]):
        ids, start = pair(tokenizer, document)
        engine.submit(Submit(f"s{i}", ids, SamplingParams(embedding=SCORE, pair_start=start)))
    engine.step()
    assert [request.request_id for request in engine.encoder_pass.requests] == ["s0", "s1"]
    assert not engine.encoder_pass.staged.done
    engine.submit(Submit("s1", (2, 3), SamplingParams(embedding=SCORE)))  # its id is in use
    engine.cancel("s0")
    pieces = drive(engine, [])
    assert [p.finish_reason for p in pieces["s0"]] == ["cancelled"]
    assert [p.finish_reason for p in pieces["s1"]] == ["error", "stop"]
    assert "already in use" in pieces["s1"][0].error
    assert pieces["s1"][1].embedding[0] == pytest.approx(alone(directory, DOCUMENTS[3]), abs=1e-5)


def test_a_pass_whose_pairs_are_all_cancelled_ends_there(reranker):
    directory, loaded = reranker
    engine = decoding_engine(loaded, budget=8)
    ids, start = pair(AutoTokenizer.from_pretrained(directory), DOCUMENTS[0])
    engine.submit(Submit("s", ids, SamplingParams(embedding=SCORE, pair_start=start)))
    engine.step()
    staged = engine.encoder_pass.staged
    assert staged.layers_run == 1 and not staged.done
    engine.cancel("s")
    assert engine.encoder_pass is None and staged.done and staged.layers_run == 1  # its thread ended
    assert [(p.request_id, p.finish_reason) for p in engine.step() if p.request_id == "s"] == [
        ("s", "cancelled")
    ]
    assert not any(layer._forward_pre_hooks for layer in loaded.model.bert.encoder.layer)


def test_score_requests_are_bounded_by_the_rerank_model_and_refused_without_one(reranker):
    _, loaded = reranker
    engine = Engine(tiny_model("llama"), MarkerTokenizer(), rows=1, max_seq_len=128, rerank_model=loaded)
    without = Engine(tiny_model("llama"), MarkerTokenizer(), rows=1, max_seq_len=128)
    too_long = (2,) * (TINY_BERT_POSITIONS + 1)  # within the served model's context
    engine.submit(Submit("too-long", too_long, SamplingParams(embedding=SCORE)))
    engine.submit(Submit("past-vocabulary", (2, loaded.vocab_size, 3), SamplingParams(embedding=SCORE)))
    without.submit(Submit("no-reranker", (2, 3, 4), SamplingParams(embedding=SCORE)))
    pieces = {p.request_id: p for p in engine.step() + without.step()}
    assert "rerank model takes 64" in pieces["too-long"].error
    assert "vocabulary" in pieces["past-vocabulary"].error
    assert "no rerank model" in pieces["no-reranker"].error
    assert {p.finish_reason for p in pieces.values()} == {"error"}


def test_a_classifier_of_several_labels_is_refused_as_a_reranker(tmp_path):
    directory = write_tiny_bert(tmp_path / "classifier", reranker=True)
    config = AutoConfig.from_pretrained(directory)
    config.num_labels = 2
    BertForSequenceClassification(config).save_pretrained(directory)
    with pytest.raises(ValueError, match="2 labels"):
        load_rerank_model(BackendConfig(rerank_model=str(directory), device="cpu"))


def test_the_rerank_model_needs_a_name_of_its_own(reranker):
    with pytest.raises(ValueError, match="tiny-reranker"):
        Engine(tiny_model("llama"), MarkerTokenizer(), rows=1, name="tiny-reranker", rerank_model=reranker[1])


def test_a_model_of_one_token_type_reads_a_pair_as_one_sequence():
    """XLM-RoBERTa's rerankers (BGE's) have one token type: a pair marked with two is read as one, as
    transformers reads it without token_type_ids, rather than indexing past the type embedding."""
    config = XLMRobertaConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=40,
        type_vocab_size=1,
        num_labels=1,
    )
    torch.manual_seed(0)
    model = XLMRobertaForSequenceClassification(config).eval()
    pairs = [((0, 5, 6, 2, 2, 7, 2), 4), ((0, 8, 2, 2, 9, 10, 11, 2), 3)]
    with torch.no_grad():
        scores = score(model, pairs).tolist()
        expected = [model(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids, _ in pairs]
    assert scores == pytest.approx(expected, abs=1e-6)

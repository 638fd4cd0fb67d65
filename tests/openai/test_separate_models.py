"""`--embedding-model` and `--rerank-model`: /v1/embeddings from a separate sentence-embedding model, with
the official openai client (and Ollama's), and /v1/rerank from a cross-encoder, on one server of three
tiny random models (a Llama that generates, a BERT that embeds, a BERT that scores pairs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import cohere
import ollama
import openai
import pytest
import requests
import torch
from huggingface_hub import InferenceClient
from jsonschema import Draft202012Validator
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from backend.messages import BackendConfig
from backend.model.loader import load_model
from tests.backend.models import TINY_BERT_POSITIONS, tiny_model, write_tiny_bert
from tests.conftest import ROOT
from tests.server_fixture import RunningServer, running_server

CHAT_MODEL = "tiny-llama"
EMBEDDING_MODEL = "tiny-bert"
RERANK_MODEL = "tiny-reranker"
# The answers' schemas in the server's description of itself
DOCUMENTED = json.loads((ROOT / "inference_api" / "openapi.json").read_text())["components"]["schemas"]
QUERY = "where did the cat sit?"
DOCUMENTS = ["Stock markets fell sharply today!", "The cat sat on the mat.", "a cat", "mat"]
TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply today!", "a cat"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root: Path = tmp_path_factory.mktemp("models")
    tokenizer = load_model(
        BackendConfig(rows=1, max_seq_len=64)
    ).tokenizer  # SmolLM2's, with its chat template
    tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(
        root / CHAT_MODEL
    )
    tokenizer.save_pretrained(root / CHAT_MODEL)
    write_tiny_bert(root / EMBEDDING_MODEL)
    write_tiny_bert(root / RERANK_MODEL, reranker=True)
    return root


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[RunningServer]:
    options = ["--model", str(models / CHAT_MODEL), "--embedding-model", str(models / EMBEDDING_MODEL)]
    options += ["--rerank-model", str(models / RERANK_MODEL), "--max-queue", "6"]
    options += ["--rows", "2", "--max-seq-len", "128", "--dtype", "float32", "--quantize", "none"]
    with running_server(*options, ready_timeout=300) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client(timeout=60)


def reference(directory: Path, text: str, side: str = "right", **cut) -> torch.Tensor:
    """The text's mean-pooled, normalised last hidden states, as transformers computes them alone; `cut`,
    the tokenizer's truncation options (from the text's `side`)."""
    model = AutoModel.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, truncation_side=side)
    ids = tokenizer(text, return_tensors="pt", **cut).input_ids
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)


def test_the_embedding_model_embeds_with_its_own_tokenizer(client, models):
    response = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS)
    assert response.model == EMBEDDING_MODEL
    for text, item in zip(TEXTS, response.data, strict=True):
        torch.testing.assert_close(
            torch.tensor(item.embedding), reference(models / EMBEDDING_MODEL, text), atol=1e-5, rtol=1e-4
        )
    tokenizer = AutoTokenizer.from_pretrained(models / EMBEDDING_MODEL)
    ids = [tokenizer(text).input_ids for text in TEXTS]
    assert response.usage.prompt_tokens == sum(len(i) for i in ids)
    # Token ids are the embedding model's: the same vector as the text.
    from_ids = client.embeddings.create(model=EMBEDDING_MODEL, input=[ids[0]]).data[0].embedding
    assert from_ids == pytest.approx(response.data[0].embedding, abs=1e-6)


@pytest.mark.parametrize(
    "value",
    [
        [[2, 10_000]],  # past its vocabulary of 60-odd tokens, though within the Llama's 49,152
        " ".join(["a"] * TINY_BERT_POSITIONS),  # 64 words and [CLS] and [SEP]: past its 64 positions
    ],
    ids=["token-past-vocabulary", "too-long"],
)
def test_inputs_the_embedding_model_cannot_take_are_a_400(client, value):
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=EMBEDDING_MODEL, input=value)
    assert raised.value.body["param"] == "input"


def test_each_model_answers_its_own_endpoints_only(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model=CHAT_MODEL, input="a cat")
    assert raised.value.body["code"] == "model_not_found" and EMBEDDING_MODEL in raised.value.body["message"]
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model=EMBEDDING_MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert raised.value.body["code"] == "model_not_found" and CHAT_MODEL in raised.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=EMBEDDING_MODEL, prompt="Hello", max_tokens=3)
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model=RERANK_MODEL, input="a cat")
    assert "serves /v1/rerank only" in raised.value.body["message"]
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model=RERANK_MODEL, prompt="Hello", max_tokens=3)
    assert "serves /v1/rerank only" in raised.value.body["message"]
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=3)
    assert f"and {RERANK_MODEL!r} for /v1/rerank" in raised.value.body["message"]
    # The served model still generates.
    chat = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert chat.model == CHAT_MODEL and chat.usage.completion_tokens == 3


def test_the_models_list_names_both(client, server):
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) == {CHAT_MODEL, EMBEDDING_MODEL, RERANK_MODEL}
    raw = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["max_model_len"] for m in raw} == {
        CHAT_MODEL: 128,
        EMBEDDING_MODEL: TINY_BERT_POSITIONS,
        RERANK_MODEL: TINY_BERT_POSITIONS,
    }
    # Llama Stack's model type: which model its inference.embeddings takes.
    types = {m["identifier"]: m["model_type"] for m in raw}
    assert types == {CHAT_MODEL: "llm", EMBEDDING_MODEL: "embedding", RERANK_MODEL: "rerank"}


def test_llama_stacks_embeddings_are_the_embedding_models(client, server):
    asked = {"model_id": EMBEDDING_MODEL, "contents": [TEXTS[0], {"type": "text", "text": TEXTS[1]}]}
    answer = requests.post(f"{server.url}/v1/inference/embeddings", json=asked, timeout=60)
    assert answer.status_code == 200, answer.text
    expected = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS[:2]).data
    for vector, item in zip(answer.json()["embeddings"], expected, strict=True):
        assert vector == pytest.approx(item.embedding, abs=1e-6)
    too_long = {"model_id": EMBEDDING_MODEL, "contents": [" ".join(["a"] * TINY_BERT_POSITIONS)]}
    refused = requests.post(f"{server.url}/v1/inference/embeddings", json=too_long, timeout=60)
    assert refused.status_code == 400 and refused.json()["detail"].startswith("contents[0] has ")


def test_ollamas_api_lists_shows_and_embeds_with_the_embedding_model(client, server):
    ollama_client = ollama.Client(host=server.url, timeout=60)
    assert [model.model for model in ollama_client.list().models] == [CHAT_MODEL, EMBEDDING_MODEL]
    assert ollama_client.show(EMBEDDING_MODEL).capabilities == ["embedding"]
    assert ollama_client.show(f"{CHAT_MODEL}:latest").capabilities == ["completion", "tools"]
    vectors = ollama_client.embed(model=EMBEDDING_MODEL, input=TEXTS[:2]).embeddings
    expected = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS[:2]).data
    for vector, item in zip(vectors, expected, strict=True):
        assert vector == pytest.approx(item.embedding, abs=1e-6)
    with pytest.raises(ollama.ResponseError) as failure:  # the embedding model does not chat
        ollama_client.chat(model=EMBEDDING_MODEL, messages=[{"role": "user", "content": "hi"}])
    assert failure.value.status_code == 404 and "/v1/embeddings only" in failure.value.error


def test_an_input_too_long_is_cut_where_the_request_asks_as_transformers_cuts_it(client, server, models):
    """vLLM's truncate_prompt_tokens at /v1/embeddings (the last tokens kept) and Llama Stack's
    text_truncation: the vectors of the text as transformers' tokenizer cuts it, its special tokens kept."""
    long = " ".join(["the cat sat on the mat", "stock markets fell sharply today"] * 8)  # past 64 positions
    directory = models / EMBEDDING_MODEL
    for cut, side, most in [(-1, "left", TINY_BERT_POSITIONS), (10, "left", 10)]:
        item = client.embeddings.create(
            model=EMBEDDING_MODEL, input=long, extra_body={"truncate_prompt_tokens": cut}
        )
        expected = reference(directory, long, side, truncation=True, max_length=most)
        torch.testing.assert_close(torch.tensor(item.data[0].embedding), expected, atol=1e-5, rtol=1e-4)
        assert item.usage.prompt_tokens == most
    for truncation, side in [("end", "right"), ("start", "left")]:
        asked = {"model_id": EMBEDDING_MODEL, "contents": [long], "text_truncation": truncation}
        answer = requests.post(f"{server.url}/v1/inference/embeddings", json=asked, timeout=60)
        assert answer.status_code == 200, answer.text
        expected = reference(directory, long, side, truncation=True, max_length=TINY_BERT_POSITIONS)
        torch.testing.assert_close(
            torch.tensor(answer.json()["embeddings"][0]), expected, atol=1e-5, rtol=1e-4
        )
    # Token ids are cut as they are.
    ids = AutoTokenizer.from_pretrained(directory)(long).input_ids
    item = client.embeddings.create(
        model=EMBEDDING_MODEL, input=[ids], extra_body={"truncate_prompt_tokens": 12}
    )
    assert item.usage.prompt_tokens == 12
    # Without a cut the input is refused, and the message says what would cut it.
    for cut in (0, TINY_BERT_POSITIONS + 1, None):
        with pytest.raises(openai.BadRequestError) as raised:
            client.embeddings.create(
                model=EMBEDDING_MODEL, input=long, extra_body={"truncate_prompt_tokens": cut}
            )
        assert raised.value.body["param"] == ("input" if cut is None else "truncate_prompt_tokens")
    assert "truncate_prompt_tokens: -1 cuts it to fit" in raised.value.body["message"]
    refused = requests.post(
        f"{server.url}/v1/inference/embeddings",
        json={"model_id": EMBEDDING_MODEL, "contents": [long]},
        timeout=60,
    )
    assert 'text_truncation: "end" cuts it to fit' in refused.json()["detail"]


def test_text_embeddings_inferences_embed_gives_the_embedding_models_vectors(client, server, models):
    """TEI's /embed, as LlamaIndex's TextEmbeddingsInference calls it: `inputs`, `truncate` and
    `truncation_direction`; a bare list of vectors back, errors in TEI's shape."""
    answer = requests.post(f"{server.url}/embed", json={"inputs": TEXTS}, timeout=60)
    assert answer.status_code == 200, answer.text
    expected = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS).data
    assert len(answer.json()) == len(TEXTS)
    for vector, item in zip(answer.json(), expected, strict=True):
        assert vector == pytest.approx(item.embedding, abs=1e-6)
    one = requests.post(f"{server.url}/embed", json={"inputs": TEXTS[0], "normalize": True}, timeout=60)
    assert one.json()[0] == pytest.approx(expected[0].embedding, abs=1e-6)
    # huggingface_hub's client posts its feature_extraction to the URL it is given: /embed, not / (TGI's
    # generate there).
    vectors = InferenceClient(model=f"{server.url}/embed", timeout=60).feature_extraction(TEXTS[1])
    assert vectors.shape == (1, len(expected[1].embedding))
    assert vectors[0].tolist() == pytest.approx(expected[1].embedding, abs=1e-6)
    long = " ".join(["the cat sat on the mat", "stock markets fell sharply today"] * 8)
    for direction, side in [(None, "right"), ("Left", "left")]:
        asked = {"inputs": [long], "truncate": True, "truncation_direction": direction}
        answer = requests.post(f"{server.url}/embed", json=asked, timeout=60)
        assert answer.status_code == 200, answer.text
        reference_vector = reference(models / EMBEDDING_MODEL, long, side, truncation=True, max_length=64)
        torch.testing.assert_close(torch.tensor(answer.json()[0]), reference_vector, atol=1e-5, rtol=1e-4)
    for asked, says in [
        ({"inputs": [long]}, "truncate: true cuts it to fit"),
        ({"inputs": TEXTS, "normalize": False}, "normalize must be true"),
        ({"inputs": TEXTS, "truncate": True, "truncation_direction": "up"}, "truncation_direction"),
        ({"inputs": []}, "inputs"),
    ]:
        refused = requests.post(f"{server.url}/embed", json=asked, timeout=60)
        assert refused.status_code == 400 and refused.json()["error_type"] == "validation", refused.text
        assert says in refused.json()["error"]


def rerank_reference(
    directory: Path, raw: bool = False, documents: list[str] = DOCUMENTS, side: str = "right", **cut
) -> list[float]:
    """Each document's score as transformers gives it alone: the sigmoid of the pair's one logit (`raw`:
    the logit); `cut`, the tokenizer's truncation options (from the texts' `side`)."""
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, truncation_side=side)
    with torch.no_grad():
        logits = [
            model(**tokenizer(QUERY, document, return_tensors="pt", **cut)).logits[0, 0]
            for document in documents
        ]
    return [(logit if raw else torch.sigmoid(logit)).item() for logit in logits]


def rerank(server: RunningServer, path: str = "/v1/rerank", **fields) -> requests.Response:
    return requests.post(
        f"{server.url}{path}", json={"query": QUERY, "documents": DOCUMENTS} | fields, timeout=60
    )


def test_rerank_scores_each_document_as_transformers_does_the_most_relevant_first(server, models):
    expected = rerank_reference(models / RERANK_MODEL)
    answer = rerank(server, model=RERANK_MODEL)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    Draft202012Validator(DOCUMENTED["Reranked"]).validate(body)
    assert body["model"] == RERANK_MODEL and body["id"].startswith("rerank-")
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert [result["index"] for result in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-6)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tokenizer = AutoTokenizer.from_pretrained(models / RERANK_MODEL)
    pairs = sum(len(tokenizer(QUERY, document).input_ids) for document in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": pairs, "total_tokens": pairs}
    # Jina's and Cohere's other paths, structured documents, top_n and no documents back: the same scores.
    objects = [{"text": document, "title": "ignored"} for document in DOCUMENTS]
    for path in ("/rerank", "/v2/rerank"):
        short = rerank(server, path, documents=objects, top_n=2, return_documents=False).json()
        assert [sorted(result) for result in short["results"]] == [["index", "relevance_score"]] * 2
        assert [r["index"] for r in short["results"]] == order[:2]
        assert [r["relevance_score"] for r in short["results"]] == pytest.approx(
            [expected[i] for i in order[:2]], abs=1e-6
        )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"query": ""}, "query"),
        ({"query": None}, "query"),
        ({"documents": []}, "documents"),
        ({"documents": "a cat"}, "documents"),
        ({"documents": ["a cat", 7]}, "documents[1]"),
        ({"documents": ["a cat", {"title": "no text"}]}, "documents[1].text"),
        ({"top_n": 0}, "top_n"),
        ({"return_documents": "yes"}, "return_documents"),
        ({"documents": ["a cat", " ".join(["a"] * TINY_BERT_POSITIONS)]}, "documents[1]"),  # too long
        ({"documents": ["a cat"] * 9}, "documents"),  # 2 rows and a queue of 6 hold 8 requests
    ],
)
def test_rerank_requests_the_server_cannot_take_are_a_400_naming_the_field(server, fields, param):
    answer = rerank(server, **fields)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (CHAT_MODEL, f"does not serve /v1/rerank; /v1/rerank serves {RERANK_MODEL!r}"),
        (EMBEDDING_MODEL, f"serves /v1/embeddings only; /v1/rerank serves {RERANK_MODEL!r}"),
        ("bge-reranker", f"does not exist; this server serves {CHAT_MODEL!r}, and {EMBEDDING_MODEL!r} for"),
    ],
)
def test_rerank_naming_another_model_is_a_404_saying_why(server, model, why):
    answer = rerank(server, model=model)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    assert why in answer.json()["error"]["message"]


def test_vllms_score_api_scores_pairs_in_their_order_as_rerank_does(server, models):
    expected = rerank_reference(models / RERANK_MODEL)
    one_against_many = {"model": RERANK_MODEL, "text_1": QUERY, "text_2": DOCUMENTS}
    pair_by_pair = {"text_1": [QUERY] * 2, "text_2": DOCUMENTS[:2]}
    for path, body, scores in [
        ("/v1/score", one_against_many, expected),
        ("/score", pair_by_pair, expected[:2]),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[3]}, expected[3:]),
    ]:
        answer = requests.post(f"{server.url}{path}", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        Draft202012Validator(DOCUMENTED["Scores"]).validate(answer.json())
        data = answer.json()["data"]
        assert [(item["index"], item["object"]) for item in data] == [
            (i, "score") for i in range(len(scores))
        ]
        assert [item["score"] for item in data] == pytest.approx(scores, abs=1e-6)
    for body, param in [
        ({"text_1": [QUERY] * 2, "text_2": DOCUMENTS}, "text_1"),  # two against four
        ({"text_1": QUERY, "text_2": []}, "text_2"),
        ({"text_1": QUERY}, "text_2"),
        ({"text_1": QUERY, "text_2": ["a cat", " ".join(["a"] * TINY_BERT_POSITIONS)]}, "text_2[1]"),
    ]:
        answer = requests.post(f"{server.url}/v1/score", json=body, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_coheres_clients_rerank_through_both_of_its_paths(server, models):
    expected = rerank_reference(models / RERANK_MODEL)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    v2 = cohere.ClientV2(api_key="not-needed", base_url=server.url, timeout=60)
    ranked = v2.rerank(model=RERANK_MODEL, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [result.index for result in ranked.results] == order[:3]
    assert [result.relevance_score for result in ranked.results] == pytest.approx(
        [expected[i] for i in order[:3]], abs=1e-6
    )
    v1 = cohere.Client(api_key="not-needed", base_url=server.url, timeout=60)
    documents = [{"text": document} for document in DOCUMENTS]
    ranked = v1.rerank(model=RERANK_MODEL, query=QUERY, documents=documents, return_documents=True)
    assert [(result.index, result.document.text) for result in ranked.results] == [
        (i, DOCUMENTS[i]) for i in order
    ]


def test_text_embeddings_inferences_rerank_body_gets_its_own_answer(server, models):
    """TEI's /rerank, as Haystack's, LlamaIndex's and LangChain's TEI rerankers call it: `texts`, and a
    bare list back; `raw_scores` gives the logits, `return_text` the texts."""
    logits = rerank_reference(models / RERANK_MODEL, raw=True)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -logits[i])
    asked = {"query": QUERY, "texts": DOCUMENTS}
    answer = requests.post(f"{server.url}/rerank", json=asked, timeout=60)
    assert answer.status_code == 200, answer.text
    Draft202012Validator(DOCUMENTED["TeiReranked"]).validate(answer.json())
    assert [item["index"] for item in answer.json()] == order
    expected = rerank_reference(models / RERANK_MODEL)
    assert [item["score"] for item in answer.json()] == pytest.approx([expected[i] for i in order], abs=1e-6)
    raw = requests.post(
        f"{server.url}/rerank", json=asked | {"raw_scores": True, "return_text": True}, timeout=60
    )
    assert [(item["index"], item["text"]) for item in raw.json()] == [(i, DOCUMENTS[i]) for i in order]
    assert [item["score"] for item in raw.json()] == pytest.approx([logits[i] for i in order], abs=1e-5)
    refused = requests.post(f"{server.url}/rerank", json={"query": QUERY, "texts": ["a cat", 3]}, timeout=60)
    # TEI's error shape, as at /embed: its clients read `error` as the message
    assert refused.status_code == 400 and refused.json()["error_type"] == "validation"
    assert refused.json()["error"].startswith("texts[1]")
    Draft202012Validator(DOCUMENTED["TgiError"]).validate(refused.json())
    # Only at TEI's own path: /v1/rerank takes Jina's and Cohere's body alone.
    elsewhere = requests.post(f"{server.url}/v1/rerank", json=asked, timeout=60)
    assert elsewhere.status_code == 400 and elsewhere.json()["error"]["param"] == "documents"


def test_a_pair_too_long_is_cut_where_the_request_asks_as_transformers_cuts_it(server, models):
    """vLLM's truncate_prompt_tokens (-1: to the model's positions), Cohere's max_tokens_per_doc and TEI's
    truncate with truncation_direction: each pair scores as transformers' tokenizer cuts it."""
    long = " ".join(["the cat sat on the mat"] * 20)  # 120 words, past the model's 64 positions
    documents = [long, "a cat"]
    query_tokens = len(AutoTokenizer.from_pretrained(models / RERANK_MODEL)(QUERY).input_ids)
    reranker = models / RERANK_MODEL
    for body, path, expected in [
        # vLLM's "left truncation": the texts' last tokens kept
        (
            {"truncate_prompt_tokens": -1},
            "/v1/rerank",
            {"side": "left", "truncation": True, "max_length": 64},
        ),
        (
            {"truncate_prompt_tokens": 20},
            "/v1/rerank",
            {"side": "left", "truncation": True, "max_length": 20},
        ),
        (
            {"max_tokens_per_doc": 5},
            "/v2/rerank",
            {"truncation": "only_second", "max_length": query_tokens + 6},
        ),
    ]:
        answer = rerank(server, path, documents=documents, **body)
        assert answer.status_code == 200, answer.text
        scores = rerank_reference(reranker, documents=documents, **expected)
        assert {r["index"]: r["relevance_score"] for r in answer.json()["results"]} == pytest.approx(
            dict(enumerate(scores)), abs=1e-6
        ), body
    score = requests.post(
        f"{server.url}/v1/score",
        json={"text_1": QUERY, "text_2": documents, "truncate_prompt_tokens": -1},
        timeout=60,
    )
    scores = rerank_reference(reranker, documents=documents, side="left", truncation=True, max_length=64)
    assert [item["score"] for item in score.json()["data"]] == pytest.approx(scores, abs=1e-6)
    tei = {"query": QUERY, "texts": documents, "truncate": True}
    for direction, side in [(None, "right"), ("Left", "left")]:
        asked = tei | {"raw_scores": True, "truncation_direction": direction}
        answer = requests.post(f"{server.url}/rerank", json=asked, timeout=60)
        assert answer.status_code == 200, answer.text
        logits = rerank_reference(reranker, True, documents, side, truncation=True, max_length=64)
        scores = {r["index"]: r["score"] for r in answer.json()}
        assert scores == pytest.approx(dict(enumerate(logits)), abs=1e-5), direction
    # Without a cut the pair is refused, and the message says what would cut it.
    refused = rerank(server, documents=documents).json()["error"]
    assert refused["param"] == "documents[0]" and "truncate_prompt_tokens: -1" in refused["message"]
    refused = requests.post(f"{server.url}/rerank", json={"query": QUERY, "texts": documents}, timeout=60)
    assert "truncate: true" in refused.json()["error"]
    for path, fields, param in [
        ("/v1/rerank", {"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),  # no room for the texts
        ("/v1/rerank", {"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
        ("/v2/rerank", {"max_tokens_per_doc": 0}, "max_tokens_per_doc"),
    ]:
        answer = rerank(server, path, **fields)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    answer = requests.post(f"{server.url}/rerank", json=tei | {"truncation_direction": "up"}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"].startswith("truncation_direction")

"""`--embedding-model`: /v1/embeddings from a separate sentence-embedding model, with the official
openai client, on one server of two tiny random models (a Llama that generates, a BERT that embeds)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
import torch
from transformers import AutoModel, AutoTokenizer

from backend.messages import BackendConfig
from backend.model.loader import load_model
from tests.backend.models import TINY_BERT_POSITIONS, tiny_model, write_tiny_bert
from tests.server_fixture import RunningServer, running_server

CHAT_MODEL = "tiny-llama"
EMBEDDING_MODEL = "tiny-bert"
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
    return root


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[RunningServer]:
    options = ["--model", str(models / CHAT_MODEL), "--embedding-model", str(models / EMBEDDING_MODEL)]
    options += ["--rows", "2", "--max-seq-len", "128", "--dtype", "float32", "--quantize", "none"]
    with running_server(*options, ready_timeout=300) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, timeout=60)


def reference(directory: Path, text: str) -> torch.Tensor:
    """The text's mean-pooled, normalised last hidden states, as transformers computes them alone."""
    model = AutoModel.from_pretrained(directory).eval()
    ids = AutoTokenizer.from_pretrained(directory)(text, return_tensors="pt").input_ids
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
    assert set(listed) == {CHAT_MODEL, EMBEDDING_MODEL}
    raw = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["max_model_len"] for m in raw} == {
        CHAT_MODEL: 128,
        EMBEDDING_MODEL: TINY_BERT_POSITIONS,
    }
    # Llama Stack's model type: which model its inference.embeddings takes.
    types = {m["identifier"]: m["model_type"] for m in raw}
    assert types == {CHAT_MODEL: "llm", EMBEDDING_MODEL: "embedding"}


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

"""/v1/embeddings with the official openai client on the default model (exact mode)."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch

from tests.openai.conftest import MODEL


def reference(model, tokenizer, text: str) -> torch.Tensor:
    """The mean of the text's last hidden states, normalised, as transformers computes them."""
    ids = torch.tensor([tokenizer(text).input_ids])
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)


def test_each_input_is_its_pooled_normalised_hidden_state(client, reference_model, tokenizer):
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today.", "The cat sat on the mat."]
    response = client.embeddings.create(model=MODEL, input=texts)
    assert [item.index for item in response.data] == [0, 1, 2]
    vectors = [torch.tensor(item.embedding) for item in response.data]
    assert vectors[0].shape == (reference_model.config.hidden_size,)
    for text, vector in zip(texts, vectors, strict=True):
        torch.testing.assert_close(vector, reference(reference_model, tokenizer, text), atol=1e-4, rtol=1e-3)
    # The same text twice in one batch: equal up to the last bits, which a CPU's matrix
    # kernels may round differently for different rows of the batch.
    torch.testing.assert_close(vectors[0], vectors[2], atol=1e-6, rtol=0)
    assert not torch.allclose(vectors[0], vectors[1], atol=1e-2)
    tokens = sum(len(tokenizer(text).input_ids) for text in texts)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_base64_and_token_ids_give_the_same_vectors(client, tokenizer):
    text = "A sentence to embed."
    as_floats = client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
    # The client decodes base64 itself when it asked for floats; ask for base64 over raw HTTP shape.
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=text, encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    decoded = list(struct.unpack(f"<{len(as_floats)}f", base64.b64decode(encoded)))
    assert decoded == pytest.approx(as_floats, abs=1e-6)
    from_ids = client.embeddings.create(model=MODEL, input=[tokenizer(text).input_ids]).data[0].embedding
    assert from_ids == pytest.approx(as_floats, abs=1e-6)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "x", "dimensions": 64}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a"] * 33}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=MODEL, **fields)
    assert raised.value.body["param"] == param

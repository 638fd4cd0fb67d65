"""`POST /v1/embeddings`, OpenAI's shape: each input's pooled, normalised hidden states of the served
model (backend/model/embeddings.py), or of the `--embedding-model` where one is set, as floats or base64.

`model` names the model that embeds: the embedding model where there is one (whose own tokenizer
reads the inputs, and whose vocabulary and positions bound them), else the served model; the other
model's name is a 404, as is the embedding model's at the generating endpoints.

`input` is a string, a list of strings, a list of token ids or a list of those, at most MAX_INPUTS
of them (each is its own backend request, batched beside the decoding rows); `encoding_format` is
`float` (default) or `base64` (little-endian float32, as OpenAI's); `dimensions` is refused, since
the model's hidden size is the only one there is; `user` is accepted and ignored. The pooling is the
server's `--embedding-pooling` (mean by default, or last).
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from flask import Blueprint, Response, current_app, jsonify

from backend.messages import InvalidParams, SamplingParams
from inference_api.generation import ApiFields, check_model, error_of, read_request, start_choices
from inference_api.prompts import prompt_ids, prompt_list
from inference_api.router import Serving

bp = Blueprint("embeddings_api", __name__, url_prefix="/v1")

MAX_INPUTS = 32  # each input is a request: no more than the rows hold at once
FIELDS = ApiFields(prompt_ids="input", count="input")


@bp.post("/embeddings")
def embeddings() -> Response:
    data, serving = read_request(model_field=None)
    check_model(data, serving, embeddings=True)
    inputs = read_inputs(data, serving)
    encoding = data.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidParams("encoding_format", 'encoding_format must be "float" or "base64"')
    if data.get("dimensions") is not None:
        message = "dimensions is not supported: the vectors have the model's hidden size"
        raise InvalidParams("dimensions", message)
    params = SamplingParams(max_tokens=0, embedding=current_app.config["SERVER"].embedding_pooling)
    choices, pieces = start_choices([(ids, params) for ids in inputs], fields=FIELDS)
    vectors: list[tuple[float, ...]] = [()] * len(inputs)
    try:
        for index, piece in pieces:
            if piece.finish_reason == "error":
                raise error_of(piece, FIELDS, "embedding failed")
            if piece.embedding is not None:
                vectors[index] = piece.embedding
    finally:
        choices.close()
    tokens = sum(len(ids) for ids in inputs)
    return jsonify(
        object="list",
        data=[
            {"object": "embedding", "index": i, "embedding": encoded(vector, encoding)}
            for i, vector in enumerate(vectors)
        ],
        model=serving.embedding_names[0],
        usage={"prompt_tokens": tokens, "total_tokens": tokens},
    )


def read_inputs(data: dict[str, Any], serving: Serving) -> list[list[int]]:
    """Each input as token ids (a 400 naming `input` for an empty, malformed or too long one)."""
    inputs = prompt_list(data.get("input"), "input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidParams("input", f"input takes at most {MAX_INPUTS} texts or token lists a request")
    embedding = serving.backend.embedding_model
    if embedding is None:  # the served model embeds: its tokenizer, its ids, a row's context
        tokenizer, vocab, most = serving.tokenizer, serving.token_id_limit, serving.backend.max_seq_len - 1
    else:  # the embedding model: its own tokenizer, its own ids, its position embeddings
        tokenizer = serving.embedding_tokenizer
        vocab, most = min(tokenizer.vocab_size, embedding.vocab_size), embedding.max_tokens
    ids = [
        prompt_ids(value, serving, f"input[{i}]", "input", tokenizer, vocab) for i, value in enumerate(inputs)
    ]
    for i, tokens in enumerate(ids):
        if len(tokens) > most:
            raise InvalidParams("input", f"input[{i}] has {len(tokens)} tokens; the model takes {most}")
    return ids


def encoded(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

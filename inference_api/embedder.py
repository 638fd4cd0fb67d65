"""Embedding vectors, for every API that asks for them (OpenAI's /v1/embeddings, Llama Stack's
/v1/inference/embeddings): each input read by the model that embeds, and sent as its own backend request
that generates nothing and comes back as its pooled, normalised hidden states (backend/model/embeddings.py),
batched beside the decoding rows.

The model that embeds is the `--embedding-model` where one is set (its own tokenizer reads the inputs, its
vocabulary and position embeddings bound them), else the served model (its tokenizer, its ids, a row's
context). The pooling is the server's `--embedding-pooling`.
"""

from __future__ import annotations

from typing import Any

from flask import current_app

from backend.messages import InvalidParams, SamplingParams
from inference_api.generation import ApiFields, error_of, start_choices
from inference_api.prompts import prompt_ids
from inference_api.router import Serving

MAX_INPUTS = 32  # each input is a request: no more than the rows hold at once


def embedding_ids(inputs: list[Any], serving: Serving, param: str) -> list[list[int]]:
    """Each input (a string, or token ids) as the embedding model's token ids: a 400 naming `param` for
    too many inputs, or an empty, malformed or too long one."""
    if len(inputs) > MAX_INPUTS:
        raise InvalidParams(param, f"{param} takes at most {MAX_INPUTS} texts or token lists a request")
    embedding = serving.backend.embedding_model
    if embedding is None:
        tokenizer, vocab, most = serving.tokenizer, serving.token_id_limit, serving.backend.max_seq_len - 1
    else:
        tokenizer = serving.embedding_tokenizer
        vocab, most = min(tokenizer.vocab_size, embedding.vocab_size), embedding.max_tokens
    ids = [
        prompt_ids(value, serving, f"{param}[{i}]", param, tokenizer, vocab) for i, value in enumerate(inputs)
    ]
    for i, tokens in enumerate(ids):
        if len(tokens) > most:
            raise InvalidParams(param, f"{param}[{i}] has {len(tokens)} tokens; the model takes {most}")
    return ids


def embed(inputs: list[list[int]], fields: ApiFields) -> list[tuple[float, ...]]:
    """The vector of each input, in order (503 past the queue; 400 naming `fields.prompt_ids` for an
    input the backend refuses)."""
    params = SamplingParams(max_tokens=0, embedding=current_app.config["SERVER"].embedding_pooling)
    return pooled([(ids, params) for ids in inputs], fields)


def pooled(requests: list[tuple[list[int], SamplingParams]], fields: ApiFields) -> list[tuple[float, ...]]:
    """What the backend gives back for each embedding (or score) request, in order: its Piece.embedding."""
    choices, pieces = start_choices(requests, fields=fields)
    vectors: list[tuple[float, ...]] = [()] * len(requests)
    try:
        for index, piece in pieces:
            if piece.finish_reason == "error":
                raise error_of(piece, fields, "embedding failed")
            if piece.embedding is not None:
                vectors[index] = piece.embedding
    finally:
        choices.close()
    return vectors

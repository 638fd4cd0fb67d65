"""Embedding vectors, for every API that asks for them (OpenAI's /v1/embeddings, Llama Stack's
/v1/inference/embeddings): each input read by the model that embeds, and sent as its own backend request
that generates nothing and comes back as its pooled, normalised hidden states (backend/model/embeddings.py),
batched beside the decoding rows.

The model that embeds is the `--embedding-model` where one is set (its own tokenizer reads the inputs, its
vocabulary and position embeddings bound them), else the served model (its tokenizer, its ids, a row's
context). The pooling is the server's `--embedding-pooling`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import current_app

from backend.messages import InvalidParams, SamplingParams
from inference_api.generation import ApiFields, error_of, start_choices
from inference_api.prompts import prompt_ids
from inference_api.router import Serving
from inference_api.tokenizer import PromptTokenizer

MAX_INPUTS = 32  # each input is a request: no more than the rows hold at once


@dataclass(frozen=True)
class Cut:
    """How a request asks inputs too long cut: to `tokens` (-1: to what the model takes), from their start
    (`direction` "left": the last tokens kept, as vLLM's truncate_prompt_tokens) or their end ("right").
    `field` names it in errors, and `hint` is what a 400 for an input too long suggests."""

    tokens: int | None = None  # None: not cut, an input too long being a 400
    direction: str = "left"
    field: str = "truncate_prompt_tokens"
    hint: str = "truncate_prompt_tokens: -1 cuts it to fit"


def embedding_ids(inputs: list[Any], serving: Serving, param: str, cut: Cut = Cut()) -> list[list[int]]:
    """Each input (a string, or token ids) as the embedding model's token ids, cut as the request asks: a
    400 naming `param` for too many inputs, or an empty, malformed or too long one."""
    if len(inputs) > MAX_INPUTS:
        raise InvalidParams(param, f"{param} takes at most {MAX_INPUTS} texts or token lists a request")
    embedding = serving.backend.embedding_model
    if embedding is None:
        tokenizer, vocab, most = serving.tokenizer, serving.token_id_limit, serving.backend.max_seq_len - 1
    else:
        tokenizer = serving.embedding_tokenizer
        vocab, most = min(tokenizer.vocab_size, embedding.vocab_size), embedding.max_tokens
    if cut.tokens is not None and not (cut.tokens == -1 or 1 <= cut.tokens <= most):
        raise InvalidParams(cut.field, f"{cut.field} must be -1 or from 1 to {most}, got {cut.tokens}")
    ids = [
        prompt_ids(value, serving, f"{param}[{i}]", param, tokenizer, vocab) for i, value in enumerate(inputs)
    ]
    limit = most if cut.tokens in (None, -1) else cut.tokens
    for i, tokens in enumerate(ids):
        if len(tokens) > limit and cut.tokens is not None:
            ids[i] = tokens = cut_ids(inputs[i], tokens, limit, cut.direction, tokenizer)
        if len(tokens) > limit:
            message = f"{param}[{i}] has {len(tokens)} tokens; the model takes {most}"
            raise InvalidParams(param, message if cut.tokens is not None else f"{message} ({cut.hint})")
    return ids


def cut_ids(value: Any, ids: list[int], most: int, direction: str, tokenizer: PromptTokenizer) -> list[int]:
    """An input's ids cut to `most`: a text's as its tokenizer cuts it (its special tokens kept), token
    ids as they are."""
    if isinstance(value, str):
        return tokenizer.encode_cut(value, most, direction)
    return ids[-most:] if direction == "left" else ids[:most]


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

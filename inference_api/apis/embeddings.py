"""`POST /v1/embeddings`, OpenAI's shape: each input's pooled, normalised hidden states of the served
model, or of the `--embedding-model` where one is set (embedder.py), as floats or base64.

`model` names the model that embeds: the embedding model where there is one, else the served model; the
other model's name is a 404, as is the embedding model's at the generating endpoints.

`input` is a string, a list of strings, a list of token ids or a list of those, at most 32 of
them (embedder.MAX_INPUTS); `encoding_format` is `float` (default) or `base64` (little-endian
float32, as OpenAI's); `dimensions` is refused, since the model's hidden size is the only one there
is; `user` is accepted and ignored. An input longer than the model takes is a 400, unless vLLM's
`truncate_prompt_tokens` asks it cut: to that many tokens (-1: to the model's), its last ones kept.
Llama Stack's client calls the same handler at /v1/openai/v1/embeddings (app.py).
"""

from __future__ import annotations

import base64
import struct

from flask import Blueprint, Response, jsonify

from backend.messages import InvalidParams
from inference_api.embedder import Cut, embed, embedding_ids
from inference_api.fields import read_integer
from inference_api.generation import EMBEDDINGS, ApiFields, check_model, read_request
from inference_api.prompts import prompt_list

bp = Blueprint("embeddings_api", __name__, url_prefix="/v1")

FIELDS = ApiFields(prompt_ids="input", count="input")


@bp.post("/embeddings")
def embeddings() -> Response:
    data, serving = read_request(model_field=None)
    check_model(data, serving, endpoint=EMBEDDINGS)
    cut = Cut(read_integer(data, "truncate_prompt_tokens", None, -1, 1 << 31))  # vLLM's
    inputs = embedding_ids(prompt_list(data.get("input"), "input"), serving, "input", cut)
    encoding = data.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidParams("encoding_format", 'encoding_format must be "float" or "base64"')
    if data.get("dimensions") is not None:
        message = "dimensions is not supported: the vectors have the model's hidden size"
        raise InvalidParams("dimensions", message)
    vectors = embed(inputs, FIELDS)
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


def encoded(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

"""`POST /v1/rerank` (and `/rerank`, `/v2/rerank`): Jina's and Cohere's rerank API, as vLLM and llama.cpp's
server serve it. Each document's relevance to the query, scored by the `--rerank-model` (a cross-encoder
that reads the query and the document together, backend/model/embeddings.py), the most relevant first.

`query` is a string; `documents` a list of strings or of objects with a `text` (Jina's and Cohere's
structured documents), each one backend request, so no more than the rows and the queue hold together;
`top_n` keeps the first N results (default: all); `return_documents` (default true, as Jina and vLLM)
sends each document back with its score. `model` may be left out; given, it must name the rerank model.
A pair longer than the rerank model takes is a 400 naming its document. Scores are the sigmoid of the
model's relevance logit, from 0 to 1. A server without `--rerank-model` answers 404.
"""

from __future__ import annotations

import uuid
from typing import Any

from flask import Blueprint, Response, jsonify

from backend.messages import SCORE, InvalidParams, SamplingParams
from inference_api.embedder import pooled
from inference_api.errors import ApiError
from inference_api.fields import read_bool, read_integer, read_string, within
from inference_api.generation import RERANK, ApiFields, check_model, read_request
from inference_api.router import Serving

bp = Blueprint("rerank_api", __name__)

FIELDS = ApiFields(prompt_ids="documents", count="documents")


@bp.post("/rerank")
@bp.post("/v1/rerank")
@bp.post("/v2/rerank")
def rerank() -> Response:
    data, serving = read_request(model_field=None)
    if serving.rerank_tokenizer is None:
        raise ApiError(404, "this server has no rerank model: start it with --rerank-model (a cross-encoder)")
    check_model(data, serving, required=False, endpoint=RERANK)
    query = read_string(data, "query", required=True, non_empty=True)
    documents = read_documents(data.get("documents"))
    top_n = read_integer(data, "top_n", None, 1, 1 << 31) or len(documents)
    return_documents = read_bool(data, "return_documents", True)
    pairs = [pair_ids(serving, query, document, f"documents[{i}]") for i, document in enumerate(documents)]
    scores = pooled(
        [(ids, SamplingParams(max_tokens=0, embedding=SCORE, pair_start=start)) for ids, start in pairs],
        FIELDS,
    )
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i][0])[:top_n]
    results = [
        {"index": i, "relevance_score": scores[i][0]}
        | ({"document": {"text": documents[i]}} if return_documents else {})
        for i in ranked
    ]
    tokens = sum(len(ids) for ids, _ in pairs)
    return jsonify(
        id=f"rerank-{uuid.uuid4().hex}",
        model=serving.rerank_names[0],
        results=results,
        usage={"prompt_tokens": tokens, "total_tokens": tokens},
    )


def read_documents(value: Any) -> list[str]:
    """`documents`: a non-empty list of strings, or of objects whose `text` is one."""
    if not isinstance(value, list) or not value:
        raise InvalidParams("documents", "documents is required: a non-empty list of strings")
    texts = []
    for i, document in enumerate(value):
        name = f"documents[{i}]"
        if isinstance(document, dict):
            with within(name):
                texts.append(read_string(document, "text", required=True, non_empty=True))
        else:
            texts.append(read_string({name: document}, name, required=True, non_empty=True))
    return texts


def pair_ids(serving: Serving, query: str, document: str, param: str) -> tuple[list[int], int | None]:
    """The query and the document as the rerank model's tokenizer joins them, and where the document's
    token type begins; a 400 naming `param` for a pair longer than the model takes."""
    tokenizer, model = serving.rerank_tokenizer, serving.backend.rerank_model
    ids, start = tokenizer.encode_pair(query, document)
    if len(ids) > (most := model.max_tokens):
        raise InvalidParams(
            param, f"{param} and the query have {len(ids)} tokens; the rerank model takes {most}"
        )
    return ids, start

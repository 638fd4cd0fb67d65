"""`POST /v1/rerank` (and `/rerank`, `/v2/rerank`): Jina's and Cohere's rerank API, as vLLM and llama.cpp's
server serve it. Each document's relevance to the query, scored by the `--rerank-model` (a cross-encoder
that reads the query and the document together, backend/model/embeddings.py), the most relevant first.
vLLM's `POST /v1/score` (and `/score`) scores pairs of texts with it too, in the order given; and a body
with `texts` in place of `documents` at /rerank (TEI's path) is Text Embeddings Inference's (`tei_rerank`).

`query` is a string; `documents` a list of strings or of objects with a `text` (Jina's and Cohere's
structured documents), each one backend request, so no more than the rows and the queue hold together;
`top_n` keeps the first N results (default: all); `return_documents` (default true, as Jina and vLLM)
sends each document back with its score. `model` may be left out; given, it must name the rerank model.
A pair longer than the rerank model takes is a 400 naming its document. Scores are the sigmoid of the
model's relevance logit, from 0 to 1. A server without `--rerank-model` answers 404.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from flask import Blueprint, Response, jsonify, request

from backend.messages import SCORE, InvalidParams, SamplingParams
from inference_api.embedder import pooled
from inference_api.errors import ApiError
from inference_api.fields import read_bool, read_integer, read_string, within
from inference_api.generation import RERANK, ApiFields, check_model, read_request
from inference_api.router import Serving

bp = Blueprint("rerank_api", __name__)

RERANK_FIELDS = ApiFields(prompt_ids="documents", count="documents")
SCORE_FIELDS = ApiFields(prompt_ids="text_2", count="text_2")
TEI_FIELDS = ApiFields(prompt_ids="texts", count="texts")


@bp.post("/rerank")
@bp.post("/v1/rerank")
@bp.post("/v2/rerank")
def rerank() -> Response:
    data, serving = read_rerank_request()
    query = read_string(data, "query", required=True, non_empty=True)
    if request.path == "/rerank" and "texts" in data and "documents" not in data:
        return tei_rerank(data, serving, query)
    documents = read_documents(data.get("documents"))
    top_n = read_integer(data, "top_n", None, 1, 1 << 31) or len(documents)
    return_documents = read_bool(data, "return_documents", True)
    pairs = [pair_ids(serving, query, document, f"documents[{i}]") for i, document in enumerate(documents)]
    scores = [sigmoid(logit) for logit in pair_logits(pairs, RERANK_FIELDS)]
    results = [
        {"index": i, "relevance_score": scores[i]}
        for i in sorted(range(len(pairs)), key=lambda i: -scores[i])
    ]
    for result in results if return_documents else ():
        result["document"] = {"text": documents[result["index"]]}
    return jsonify(
        id=f"rerank-{uuid.uuid4().hex}",
        model=serving.rerank_names[0],
        results=results[:top_n],
        usage=usage(pairs),
    )


@bp.post("/score")
@bp.post("/v1/score")
def score() -> Response:
    """vLLM's score API: `text_1` against `text_2`, each a string or a list of them; one text against
    each of a list, or two lists of one length pair by pair. Each pair's score, in the pairs' order."""
    data, serving = read_rerank_request()
    firsts, seconds = read_texts(data, "text_1"), read_texts(data, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        message = f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: it takes one, or as many"
        raise InvalidParams("text_1", message)
    pairs = [
        pair_ids(serving, *texts, f"text_2[{i}]") for i, texts in enumerate(zip(firsts, seconds, strict=True))
    ]
    scores = [sigmoid(logit) for logit in pair_logits(pairs, SCORE_FIELDS)]
    return jsonify(
        id=f"score-{uuid.uuid4().hex}",
        object="list",
        created=int(time.time()),
        model=serving.rerank_names[0],
        data=[{"index": i, "object": "score", "score": value} for i, value in enumerate(scores)],
        usage=usage(pairs),
    )


def read_rerank_request() -> tuple[dict[str, Any], Serving]:
    """The request and what is served: a 404 on a server without a rerank model, or for a `model` that
    is not it (it may be left out)."""
    data, serving = read_request(model_field=None)
    if serving.rerank_tokenizer is None:
        raise ApiError(404, "this server has no rerank model: start it with --rerank-model (a cross-encoder)")
    check_model(data, serving, required=False, endpoint=RERANK)
    return data, serving


def tei_rerank(data: dict[str, Any], serving: Serving, query: str) -> Response:
    """Text Embeddings Inference's /rerank, which Haystack's, LlamaIndex's and LangChain's TEI rerankers
    call: `texts` in place of `documents`, `raw_scores` (the logits), `return_text`; a bare list of
    {"index", "score", "text"}, the most relevant first. `truncate` is not needed: no pair is cut short,
    and one too long is a 400 naming it."""
    texts = read_documents(data.get("texts"), "texts")
    raw_scores = read_bool(data, "raw_scores", False)
    return_text = read_bool(data, "return_text", False)
    pairs = [pair_ids(serving, query, text, f"texts[{i}]") for i, text in enumerate(texts)]
    logits = pair_logits(pairs, TEI_FIELDS)
    scores = logits if raw_scores else [sigmoid(logit) for logit in logits]
    ranked = sorted(range(len(pairs)), key=lambda i: -scores[i])
    return jsonify(
        [{"index": i, "score": scores[i]} | ({"text": texts[i]} if return_text else {}) for i in ranked]
    )


def sigmoid(logit: float) -> float:
    """A relevance logit as a score from 0 to 1, by a form whose exp stays at most 1 (a large negative
    logit's exp(-logit) would overflow)."""
    return 1 / (1 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1 + math.exp(logit))


def pair_logits(pairs: list[tuple[list[int], int | None]], fields: ApiFields) -> list[float]:
    """Each pair's relevance logit from the rerank model, in order: each pair a backend request."""
    requests = [
        (ids, SamplingParams(max_tokens=0, embedding=SCORE, pair_start=start)) for ids, start in pairs
    ]
    return [vector[0] for vector in pooled(requests, fields)]


def usage(pairs: list[tuple[list[int], int | None]]) -> dict[str, int]:
    tokens = sum(len(ids) for ids, _ in pairs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def read_texts(data: dict[str, Any], name: str) -> list[str]:
    """`text_1` or `text_2`: a non-empty string, or a non-empty list of them."""
    value = data.get(name)
    if isinstance(value, list) and value:
        return [
            read_string({f"{name}[{i}]": text}, f"{name}[{i}]", required=True, non_empty=True)
            for i, text in enumerate(value)
        ]
    if isinstance(value, list):
        raise InvalidParams(name, f"{name} must not be empty")
    return [read_string(data, name, required=True, non_empty=True)]


def read_documents(value: Any, field: str = "documents") -> list[str]:
    """`documents` (or TEI's `texts`): a non-empty list of strings, or of objects whose `text` is one."""
    if not isinstance(value, list) or not value:
        raise InvalidParams(field, f"{field} is required: a non-empty list of strings")
    texts = []
    for i, document in enumerate(value):
        name = f"{field}[{i}]"
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

"""`POST /v1/rerank` (and `/rerank`, `/v2/rerank`): Jina's and Cohere's rerank API, as vLLM and llama.cpp's
server serve it. Each document's relevance to the query, scored by the `--rerank-model` (a cross-encoder
that reads the query and the document together, backend/model/embeddings.py), the most relevant first.
vLLM's `POST /v1/score` (and `/score`) scores pairs of texts with it too, in the order given; and a body
with `texts` in place of `documents` at /rerank (TEI's path) is Text Embeddings Inference's (`tei_rerank`).

`query` is a string; `documents` a list of strings or of objects with a `text` (Jina's and Cohere's
structured documents), each one backend request, so no more than the rows and the queue hold together;
`top_n` keeps the first N results (default: all); `return_documents` (default true, as Jina and vLLM)
sends each document back with its score. `model` may be left out; given, it must name the rerank model.
A pair longer than the rerank model takes is a 400 naming its document, unless the request asks for it
cut (`Truncation`): vLLM's `truncate_prompt_tokens` (here and at /v1/score), Cohere's
`max_tokens_per_doc`, TEI's `truncate` and `truncation_direction`. Scores are the sigmoid of the model's
relevance logit, from 0 to 1. A server without `--rerank-model` answers 404.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, jsonify, request

from backend.messages import SCORE, InvalidParams, SamplingParams
from inference_api.embedder import pooled
from inference_api.errors import ApiError, answer_errors_as_tgi
from inference_api.fields import read_bool, read_integer, read_string, read_truncation_direction, within
from inference_api.generation import RERANK, ApiFields, check_model, read_request
from inference_api.router import Serving

bp = Blueprint("rerank_api", __name__)


@bp.post("/rerank")
@bp.post("/v1/rerank")
@bp.post("/v2/rerank")
def rerank() -> Response:
    data, serving = read_rerank_request()
    tei = request.path == "/rerank" and "texts" in data and "documents" not in data
    if tei:
        answer_errors_as_tgi()
    query = read_string(data, "query", required=True, non_empty=True)
    if tei:
        return tei_rerank(data, serving, query)
    documents = read_documents(data.get("documents"))
    top_n = read_integer(data, "top_n", None, 1, 1 << 31) or len(documents)
    return_documents = read_bool(data, "return_documents", True)
    truncation = Truncation.vllm(data, serving)
    truncation.document_most = read_integer(data, "max_tokens_per_doc", None, 1, 1 << 31)  # Cohere's
    pairs = [(query, document) for document in documents]
    logits, tokens = pair_logits(serving, pairs, "documents", truncation)
    scores = [sigmoid(logit) for logit in logits]
    results = [{"index": i, "relevance_score": scores[i]} for i in most_relevant_first(scores)[:top_n]]
    for result in results if return_documents else ():
        result["document"] = {"text": documents[result["index"]]}
    return jsonify(
        id=f"rerank-{uuid.uuid4().hex}", model=serving.rerank_names[0], results=results, usage=usage(tokens)
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
    pairs = list(zip(firsts, seconds, strict=True))
    logits, tokens = pair_logits(serving, pairs, "text_2", Truncation.vllm(data, serving))
    return jsonify(
        id=f"score-{uuid.uuid4().hex}",
        object="list",
        created=int(time.time()),
        model=serving.rerank_names[0],
        data=[{"index": i, "object": "score", "score": sigmoid(logit)} for i, logit in enumerate(logits)],
        usage=usage(tokens),
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
    {"index", "score", "text"}, the most relevant first. `truncate` cuts a pair too long for the model
    (else a 400 naming it), from the end of its texts or, with `truncation_direction` "left", from their
    start."""
    texts = read_documents(data.get("texts"), "texts")
    raw_scores = read_bool(data, "raw_scores", False)
    return_text = read_bool(data, "return_text", False)
    logits, _ = pair_logits(
        serving, [(query, text) for text in texts], "texts", Truncation.tei(data, serving)
    )
    scores = logits if raw_scores else [sigmoid(logit) for logit in logits]
    results = [{"index": i, "score": scores[i]} for i in most_relevant_first(scores)]
    for result in results if return_text else ():
        result["text"] = texts[result["index"]]
    return jsonify(results)


@dataclass
class Truncation:
    """How a request asks its pairs cut: to `most` tokens in all (longest first, ModelTokenizer.encode_pair),
    each document to `document_most`, from the texts' ends or (`direction` "left") their starts. None:
    not cut, a pair too long being a 400."""

    most: int | None = None
    document_most: int | None = None
    direction: str = "right"
    asked_by: str = "truncate_prompt_tokens: -1"  # what cuts a pair to fit, in the request's API

    @classmethod
    def vllm(cls, data: dict[str, Any], serving: Serving) -> Truncation:
        """vLLM's `truncate_prompt_tokens`: a pair cut to that many tokens (-1: to the rerank model's own),
        from the texts' start, as vLLM's "left truncation" keeps their last tokens."""
        most = serving.backend.rerank_model.max_tokens
        tokens = read_integer(data, "truncate_prompt_tokens", None, -1, most)
        if tokens is None:
            return cls()
        if tokens == -1:
            return cls(most, direction="left")
        # Fewer would leave the texts no token at all beside the pair's special tokens.
        least = serving.rerank_tokenizer.pair_special_tokens + 2
        if tokens < least:
            message = f"truncate_prompt_tokens must be -1 or from {least} to {most}, got {tokens}"
            raise InvalidParams("truncate_prompt_tokens", message)
        return cls(tokens, direction="left")

    @classmethod
    def tei(cls, data: dict[str, Any], serving: Serving) -> Truncation:
        """Text Embeddings Inference's `truncate` (to the model's tokens) and `truncation_direction`
        ("right", the default, or "left"; TEI spells them "Right" and "Left")."""
        direction = read_truncation_direction(data)
        most = serving.backend.rerank_model.max_tokens if read_bool(data, "truncate", False) else None
        return cls(most, direction=direction, asked_by="truncate: true")


def pair_logits(
    serving: Serving, texts: list[tuple[str, str]], field: str, truncation: Truncation
) -> tuple[list[float], int]:
    """Each pair of texts' relevance logit from the rerank model, in order, each pair a backend request
    (a 400 naming `field[i]` for one the model cannot take), and the pairs' tokens."""
    pairs = [
        pair_ids(serving, first, second, f"{field}[{i}]", truncation)
        for i, (first, second) in enumerate(texts)
    ]
    requests = [(ids, SamplingParams(max_tokens=0, embedding=SCORE, pair_start=at)) for ids, at in pairs]
    vectors = pooled(requests, ApiFields(prompt_ids=field, count=field))
    return [vector[0] for vector in vectors], sum(len(ids) for ids, _ in pairs)


def most_relevant_first(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def sigmoid(logit: float) -> float:
    """A relevance logit as a score from 0 to 1, by a form whose exp stays at most 1 (a large negative
    logit's exp(-logit) would overflow)."""
    return 1 / (1 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1 + math.exp(logit))


def usage(tokens: int) -> dict[str, int]:
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


def pair_ids(
    serving: Serving, query: str, document: str, param: str, truncation: Truncation
) -> tuple[list[int], int | None]:
    """The query and the document as the rerank model's tokenizer joins them (cut as the request asks),
    and where the document's token type begins; a 400 naming `param` for a pair longer than the model
    takes."""
    tokenizer, model = serving.rerank_tokenizer, serving.backend.rerank_model
    ids, start = tokenizer.encode_pair(
        query, document, truncation.most, truncation.document_most, truncation.direction
    )
    if len(ids) > (most := model.max_tokens):
        message = f"{param} and the query have {len(ids)} tokens; the rerank model takes {most}"
        raise InvalidParams(param, f"{message} ({truncation.asked_by} cuts it to fit)")
    return ids, start

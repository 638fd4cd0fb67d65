"""vLLM's `/tokenize` and `/detokenize`: the served model's tokenizer over HTTP.

    POST /tokenize    {"prompt": "...", "add_special_tokens": true}
                      {"messages": [...], "add_generation_prompt": true}
                   -> {"count": n, "max_model_len": L, "tokens": [...], "token_strs": [...] | null}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}

`model`, when given, must name the served model. Messages go through the
model's chat template as /v1/chat/completions renders them.
"""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from backend.messages import InvalidParams
from inference_api.fields import read_bool, read_string
from inference_api.generation import read_request
from inference_api.prompts import chat_prompt_ids, token_id_list

bp = Blueprint("tokenize_api", __name__)


@bp.post("/tokenize")
def tokenize() -> Response:
    data, serving = read_request(model_required=False)
    if data.get("messages") is not None:
        add_generation_prompt = read_bool(data, "add_generation_prompt", True)
        add_special_tokens = read_bool(data, "add_special_tokens", False)
        tokens = chat_prompt_ids(data, serving, add_generation_prompt, add_special_tokens)
    else:
        prompt = read_string(data, "prompt", required=True)
        tokens = serving.tokenizer.encode(
            prompt, add_special_tokens=read_bool(data, "add_special_tokens", True)
        )
    token_strs = (
        [serving.tokenizer.token_text(t) for t in tokens]
        if read_bool(data, "return_token_strs", False)
        else None
    )
    return jsonify(
        count=len(tokens), max_model_len=serving.backend.max_seq_len, tokens=tokens, token_strs=token_strs
    )


@bp.post("/detokenize")
def detokenize() -> Response:
    data, serving = read_request(model_required=False)
    if data.get("tokens") is None:
        raise InvalidParams("tokens", "tokens is required: a list of token ids")
    tokens = token_id_list(data["tokens"], serving.token_id_limit, "tokens")
    return jsonify(prompt=serving.tokenizer.decode(list(tokens)))

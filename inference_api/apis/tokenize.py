"""`/tokenize` and `/detokenize`: the served model's tokenizer over HTTP, as vLLM and llama-server (which
share the paths) shape them.

    POST /tokenize    {"prompt": "...", "add_special_tokens": true}
                      {"messages": [...], "add_generation_prompt": true, "tools": [...]}
                      {"messages": [..., assistant], "continue_final_message": true,
                       "add_generation_prompt": false}
                   -> {"count": n, "max_model_len": L, "tokens": [...], "token_strs": [...] | null}
                      {"content": "...", "add_special": false, "parse_special": true, "with_pieces": false}
                   -> {"tokens": [...]}, with_pieces: {"tokens": [{"id": n, "piece": "..." | [bytes]}]}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "...", "content": "..."}

`model`, when given, must name the served model. Messages (with their tools,
chat_template_kwargs and a final message to continue) go through the model's
chat template as /v1/chat/completions renders them, so that the count is the
prompt's that chat would answer from. A body with `content` and neither
`prompt` nor `messages` is llama-server's: special tokens are added only with
`add_special`, special tokens' texts are those tokens unless `parse_special` is
false, and `with_pieces` gives each token's piece, its text, or its bytes where
they are part of a character. /detokenize's text keeps special tokens' texts,
as both servers' do, under each server's name for it.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

from backend.messages import InvalidParams
from inference_api.fields import read_bool, read_string
from inference_api.generation import read_request
from inference_api.prompts import final_message, read_messages, template_kwargs, token_id_list, tool_chat_ids
from inference_api.router import Serving
from inference_api.tool_calls import read_tool_request

bp = Blueprint("tokenize_api", __name__)


@bp.post("/tokenize")
def tokenize() -> Response:
    data, serving = read_request(model_required=False)
    if "content" in data and data.get("prompt") is None and data.get("messages") is None:
        return _llama_server_tokens(data, serving)
    if data.get("messages") is not None:
        messages, prefill, generation_prompt = final_message(data, read_messages(data["messages"]))
        tokens = tool_chat_ids(
            messages,
            read_tool_request(data, serving.tool_parser, call_tags=serving.call_tags),
            serving,
            "messages",
            continuation=prefill,
            template_kwargs=template_kwargs(data),
            add_generation_prompt=generation_prompt,
            add_special_tokens=read_bool(data, "add_special_tokens", False),
        )
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


def _llama_server_tokens(data: dict[str, Any], serving: Serving) -> Response:
    text = read_string(data, "content", required=True)
    add_special = read_bool(data, "add_special", False)
    if read_bool(data, "parse_special", True):
        tokens = serving.tokenizer.encode(text, add_special_tokens=add_special)
    else:
        tokens = serving.tokenizer.encode_text(text, add_special_tokens=add_special)
    if read_bool(data, "with_pieces", False):
        pieces = [{"id": token, "piece": piece(serving.tokenizer.token_bytes(token))} for token in tokens]
        return jsonify(tokens=pieces)
    return jsonify(tokens=tokens)


def piece(token_bytes: bytes) -> str | list[int]:
    """A token's piece as llama-server gives it: its text where its bytes are whole UTF-8, else them."""
    try:
        return token_bytes.decode()
    except UnicodeDecodeError:
        return list(token_bytes)


@bp.post("/detokenize")
def detokenize() -> Response:
    data, serving = read_request(model_required=False)
    if data.get("tokens") is None:
        raise InvalidParams("tokens", "tokens is required: a list of token ids")
    tokens = token_id_list(data["tokens"], serving.token_id_limit, "tokens")
    text = serving.tokenizer.decode(list(tokens), skip_special_tokens=False)
    return jsonify(prompt=text, content=text)

"""Text Generation Inference's request (`{"inputs", "parameters", "stream"}`), parsed and checked as TGI's
router checks it, to this server's SamplingParams.

TGI samples only when asked: `do_sample`, or any of `temperature`, `top_k`, `top_p`, `typical_p` set to
cut or reshape the distribution; else the answer is greedy. `max_new_tokens` defaults to 100, `stop` takes
up to 4 strings, `truncate` keeps the input's last tokens, `typical_p` cuts as TGI's does, and `grammar`
is `{"type": "json" (or "json_object"), "value": schema}`, `{"type": "regex", "value": pattern}` or
`{"type": "json_schema", "value": {"schema": ...}}`. What TGI has and this server does not (`best_of` over
1, `watermark`) is a 400 naming it. `model` is not read: TGI serves one model and its clients send none;
`adapter_id` names a LoRA adapter (--lora-modules) that answers, as TGI's multi-LoRA serving does
(routes.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from backend.messages import MAX_LOGPROBS, MAX_REPETITION_PENALTY, InvalidParams, SamplingParams
from inference_api.fields import (
    read_bool,
    read_integer,
    read_number,
    read_object,
    read_stop,
    read_string,
    within,
)
from inference_api.prompts import MAX_TOP_K, completion_budget
from inference_api.router import Serving
from inference_api.structured_output import tgi_grammar
from inference_api.tokenizer import stop_token_ids_of

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's
MAX_STOP_SEQUENCES = 4  # TGI's default --max-stop-sequences
MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
SEED_MAX = 2**64 - 1
# TGI's parameters that this server does not build, and the values that ask for nothing.
NOT_BUILT = {
    "best_of": (None, 1),
    "watermark": (None, False),
}


@dataclass(frozen=True)
class TgiRequest:
    inputs: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    details: bool  # the answer's tokens, their logprobs and why it ended
    decoder_input_details: bool  # the input's tokens and their logprobs too (`prefill`)
    return_full_text: bool  # the input before the generated text
    top_n_tokens: int  # the most likely tokens at each position, with each token


def parse_generate_request(data: dict[str, Any], serving: Serving, stream: bool | None) -> TgiRequest:
    """The request to /generate (`stream` False), /generate_stream (True) or / (None: its `stream`)."""
    inputs = read_string(data, "inputs", required=True, non_empty=True)
    stream = read_bool(data, "stream", False) if stream is None else stream
    parameters = read_object(data, "parameters")
    with within("parameters"):
        _refuse_not_built(parameters)
        truncate = read_integer(parameters, "truncate", None, 1, serving.backend.max_seq_len)
        max_new_tokens = read_integer(parameters, "max_new_tokens", None, 1, serving.backend.max_seq_len)
        details = read_bool(parameters, "details", False)
        return_full_text = read_bool(parameters, "return_full_text", False)
        decoder_input_details = read_bool(parameters, "decoder_input_details", False)
        if decoder_input_details and stream:
            message = "decoder_input_details is not supported when streaming"
            raise InvalidParams("decoder_input_details", message)
        top_n_tokens = read_integer(parameters, "top_n_tokens", 0, 0, min(MAX_TOP_N_TOKENS, MAX_LOGPROBS))
        stop = read_stop(parameters, "stop", MAX_STOP_SEQUENCES)
        params = SamplingParams(
            **_sampling(parameters),
            stop=stop,
            stop_token_ids=stop_token_ids_of(stop, serving.tokenizer),
            seed=read_integer(parameters, "seed", None, 0, SEED_MAX),
            repetition_penalty=read_number(
                parameters, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True
            ),
            frequency_penalty=read_number(parameters, "frequency_penalty", 0.0, -2.0, 2.0),
            grammar=_grammar(parameters.get("grammar")),
            # Each token's id and logprob, which TGI gives with each streamed token and in the details
            # (a whole answer without details is its text: nothing more to compute at each step).
            logprobs=top_n_tokens if stream or details else None,
            prompt_logprobs=0 if decoder_input_details else None,
        )
    prompt_ids = serving.tokenizer.encode(inputs)
    if truncate is not None:
        prompt_ids = prompt_ids[-truncate:]  # TGI keeps the input's end
    budget = completion_budget(serving, len(prompt_ids), max_new_tokens, DEFAULT_MAX_NEW_TOKENS, "inputs")
    return TgiRequest(
        inputs,
        prompt_ids,
        replace(params, max_tokens=budget),
        stream,
        details,
        decoder_input_details,
        return_full_text,
        top_n_tokens,
    )


def _refuse_not_built(parameters: dict[str, Any]) -> None:
    for name, asks_nothing in NOT_BUILT.items():
        if parameters.get(name) not in asks_nothing:
            raise InvalidParams(name, f"{name} is not supported by this server; leave it out")


def _sampling(parameters: dict[str, Any]) -> dict[str, Any]:
    """temperature, top_p, top_k and typical_p: greedy unless `do_sample` or a value that reshapes the
    distribution (as TGI's server decides). TGI's ranges: a temperature over 0, a top_p and a typical_p
    in (0, 1], a top_k over 0. (LangChain's HuggingFaceEndpoint sends typical_p 0.95 unless told.)"""
    temperature = read_number(parameters, "temperature", 1.0, 0.0, 100.0, low_open=True)
    top_p = read_number(parameters, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = read_integer(parameters, "top_k", None, 1, MAX_TOP_K) or 0
    typical_p = read_number(parameters, "typical_p", 1.0, 0.0, 1.0, low_open=True)
    reshaped = temperature != 1.0 or top_p < 1.0 or top_k > 0 or typical_p < 1.0
    if not (read_bool(parameters, "do_sample", False) or reshaped):
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "typical_p": typical_p}


def _grammar(value: Any) -> str | None:
    """TGI's `grammar`: JSON following a schema (an object, or the schema as a JSON string), or text
    matching a regex (structured_output.tgi_grammar)."""
    return None if value is None else tgi_grammar(value, "grammar")

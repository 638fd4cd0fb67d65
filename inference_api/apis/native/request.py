"""The native API's request body (SPEC §4.1): parse, apply its defaults, validate.

Everything here is checked before the request reaches the backend; the only
check left for later is prompt + max_tokens against the model's context,
which needs the tokenizer (see `check_context`).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.messages import MAX_REPETITION_PENALTY, InvalidParams, SamplingParams
from inference_api.fields import (
    parse_json_object,
    read_bool,
    read_integer,
    read_number,
    read_stop,
    read_string,
)
from inference_api.structured_output import read_grammar

MAX_TOKENS_LIMIT = 2048
SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class NativeRequest:
    text: str
    params: SamplingParams
    stream: bool
    return_prompt: bool


def parse_native_request(body: bytes) -> NativeRequest:
    """The request, or InvalidParams naming the first field that is wrong."""
    data = parse_json_object(body)
    text = read_string(data, "text", required=True, non_empty=True)
    params = SamplingParams(
        temperature=read_number(data, "temperature", 1.0, 0.0, 10.0),
        top_k=read_integer(data, "top_k", 40, 1, 1000),
        top_p=read_number(data, "top_p", 0.9, 0.0, 1.0, low_open=True),
        max_tokens=read_integer(data, "max_tokens", 128, 1, MAX_TOKENS_LIMIT),
        stop=read_stop(data, "stop_sequence"),
        seed=read_integer(data, "seed", None, 0, SEED_MAX),
        # The OpenAI API's penalties and filters, under the same names (vLLM's, for the last three).
        presence_penalty=read_number(data, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=read_number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=read_number(
            data, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True
        ),
        min_p=read_number(data, "min_p", 0.0, 0.0, 1.0),
        typical_p=read_number(data, "typical_p", 1.0, 0.0, 1.0, low_open=True),  # TGI's: 1 cuts nothing
        min_tokens=read_integer(data, "min_tokens", 0, 0, MAX_TOKENS_LIMIT),
        grammar=read_grammar(data, ("json_schema",)),  # the answer is JSON following this schema
        speculative=read_bool(data, "speculative", True),
    )
    if params.min_tokens > params.max_tokens:
        raise InvalidParams(
            "min_tokens", f"min_tokens ({params.min_tokens}) is over max_tokens ({params.max_tokens})"
        )
    return NativeRequest(
        text=text,
        params=params,
        stream=read_bool(data, "stream", True),
        return_prompt=read_bool(data, "return_prompt", False),
    )


def check_context(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
    """Prompt and answer must fit in a row of the backend's KV cache."""
    if prompt_tokens == 0:
        raise InvalidParams("text", "text gives no tokens")
    if prompt_tokens + max_tokens > max_seq_len:
        raise InvalidParams(
            "text",
            f"text is {prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{prompt_tokens + max_tokens} tokens, over the model's context of {max_seq_len} tokens",
        )

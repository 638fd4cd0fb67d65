"""llama.cpp server's `/completion` request, parsed and checked, to this server's SamplingParams.

llama.cpp samples by default (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), `n_predict` -1
goes on to the end of the context, `seed` -1 is a random one, `top_k` 0 and `top_p` 1 cut nothing.
`grammar` is GBNF (llama.cpp's grammar format, read by llguidance's converter) and `json_schema` a
JSON schema. `repeat_penalty` divides the logits of every token of the prompt and the answer, as vLLM's
`repetition_penalty` (llama.cpp's counts the last `repeat_last_n` only). What llama.cpp has and this
server does not (mirostat, typical, DRY and XTC sampling, dynamic temperature, images, LoRA, sampling
after the chain) is a 400 naming it unless it asks for nothing; `cache_prompt`, `id_slot` and
`samplers` are taken with no effect (the prompt cache is always on, rows are not chosen by the client).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llguidance.gbnf_to_lark import gbnf_to_lark

from backend.messages import MAX_LOGPROBS, MAX_REPETITION_PENALTY, InvalidParams, SamplingParams
from inference_api.fields import read_bool, read_integer, read_number, read_stop
from inference_api.prompts import MAX_TOP_K, completion_budget, prompt_ids
from inference_api.router import Serving
from inference_api.structured_output import lark_grammar, schema_grammar
from inference_api.tokenizer import stop_token_ids_of

# llama-server's sampling defaults, which /props reports as well.
DEFAULTS = {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": -1}
MAX_STOP_WORDS = 16
SEED_MAX = 2**32 - 1  # llama.cpp's seeds are 32-bit; -1 (its default) is a random one
# llama.cpp's parameters that this server does not build, and the values that ask for nothing.
NOT_BUILT = {
    "mirostat": (None, 0),
    "typical_p": (None, 1, 1.0),
    "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0),
    "dynatemp_range": (None, 0, 0.0),
    "n_indent": (None, 0),
    "t_max_predict_ms": (None, 0),
    "image_data": (None, []),
    "lora": (None, []),
    "post_sampling_probs": (None, False),
}


@dataclass(frozen=True)
class LlamaCppRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    n_probs: int  # the most likely tokens at each position, with each token (0: none)
    return_tokens: bool  # the answer's token ids in `tokens` (always when streaming)


def parse_completion_request(data: dict[str, Any], serving: Serving) -> LlamaCppRequest:
    for name, asks_nothing in NOT_BUILT.items():
        if data.get(name) not in asks_nothing:
            raise InvalidParams(name, f"{name} is not supported by this server; leave it out")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(item, str) for item in prompt):
        raise InvalidParams("prompt", "prompt must be one prompt (a string or token ids): send one a request")
    ids = prompt_ids(prompt, serving, "prompt")
    context = serving.backend.max_seq_len
    n_predict = read_integer(data, "n_predict", DEFAULTS["n_predict"], -1, context)
    stream = read_bool(data, "stream", False)
    n_probs = read_integer(data, "n_probs", 0, 0, MAX_LOGPROBS)
    return_tokens = read_bool(data, "return_tokens", False)
    read_bool(data, "cache_prompt", True)  # checked, and always so: the prompt cache is the server's
    stop = read_stop(data, "stop", MAX_STOP_WORDS)
    seed = read_integer(data, "seed", DEFAULTS["seed"], -1, SEED_MAX)
    top_k = read_integer(data, "top_k", DEFAULTS["top_k"], -MAX_TOP_K, MAX_TOP_K)
    params = SamplingParams(
        temperature=max(
            0.0, read_number(data, "temperature", DEFAULTS["temperature"], -100.0, 100.0)
        ),  # below 0: greedy
        top_k=max(top_k, 0),  # 0 or below: no cut
        top_p=read_number(data, "top_p", DEFAULTS["top_p"], 0.0, 1.0, low_open=True),
        min_p=read_number(data, "min_p", DEFAULTS["min_p"], 0.0, 1.0),
        max_tokens=_budget(serving, len(ids), n_predict),
        stop=stop,
        stop_token_ids=stop_token_ids_of(stop, serving.tokenizer),
        seed=None if seed == -1 else seed,
        ignore_eos=read_bool(data, "ignore_eos", False),
        repetition_penalty=read_number(
            data, "repeat_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True
        ),
        presence_penalty=read_number(data, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=read_number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(data.get("logit_bias"), serving.token_id_limit),
        grammar=_grammar(data),
        # token ids come with the logprobs entries: asked for whenever the answer lists its tokens
        logprobs=n_probs if n_probs or stream or return_tokens else None,
    )
    return LlamaCppRequest(ids, params, stream, n_probs, return_tokens or stream)


def _budget(serving: Serving, prompt_tokens: int, n_predict: int) -> int:
    """n_predict tokens, 0 to only evaluate the prompt, -1 to the end of the context (a 400 for an answer
    that cannot fit, or a prompt that leaves no room)."""
    if n_predict == -1:
        n_predict = max(1, serving.backend.max_seq_len - prompt_tokens)
    return completion_budget(serving, prompt_tokens, n_predict, n_predict, "prompt")


def _logit_bias(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """llama.cpp's `[[token id, bias or false], ...]` (false: never), or `{"id": bias}` as OpenAI's."""
    if value is None:
        return ()
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise InvalidParams("logit_bias", "logit_bias must be [[token id, bias], ...] or {token id: bias}")
    biases = []
    for token, bias in pairs:
        token_id = int(token) if isinstance(token, str) and token.isdecimal() else token
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise InvalidParams("logit_bias", f"logit_bias: {token!r} is not a token id below {vocab}")
        if bias is False:
            bias = -100.0  # as far down as a bias goes: the token is never chosen
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidParams("logit_bias", f"logit_bias: the bias of {token_id} must be from -100 to 100")
        biases.append((token_id, float(bias)))
    return tuple(biases)


def _grammar(data: dict[str, Any]) -> str | None:
    grammar, schema = data.get("grammar"), data.get("json_schema")
    if grammar is not None and schema is not None:
        raise InvalidParams("json_schema", "grammar and json_schema cannot be combined: give one")
    if schema is not None:
        return schema_grammar(schema, "json_schema")
    if grammar is None or grammar == "":
        return None
    if not isinstance(grammar, str):
        raise InvalidParams("grammar", "grammar must be a GBNF grammar (a string)")
    try:
        lark = gbnf_to_lark(grammar)
    except Exception as error:  # the converter raises a bare Exception too (a rule never defined)
        raise InvalidParams("grammar", f"grammar is not a GBNF grammar this server reads: {error}") from None
    return lark_grammar(lark, "grammar")

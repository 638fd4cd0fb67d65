"""llama.cpp server's `/completion` request, parsed and checked, to this server's SamplingParams.

llama.cpp samples by default (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), `n_predict` -1
goes on to the end of the context, `seed` -1 is a random one, `top_k` 0, `top_p` 1 and `typical_p` 1 cut
nothing (a typical cut is the last of them here, llama.cpp's second: backend/layers/sampler.py).
`grammar` is GBNF (llama.cpp's grammar format, read by llguidance's converter) and `json_schema` a
JSON schema. `repeat_penalty` divides the logits of every token of the prompt and the answer, as vLLM's
`repetition_penalty` (llama.cpp's counts the last `repeat_last_n` only). What llama.cpp has and this
server does not (mirostat, DRY and XTC sampling, dynamic temperature, images, LoRA, sampling
after the chain) is a 400 naming it unless it asks for nothing; `cache_prompt`, `id_slot` and
`samplers` are taken with no effect (the prompt cache is always on, rows are not chosen by the client).

`/infill` is `/completion` for a code model's gap: `input_prefix` and `input_suffix` (plain text, or token
ids), other files in `input_extra`, and `prompt`, the middle's start, framed by the vocabulary's
fill-in-the-middle tokens (fill_in_middle.py) and cut as llama-server cuts them to fit (`_infill_ids`).
What editors' plugins (llama.vim, llama.vscode) send with it works on both: `n_indent` and
`t_max_predict_ms` end an answer early (routes.Answer), `response_fields` picks the answer's fields, and
`t_max_prompt_ms` is taken with no effect, as in llama-server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import MAX_LOGPROBS, MAX_REPETITION_PENALTY, InvalidParams, SamplingParams
from inference_api.fields import read_bool, read_integer, read_number, read_stop, read_string
from inference_api.fill_in_middle import (
    DEFAULT_FILENAME,
    ContextFile,
    FillTokens,
    context_ids,
    fill_prompt,
    required_fill_tokens,
)
from inference_api.prompts import MAX_TOP_K, completion_budget, prompt_ids, token_id_list
from inference_api.router import Serving
from inference_api.structured_output import gbnf_grammar, schema_grammar
from inference_api.tokenizer import stop_token_ids_of

# llama-server's sampling defaults, which /props reports as well.
DEFAULTS = {
    "n_predict": -1,
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "typical_p": 1.0,
    "seed": -1,
}
MAX_STOP_WORDS = 16
MAX_MILLISECONDS = 24 * 3600 * 1000  # a time limit of a day or more limits nothing
SEED_MAX = 2**32 - 1  # llama.cpp's seeds are 32-bit; -1 (its default) is a random one
# llama.cpp's parameters that this server does not build, and the values that ask for nothing.
NOT_BUILT = {
    "mirostat": (None, 0),
    "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0),
    "dynatemp_range": (None, 0, 0.0),
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
    n_indent: int = 0  # each line after the answer's first begins with this many spaces or tabs, or ends it
    t_max_predict_ms: int = 0  # this long past its first token, the answer ends at a line break (0: never)
    response_fields: tuple[str, ...] = ()  # the whole answer's fields to give, by path ("timings/prompt_n")


def parse_completion_request(data: dict[str, Any], serving: Serving) -> LlamaCppRequest:
    _refuse_not_built(data)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(item, str) for item in prompt):
        raise InvalidParams("prompt", "prompt must be one prompt (a string or token ids): send one a request")
    return _request(data, serving, prompt_ids(prompt, serving, "prompt"))


def parse_infill_request(data: dict[str, Any], serving: Serving) -> LlamaCppRequest:
    _refuse_not_built(data)
    tokens = required_fill_tokens(serving.tokenizer, "input_prefix")
    return _request(data, serving, _infill_ids(data, serving, tokens), ends=tokens.ends)


def _refuse_not_built(data: dict[str, Any]) -> None:
    for name, asks_nothing in NOT_BUILT.items():
        if data.get(name) not in asks_nothing:
            raise InvalidParams(name, f"{name} is not supported by this server; leave it out")


def _request(
    data: dict[str, Any], serving: Serving, ids: list[int], ends: tuple[int, ...] = ()
) -> LlamaCppRequest:
    """The request for these prompt ids from the rest of its fields; `ends`: tokens that end the answer
    as its end token does (an infill's: fill_in_middle.FillTokens.ends)."""
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
        typical_p=read_number(data, "typical_p", DEFAULTS["typical_p"], 0.0, 1.0, low_open=True),  # 1: no cut
        max_tokens=_budget(serving, len(ids), n_predict),
        stop=stop,
        stop_token_ids=tuple(dict.fromkeys(stop_token_ids_of(stop, serving.tokenizer) + ends)),
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
    read_integer(data, "t_max_prompt_ms", -1, -1, MAX_MILLISECONDS)  # checked; llama-server ignores it too
    return LlamaCppRequest(
        ids,
        params,
        stream,
        n_probs,
        return_tokens or stream,
        n_indent=read_integer(data, "n_indent", 0, 0, context),
        t_max_predict_ms=max(0, read_integer(data, "t_max_predict_ms", -1, -1, MAX_MILLISECONDS)),
        response_fields=_response_fields(data.get("response_fields")),
    )


def _infill_ids(data: dict[str, Any], serving: Serving, tokens: FillTokens) -> list[int]:
    """The infill prompt, cut as llama-server cuts it to fit: the prefix (its last tokens) and the
    suffix (its first) share half the context 3 to 1 (llama-server: its batch), the prompt taken from
    the suffix's share; the other files fill what the context leaves beside the answer's `n_predict`
    tokens (a quarter of the context for -1), their last tokens kept, nearest the gap."""
    tokenizer, context = serving.tokenizer, serving.backend.max_seq_len
    prefix, suffix = _code(data, "input_prefix", serving), _code(data, "input_suffix", serving)
    prompt = read_string(data, "prompt") or ""
    start = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    share = context // 2
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (share // 4)) :] + start
    suffix = suffix[: max(0, share // 4 - (2 + len(start)))]
    n_predict = read_integer(data, "n_predict", DEFAULTS["n_predict"], -1, context)
    answer = context // 4 if n_predict == -1 else max(1, n_predict)
    files = context_ids(tokenizer, tokens, _context_files(data.get("input_extra")))
    room = max(0, context - len(fill_prompt(tokenizer, tokens, prefix, suffix)) - answer)
    return fill_prompt(tokenizer, tokens, prefix, suffix, files[len(files) - min(len(files), room) :])


def _code(data: dict[str, Any], name: str, serving: Serving) -> list[int]:
    """`input_prefix` or `input_suffix`: plain text (a special token's text in it stays text), or token
    ids; required, as in llama-server ("" for none)."""
    value = data.get(name)
    if isinstance(value, list):
        return list(token_id_list(value, serving.token_id_limit, name))
    text = read_string(data, name, required=True)
    return serving.tokenizer.encode_text(text) if text else []


def _context_files(value: Any) -> list[ContextFile]:
    """`input_extra`: other files' text, `[{"text", "filename"?}, ...]`."""
    shape = 'input_extra must be a list of {"text": string, "filename": string}'
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(chunk, dict) for chunk in value):
        raise InvalidParams("input_extra", shape)
    files = []
    for i, chunk in enumerate(value):
        text, filename = chunk.get("text"), chunk.get("filename", DEFAULT_FILENAME)
        if not isinstance(text, str) or not isinstance(filename, str):
            raise InvalidParams("input_extra", f"{shape}: input_extra[{i}] is not")
        files.append(ContextFile(text, filename))
    return files


def _response_fields(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(path, str) for path in value):
        raise InvalidParams("response_fields", 'response_fields must be a list of paths ("timings/prompt_n")')
    return tuple(value)


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
    return None if grammar is None or grammar == "" else gbnf_grammar(grammar, "grammar")

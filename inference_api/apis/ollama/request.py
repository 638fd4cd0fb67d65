"""Ollama's /api/generate and /api/chat requests, parsed and checked, to this server's SamplingParams.

Ollama's defaults: `stream` true, and in `options` temperature 0.8, top_k 40, top_p 0.9, min_p 0,
typical_p 1 (no cut), `num_predict` -1 (here: to the end of the context; -2 the same), a random seed.
Where the model recommends its own (`--generation-config`: its generation_config.json), those win, as a
model's Modelfile parameters win over Ollama's defaults (Qwen3's: temperature 0.6, top_k 20, top_p 0.95).
`repeat_penalty` divides the logits of every token of the prompt and the answer (vLLM's definition) rather
than of Ollama's last `repeat_last_n`, so it applies only when asked (Ollama's default is 1.1). Options
that set up a runner (num_ctx, num_gpu, num_thread, use_mmap...) are taken with no effect: the context,
the device and the batch are the server's. What is not built (mirostat, tfs_z, images, a request's own
`template`) is a 400 naming it unless it asks for nothing. `logprobs` gives each token's logprob, with the
`top_logprobs` most likely in its place (0 to 20).

/api/generate renders `prompt` (and `system`) through the model's chat template as a user's message, as
Ollama does, unless `raw`; `context` (an earlier answer's) goes before it, and `suffix` fills in the
middle on a code model (fill_in_middle.py). /api/chat takes Ollama's messages (`tool_calls` with
arguments as objects, `thinking`, `tool_name`; a last assistant's text is continued, a prefill, as
Ollama's templates continue it) and `tools` as chat's; `format` is "json" or a JSON
schema; `think` turns a reasoning model's thoughts on or off (the chat template's `enable_thinking`, and
`reasoning_effort` for "low", "medium" or "high"), and asks for a model that has them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backend.messages import MAX_LOGPROBS, MAX_REPETITION_PENALTY, InvalidParams, SamplingParams
from inference_api.fields import read_bool, read_integer, read_number, read_stop, read_string
from inference_api.fill_in_middle import fill_prompt, required_fill_tokens
from inference_api.prompts import MAX_TOP_K, completion_budget, read_messages, token_id_list, tool_chat_ids
from inference_api.reasoning import Thinking, thoughts_first
from inference_api.router import Serving
from inference_api.structured_output import json_schema_grammar
from inference_api.tokenizer import stop_token_ids_of
from inference_api.tool_calls import ToolRequest, read_tool_request, with_tool_grammar

ROLES = ("system", "user", "assistant", "tool")
SEED_MAX = 2**64 - 1
EFFORTS = ("low", "medium", "high")  # gpt-oss's reasoning efforts, which Ollama's `think` may name
# Ollama's fields and options this server does not build, and the values that ask for nothing.
NOT_BUILT = {"template": (None, ""), "images": (None, [])}
NOT_BUILT_OPTIONS = {"mirostat": (None, 0), "tfs_z": (None, 1, 1.0)}


@dataclass(frozen=True)
class OllamaRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    tools: ToolRequest | None = None  # chat's tools offered, and how the answer becomes calls
    thinking: Thinking | None = None  # where the prompt leaves a reasoning model's thoughts (None: not read)


def parse_generate(data: dict[str, Any], serving: Serving) -> OllamaRequest | None:
    """The request, or None for an empty prompt: Ollama loads the model and answers at once."""
    _refuse_not_built(data)
    prompt = read_string(data, "prompt") or ""
    suffix = read_string(data, "suffix") or ""
    context = list(token_id_list(data.get("context"), serving.token_id_limit, "context"))
    if not prompt and not suffix and not context:
        return None
    kwargs = _think(data, serving)
    thinking = None
    if suffix:
        tokens = required_fill_tokens(serving.tokenizer, "suffix")
        text = serving.tokenizer.encode_text
        ids = fill_prompt(serving.tokenizer, tokens, text(prompt), text(suffix))
        ends = tokens.ends
    elif read_bool(data, "raw", False):
        ids, ends = serving.tokenizer.encode(prompt, add_special_tokens=not context), ()
    else:
        system = read_string(data, "system")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids, ends = tool_chat_ids(messages, None, serving, "prompt", template_kwargs=kwargs), ()
        thinking = serving.prompt_thinking(ids)
    ids = context + ids
    return _request(data, serving, ids, "prompt", thinking=thinking, ends=ends, token_ids=True)


def parse_chat(data: dict[str, Any], serving: Serving) -> OllamaRequest:
    _refuse_not_built(data)
    tools = read_tool_request({"tools": data.get("tools")}, serving.tool_parser, call_tags=serving.call_tags)
    messages = read_messages(_openai_messages(data.get("messages")), roles=ROLES)
    last = messages[-1]
    prefill = ""
    if last["role"] == "assistant" and last["content"] and "tool_calls" not in last:
        messages, prefill = messages[:-1], last["content"]  # Ollama goes on from it, as its templates do
    kwargs = _think(data, serving)
    ids = tool_chat_ids(messages, tools, serving, "messages", continuation=prefill, template_kwargs=kwargs)
    return _request(data, serving, ids, "messages", tools, serving.prompt_thinking(ids, bool(prefill)))


def _request(
    data: dict[str, Any],
    serving: Serving,
    ids: list[int],
    prompt_param: str,
    tools: ToolRequest | None = None,
    thinking: Thinking | None = None,
    ends: tuple[int, ...] = (),
    token_ids: bool = False,
) -> OllamaRequest:
    """`ends`: tokens that end the answer as an end token does (a middle's); `token_ids`: the answer's
    token ids come back (generate's `context`)."""
    options = _options(data.get("options"))
    context = serving.backend.max_seq_len
    recommended = _recommended(serving)
    num_predict = read_integer(options, "options.num_predict", recommended["num_predict"], -2, context)
    if num_predict == 0:
        raise InvalidParams("options.num_predict", "options.num_predict must be -1, -2 or from 1 up")
    room = context - len(ids)  # as far as the context goes: Ollama would shift it, here the answer ends
    answer = room if num_predict < 0 else min(num_predict, room)
    max_tokens = completion_budget(serving, len(ids), max(1, answer), 1, prompt_param)
    stop = read_stop(options, "options.stop")
    seed = read_integer(options, "options.seed", -1, -(2**63), SEED_MAX)
    params = SamplingParams(
        temperature=read_number(options, "options.temperature", recommended["temperature"], 0.0, 100.0),
        top_k=read_integer(options, "options.top_k", recommended["top_k"], 0, MAX_TOP_K),  # 0: no cut
        top_p=read_number(options, "options.top_p", recommended["top_p"], 0.0, 1.0, low_open=True),
        min_p=read_number(options, "options.min_p", recommended["min_p"], 0.0, 1.0),
        typical_p=read_number(options, "options.typical_p", 1.0, 0.0, 1.0, low_open=True),  # 1: no cut
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=tuple(dict.fromkeys(stop_token_ids_of(stop, serving.tokenizer) + ends)),
        seed=None if seed < 0 else seed,
        repetition_penalty=read_number(
            options,
            "options.repeat_penalty",
            recommended["repeat_penalty"],
            0.0,
            MAX_REPETITION_PENALTY,
            low_open=True,
        ),
        presence_penalty=read_number(options, "options.presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=read_number(options, "options.frequency_penalty", 0.0, -2.0, 2.0),
        grammar=_format(data.get("format")),
        logprobs=_logprobs(data),
        token_ids=token_ids,
    )
    formatted = params.grammar is not None  # a JSON answer, which a reasoning model gives after its thoughts
    params = thoughts_first(
        with_tool_grammar(params, tools, "format"), thinking, formatted, serving.tokenizer
    )
    return OllamaRequest(ids, params, read_bool(data, "stream", True), tools, thinking)


def _logprobs(data: dict[str, Any]) -> int | None:
    """How many alternatives each token's logprob comes with (None: no logprobs)."""
    top = read_integer(data, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not read_bool(data, "logprobs", False):
        if top:
            raise InvalidParams("top_logprobs", "top_logprobs needs logprobs true")
        return None
    return top or 0


def _refuse_not_built(data: dict[str, Any]) -> None:
    for name, asks_nothing in NOT_BUILT.items():
        if data.get(name) not in asks_nothing:
            raise InvalidParams(name, f"{name} is not supported by this server; leave it out")


# Ollama's options that the model's generation_config.json can recommend, and the sampling defaults' names
OLLAMA_OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "num_predict": "max_tokens",
}
OLLAMA_DEFAULTS = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.0,
    "num_predict": -1,
}


def model_parameters(serving: Serving) -> dict[str, float | int]:
    """The model's recommended sampling (--generation-config) in Ollama's names, as a Modelfile's
    PARAMETER lines give them: only those it recommends (vLLM's top_k -1, no cut, is Ollama's 0)."""
    recommended = serving.backend.sampling_defaults
    parameters = {option: recommended[name] for option, name in OLLAMA_OPTIONS.items() if name in recommended}
    if "top_k" in parameters:
        parameters["top_k"] = max(int(parameters["top_k"]), 0)
    if "num_predict" in parameters:
        parameters["num_predict"] = int(parameters["num_predict"])
    return parameters


def _recommended(serving: Serving) -> dict[str, Any]:
    """The defaults of the options a request leaves out: the model's recommendation where it makes one,
    else Ollama's."""
    return OLLAMA_DEFAULTS | model_parameters(serving)


def _options(value: Any) -> dict[str, Any]:
    """`options`, each keyed by its path (`options.temperature`), so that a 400 names it so."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParams("options", "options must be an object")
    for name, asks_nothing in NOT_BUILT_OPTIONS.items():
        if value.get(name) not in asks_nothing:
            raise InvalidParams(f"options.{name}", f"options.{name} is not supported by this server")
    return {f"options.{name}": option for name, option in value.items()}


def _format(value: Any) -> str | None:
    """`format`: "json" (any JSON object) or a JSON schema the answer follows; "" or none: free text."""
    if value is None or value == "":
        return None
    if value == "json":
        return json_schema_grammar({"type": "object"}, "format")
    if not isinstance(value, dict):
        raise InvalidParams("format", 'format must be "json" or a JSON schema (an object)')
    return json_schema_grammar(value, "format")


def _think(data: dict[str, Any], serving: Serving) -> dict[str, Any]:
    """`think` as the chat template's variables: false turns a reasoning model's thoughts off; true, or
    an effort, turns them on and needs a model whose thoughts this server reads."""
    think = data.get("think")
    if think is None or think is False:
        return {} if think is None else {"enable_thinking": False}
    if think is not True and think not in EFFORTS:
        raise InvalidParams("think", f"think must be true, false or one of {', '.join(EFFORTS)}")
    if not serving.reads_reasoning:
        raise InvalidParams(
            "think", f'"{serving.model_name}" does not support thinking (no thoughts this server reads)'
        )
    return {"enable_thinking": True} | ({"reasoning_effort": think} if think in EFFORTS else {})


def _openai_messages(value: Any) -> Any:
    """Ollama's messages in OpenAI chat's shapes: an assistant's calls with their arguments as a JSON
    string; images are a 400 (a text model)."""
    if not isinstance(value, list):
        return value  # read_messages says what is wrong
    shaped = []
    for i, message in enumerate(value):
        if isinstance(message, dict):
            if message.get("images") not in (None, []):
                raise InvalidParams(f"messages[{i}].images", "images are not supported: the model reads text")
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                message = {**message, "tool_calls": [_openai_call(call) for call in calls]}
            if message.get("role") == "tool" and "tool_name" in message:  # the function it answers
                message = {**message, "name": message["tool_name"]}
        shaped.append(message)
    return shaped


def _openai_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), dict):
        return call  # read_tool_calls says what is wrong
    arguments = json.dumps(function["arguments"], ensure_ascii=False)
    return {"type": "function", "function": {**function, "arguments": arguments}}

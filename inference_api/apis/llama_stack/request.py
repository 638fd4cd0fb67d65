"""Llama Stack's inference requests, parsed and checked: completion (`content`), chat completion
(`messages`, through the model's chat template as /v1/chat/completions renders them) and embeddings
(`contents`, each as /v1/embeddings reads an input).

As Llama Stack publishes them: the model as `model_id` (or `model`, its first
releases' name), content as a string, a text item or a list of text items (an
image item is a 400 naming it), and

    "sampling_params": {"strategy": {"type": "greedy"}
                                  | {"type": "top_p", "temperature": T, "top_p": P}
                                  | {"type": "top_k", "top_k": K},
                        "max_tokens": N, "repetition_penalty": R, "stop": [...]}

where greedy is the default, max_tokens 0 or absent means the server's
default, and the first releases' strategy, a name with its values beside it
(`"strategy": "top_p", "temperature": T`), is read too. Errors name nested
fields by their path (`sampling_params.strategy.top_k`).

Embeddings take `contents`, a list of strings or text items, and
`text_truncation` ("none", the default: a content too long is a 400; "start"
or "end": cut from there to what the model takes), and refuse what is not
built: an `output_dimension` (the vectors have the model's hidden size) and a
`task_type` (the model embeds queries and documents alike).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from backend.messages import MAX_REPETITION_PENALTY, InvalidParams, SamplingParams
from inference_api.embedder import Cut, embedding_ids
from inference_api.fields import read_bool, read_integer, read_number, read_object, read_stop, within
from inference_api.prompts import (
    CHAT_DEFAULT_MAX_TOKENS,
    MAX_TOP_K,
    chat_ids,
    completion_budget,
    read_messages,
    text_content,
)
from inference_api.reasoning import Thinking, thoughts_first
from inference_api.router import Serving
from inference_api.tokenizer import stop_token_ids_of
from inference_api.unsupported_fields import reject_unsupported

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_TOP_P = 0.95  # Llama Stack's, for the top_p strategy
STRATEGY_VALUES = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class LlamaStackRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    thinking: Thinking | None = None  # a chat prompt's, Serving.prompt_thinking: the thoughts are left out


def model_field(data: dict[str, Any]) -> str:
    """Where the request names the model: `model_id`, or `model` in the first releases' requests."""
    return "model" if "model" in data and "model_id" not in data else "model_id"


def parse_completion(data: dict[str, Any], serving: Serving) -> LlamaStackRequest:
    reject_unsupported(data, "llama_stack")
    text = text_content(_items(data.get("content")), "content")
    if not text:
        raise InvalidParams("content", "content is required: the text to complete")
    return _request(data, serving, serving.tokenizer.encode(text), "content")


def parse_chat_completion(data: dict[str, Any], serving: Serving) -> LlamaStackRequest:
    reject_unsupported(data, "llama_stack")
    messages = data.get("messages")
    if isinstance(messages, list):
        messages = [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    prompt_ids = chat_ids(read_messages(messages, roles=ROLES), serving, "messages")
    request = _request(data, serving, prompt_ids, "messages")
    # Its message has no field for a reasoning model's thoughts: the content is the answer after them.
    thinking = serving.prompt_thinking(prompt_ids)
    return replace(
        request, params=thoughts_first(request.params, thinking, False, serving.tokenizer), thinking=thinking
    )


def _message(message: Any, param: str) -> Any:
    """A message with its content as a list of items; RAG context and tool calls are not built."""
    if not isinstance(message, dict):
        return message  # read_messages names it
    for name in ("context", "tool_calls"):
        if message.get(name):
            raise InvalidParams(f"{param}.{name}", f"{param}.{name} is not supported by this server")
    return {**message, "content": _items(message.get("content"))}


def _items(content: Any) -> Any:
    """Interleaved content may be one item on its own."""
    return [content] if isinstance(content, dict) else content


def _request(
    data: dict[str, Any], serving: Serving, prompt_ids: list[int], prompt_param: str
) -> LlamaStackRequest:
    sampling = read_object(data, "sampling_params")
    with within("sampling_params"):
        temperature, top_p, top_k = _strategy(sampling)
        max_tokens = read_integer(sampling, "max_tokens", 0, 0, serving.backend.max_seq_len)
        stop = read_stop(sampling, "stop")
        repetition_penalty = read_number(
            sampling, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True
        )
    max_tokens = completion_budget(
        serving, len(prompt_ids), max_tokens or None, CHAT_DEFAULT_MAX_TOKENS, prompt_param
    )
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=stop,
        repetition_penalty=repetition_penalty,
        stop_token_ids=stop_token_ids_of(stop, serving.tokenizer),
    )
    return LlamaStackRequest(prompt_ids, params, read_bool(data, "stream", False))


def _strategy(sampling: dict[str, Any]) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of the sampling strategy."""
    strategy = sampling.get("strategy")
    if isinstance(strategy, str):  # the first releases: a name, its values beside it
        strategy = {"type": strategy, **{name: sampling.get(name) for name in STRATEGY_VALUES}}
    strategy = {"type": "greedy"} if strategy is None else strategy
    if not isinstance(strategy, dict):
        raise InvalidParams("strategy", "strategy must be an object: {type: greedy, top_p or top_k, ...}")
    kind = strategy.get("type")
    with within("strategy"):
        if kind == "greedy":
            return 0.0, 1.0, 0
        temperature = read_number(strategy, "temperature", 1.0, 0.0, 2.0, low_open=True)
        if kind == "top_p":
            return temperature, read_number(strategy, "top_p", DEFAULT_TOP_P, 0.0, 1.0, low_open=True), 0
        if kind == "top_k":
            top_k = read_integer(strategy, "top_k", None, 1, MAX_TOP_K)
            if top_k is None:
                raise InvalidParams("top_k", "top_k is required with the top_k strategy")
            return temperature, 1.0, top_k
        raise InvalidParams("type", f"type must be greedy, top_p or top_k, got {kind!r}")


# text_truncation: "start" cuts a content too long from its start, "end" from its end, to what the model
# takes; "none" leaves it a 400.
NOT_CUT_HINT = 'text_truncation: "end" cuts it to fit'
TEXT_TRUNCATIONS = {
    "none": Cut(field="text_truncation", hint=NOT_CUT_HINT),
    "start": Cut(-1, "left", "text_truncation"),
    "end": Cut(-1, "right", "text_truncation"),
}


def parse_embeddings(data: dict[str, Any], serving: Serving) -> list[list[int]]:
    """The token ids of each of `contents`, for the model that embeds."""
    truncation = data.get("text_truncation") or "none"
    if not isinstance(truncation, str) or truncation not in TEXT_TRUNCATIONS:  # a list is no dict key
        message = f'text_truncation must be "none", "start" or "end", got {truncation!r}'
        raise InvalidParams("text_truncation", message)
    if data.get("output_dimension") is not None:
        message = "output_dimension is not supported: the vectors have the model's hidden size"
        raise InvalidParams("output_dimension", message)
    if data.get("task_type") is not None:
        message = "task_type is not supported: the model embeds queries and documents alike"
        raise InvalidParams("task_type", message)
    contents = data.get("contents")
    if not isinstance(contents, list) or not contents:
        raise InvalidParams("contents", "contents is required: a list of strings or text items to embed")
    texts = [_content_text(content, f"contents[{i}]") for i, content in enumerate(contents)]
    return embedding_ids(texts, serving, "contents", TEXT_TRUNCATIONS[truncation])


def _content_text(content: Any, param: str) -> str:
    """A string, or a text item's text: an image item is a 400 naming it, never dropped."""
    if isinstance(content, str):
        return content
    kind = content.get("type") if isinstance(content, dict) else None
    if kind != "text":
        what = f"an item of type {kind!r}" if isinstance(kind, str) else "not a string or a typed item"
        raise InvalidParams(param, f"{param} is {what}: this server embeds text only")
    if not isinstance(content.get("text"), str):
        raise InvalidParams(f"{param}.text", f"{param}.text must be a string")
    return content["text"]

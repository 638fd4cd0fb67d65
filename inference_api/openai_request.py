"""OpenAI request bodies (SPEC §4.2): `/v1/completions` and `/v1/chat/completions`, parsed and checked.

Normalise first (a prompt or a list of them becomes token ids; messages go
through the chat template), then validate, raising InvalidParams that names
the parameter as OpenAI spells it; the HTTP layer turns it into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from backend.messages import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    InvalidParams,
    SamplingParams,
)
from inference_api.chat_template import ChatTemplateError, UnusableChatTemplate
from inference_api.fields import read_bool, read_integer, read_number, read_stop
from inference_api.router import Serving
from inference_api.structured_output import GUIDED_FIELDS, read_grammar
from inference_api.tokenizer import PromptTokenizer, stop_token_ids_of
from inference_api.tool_calls import (
    ToolRequest,
    read_tool_calls,
    read_tool_request,
    template_messages,
    tools_system_prompt,
)
from inference_api.unsupported_fields import reject_unsupported

MAX_CHOICES = 16
MAX_TOP_K = 1_000_000
SEED_MAX = 2**64 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions API
# Chat without max_tokens: a bounded answer, as the native API's 128, not the rest of a long context
# (2,048 tokens of a row for one forgotten field); capped by the context still free after the prompt.
CHAT_DEFAULT_MAX_TOKENS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")


class ContextLengthExceeded(InvalidParams):
    code = "context_length_exceeded"


@dataclass(frozen=True)
class OpenAIRequest:
    prompts: list[list[int]]  # token ids of each prompt
    n: int  # choices per prompt
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt comes back before the completion...
    prompt_texts: tuple[str, ...] = ()  # ...as this text (the prompt as sent, or its ids decoded)
    tools: ToolRequest | None = None  # chat: the tools offered, and how the answer becomes calls

    @property
    def logprobs(self) -> bool:
        return self.params.logprobs is not None

    def choice_requests(self) -> list[tuple[list[int], SamplingParams]]:
        """One backend request per choice, in OpenAI's order (prompt by prompt, n each).

        With a seed, choice i samples with seed + i: reproducible, yet the n choices differ.
        """
        requests = []
        for prompt_ids in self.prompts:
            for i in range(self.n):
                params = self.params
                if params.seed is not None:
                    params = replace(params, seed=(params.seed + i) % (SEED_MAX + 1))
                requests.append((prompt_ids, params))
        return requests


def parse_completion_request(data: dict[str, Any], serving: Serving) -> OpenAIRequest:
    reject_unsupported(data, "completions")
    sent = prompt_list(data.get("prompt"))
    prompts = [prompt_ids(prompt, serving, f"prompt[{i}]") for i, prompt in enumerate(sent)]
    echo = read_bool(data, "echo", False)
    logprobs = read_integer(data, "logprobs", None, 0, MAX_LOGPROBS)
    openai_request = _common(data, serving, prompts, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, echo)
    best_of = read_integer(data, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != openai_request.n:  # the best of more samples: not built
        raise InvalidParams("best_of", "best_of other than n is not supported by this server")
    if not echo:
        return openai_request
    texts = tuple(
        text if isinstance(text, str) else serving.tokenizer.decode(ids, skip_special_tokens=False)
        for text, ids in zip(sent, prompts, strict=True)
    )
    return replace(openai_request, echo=True, prompt_texts=texts)


def parse_chat_request(data: dict[str, Any], serving: Serving) -> OpenAIRequest:
    reject_unsupported(data, "chat")
    template = serving.chat_template
    tool_request = read_tool_request(data, template.source)
    messages = template_messages(read_messages(data.get("messages")), template.source)
    tools = None
    if tool_request is not None and template.takes_tools:
        tools = tool_request.tools
    elif tool_request is not None:  # a template that knows no tools: they go in a system message
        messages = with_system_text(messages, tools_system_prompt(tool_request.tools))
    prompt_ids = chat_ids(messages, serving, "messages", tools=tools)
    request = _common(data, serving, [prompt_ids], "messages", CHAT_DEFAULT_MAX_TOKENS, _chat_logprobs(data))
    grammar = tool_request.grammar if tool_request is not None else None
    if grammar is not None and request.params.grammar is not None:
        raise InvalidParams(
            "tool_choice", "a required or named tool_choice cannot be combined with response_format"
        )
    params = request.params if grammar is None else replace(request.params, grammar=grammar)
    return replace(request, params=params, tools=tool_request)


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The messages with this text at the end of their system message (one is added if none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def chat_prompt_ids(
    data: dict[str, Any],
    serving: Serving,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """`messages` through the model's chat template, as token ids."""
    messages = read_messages(data.get("messages"))
    return chat_ids(messages, serving, "messages", add_generation_prompt, add_special_tokens)


def chat_ids(
    messages: list[dict[str, Any]],
    serving: Serving,
    param: str,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    continuation: str = "",
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """{role, content} messages (roles system, user, assistant, tool) through the model's chat template, as
    token ids; `continuation` follows the generation prompt: text the answer goes on from (a prefill)."""
    if isinstance(serving.chat_template, UnusableChatTemplate):  # nothing the request could change
        raise InvalidParams(param, f"the model has no usable chat template: {serving.chat_template.problem}")
    try:
        text = serving.chat_template.render(messages, add_generation_prompt, tools)
    except ChatTemplateError as error:
        raise InvalidParams(param, f"the model's chat template refused the {param}: {error}") from None
    # The rendered template already holds its special tokens (apply_chat_template does the same).
    return serving.tokenizer.encode(text + continuation, add_special_tokens=add_special_tokens)


def _chat_logprobs(data: dict[str, Any]) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs: N` as a count of alternatives (None: none)."""
    top = read_integer(data, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not read_bool(data, "logprobs", False):
        if top is not None:
            raise InvalidParams("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


def _common(
    data: dict[str, Any],
    serving: Serving,
    prompts: list[list[int]],
    prompt_param: str,
    default_max_tokens: int,
    logprobs: int | None,
    echo: bool = False,
) -> OpenAIRequest:
    context = serving.backend.max_seq_len
    longest = max(len(ids) for ids in prompts)
    # max_tokens 0 only scores an echoed prompt (what lm-evaluation-harness asks for log-likelihoods).
    fewest = 0 if echo else 1
    max_tokens = read_integer(data, "max_completion_tokens", None, 1, context)
    if max_tokens is None:
        max_tokens = read_integer(data, "max_tokens", None, fewest, context)
    max_tokens = completion_budget(serving, longest, max_tokens, default_max_tokens, prompt_param)
    top_k = read_integer(data, "top_k", -1, -1, MAX_TOP_K)
    stop = read_stop(data, "stop")
    params = SamplingParams(
        temperature=read_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=read_number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k, 0),  # -1 (as in vLLM) or 0: no top-k cut
        max_tokens=max_tokens,
        stop=stop,
        seed=read_integer(data, "seed", None, 0, SEED_MAX),
        ignore_eos=read_bool(data, "ignore_eos", False),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
        presence_penalty=read_number(data, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=read_number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=read_number(
            data, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True
        ),
        min_p=read_number(data, "min_p", 0.0, 0.0, 1.0),
        logit_bias=_logit_bias(data.get("logit_bias"), serving.token_id_limit),
        min_tokens=read_integer(data, "min_tokens", 0, 0, max_tokens),
        stop_token_ids=token_id_list(data.get("stop_token_ids"), serving.token_id_limit, "stop_token_ids")
        + stop_token_ids_of(stop, serving.tokenizer),
        grammar=read_grammar(data, ("response_format", *GUIDED_FIELDS)),
    )
    stream = read_bool(data, "stream", False)
    return OpenAIRequest(
        prompts=prompts,
        n=read_integer(data, "n", 1, 1, MAX_CHOICES),
        params=params,
        stream=stream,
        include_usage=_include_usage(data.get("stream_options"), stream),
    )


def completion_budget(
    serving: Serving, prompt_tokens: int, max_tokens: int | None, default: int, prompt_param: str
) -> int:
    """max_tokens, or by default `default` as far as the context leaves room after the prompt;
    ContextLengthExceeded (a 400) when prompt and answer do not fit in a row."""
    context = serving.backend.max_seq_len
    if max_tokens is None:
        max_tokens = max(1, min(default, context - prompt_tokens))
    if prompt_tokens + max_tokens > context:
        raise ContextLengthExceeded(
            prompt_param,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_param}, {max_tokens} in "
            f"the completion). Please reduce the length of the {prompt_param} or completion.",
        )
    return max_tokens


def _logit_bias(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: ids as strings, biases from -100 to 100."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidParams("logit_bias", "logit_bias must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidParams(
            "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}"
        )
    biases = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or not int(key) < vocab:
            raise InvalidParams("logit_bias", f"logit_bias key {key!r} is not a token id below {vocab}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidParams("logit_bias", f"logit_bias[{key!r}] must be a number from -100 to 100")
        biases.append((int(key), float(bias)))
    return tuple(biases)


def token_id_list(value: Any, vocab: int, param: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_token(t, vocab) for t in value):
        raise InvalidParams(param, f"{param} must be a list of token ids below {vocab}")
    return tuple(value)


def prompt_list(value: Any, param: str = "prompt") -> list[str | list[int]]:
    """A prompt field as a list: a string, a list of strings, a list of token ids, or a list of those."""
    if value is None:
        raise InvalidParams(param, f"{param} is required")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(_is_integer(t) for t in value):
        return [value]
    if isinstance(value, list) and value:
        return value
    raise InvalidParams(param, f"{param} must be a string, a list of strings or a list of token ids")


def prompt_ids(
    prompt: Any,
    serving: Serving,
    item: str,
    param: str = "prompt",
    tokenizer: PromptTokenizer | None = None,
    vocab: int | None = None,
) -> list[int]:
    """One prompt (`item` of the `param` field) as token ids: a string tokenized, or ids checked; by the
    served model's tokenizer and vocabulary unless given others (a separate embedding model's)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParams(param, f"{param} must not be empty")
        ids = (tokenizer or serving.tokenizer).encode(prompt)
        if not ids:
            raise InvalidParams(param, f"{param} gives no tokens")
        return ids
    vocab = vocab or serving.token_id_limit
    if isinstance(prompt, list) and prompt and all(_is_token(t, vocab) for t in prompt):
        return list(prompt)
    raise InvalidParams(param, f"{item} must be a non-empty string or a list of token ids below {vocab}")


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def read_messages(
    value: Any,
    param: str = "messages",
    roles: tuple[str, ...] = ROLES,
    text_types: tuple[str, ...] = ("text",),
) -> list[dict[str, Any]]:
    """A non-empty list of {role, content} objects as the chat template takes them: each content as
    one text (`text_content`), developer read as system. Other fields of a message are ignored."""
    if value is None:
        raise InvalidParams(param, f"{param} is required")
    if not isinstance(value, list) or not value:
        raise InvalidParams(param, f"{param} must be a non-empty list of {{role, content}} objects")
    return [_message(message, f"{param}[{i}]", roles, text_types) for i, message in enumerate(value)]


def _message(message: Any, param: str, roles: tuple[str, ...], text_types: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise InvalidParams(param, f"{param} must be an object with role and content")
    role = message.get("role")
    if role not in roles:
        raise InvalidParams(f"{param}.role", f"{param}.role must be one of {', '.join(roles)}, got {role!r}")
    if message.get("content") is None and role != "assistant":  # only an assistant turn may be empty
        raise InvalidParams(f"{param}.content", f"{param}.content is required in a {role} message")
    shaped: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": text_content(message.get("content"), f"{param}.content", text_types),
    }
    # A conversation with tools: the calls an assistant made, and which call a tool message answers.
    if role == "assistant" and message.get("tool_calls") is not None and "tool" in roles:
        shaped["tool_calls"] = read_tool_calls(message["tool_calls"], f"{param}.tool_calls")
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        shaped["tool_call_id"] = message["tool_call_id"]
    return shaped


def text_content(content: Any, param: str, text_types: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts joined: the only kind of part a text model takes, so that
    a part of another type (an image, a tool call) is a 400 naming it. None is an empty text."""
    if content is None:
        return ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_text_part(part, f"{param}[{i}]", text_types) for i, part in enumerate(content))
    else:
        raise InvalidParams(param, f"{param} must be a string or a list of text parts")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidParams(param, f"{param} is not valid Unicode") from None
    return text


def _text_part(part: Any, param: str, text_types: tuple[str, ...]) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in text_types:
        what = f"a part of type {kind!r}" if isinstance(kind, str) else "not a typed part"
        text_parts = ", ".join(text_types)
        raise InvalidParams(param, f"{param} is {what}: this server takes text parts only ({text_parts})")
    if not isinstance(part.get("text"), str):
        raise InvalidParams(f"{param}.text", f"{param}.text must be a string")
    return part["text"]


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise InvalidParams("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict):
        raise InvalidParams("stream_options", "stream_options must be an object")
    return read_bool(options, "include_usage", False)

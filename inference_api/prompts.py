"""Prompts out of request bodies, as every API reads them: text or token ids, messages through the
model's chat template, and the completion budget the context leaves.

Each API's request parser (apis/*/request.py) reads its own field names and ranges, then builds its
prompt with these, so that a prompt is read and checked the same way whichever API it came through.
"""

from __future__ import annotations

from typing import Any

from backend.messages import InvalidParams
from inference_api.chat_template import (
    REASONING_FIELDS,
    SERVER_SET_VARIABLES,
    ChatTemplateError,
    UnusableChatTemplate,
)
from inference_api.fields import read_bool
from inference_api.harmony import prefilled_answer
from inference_api.listed_tool_calls import takes_system_tools, with_system_tools
from inference_api.reasoning import HARMONY
from inference_api.router import Serving
from inference_api.tokenizer import PromptTokenizer
from inference_api.tool_calls import ToolRequest, read_tool_calls, template_messages, tools_system_prompt

MAX_TOP_K = 1_000_000  # a top_k cut wider than any vocabulary: every API's top_k is read within it
# Chat without max_tokens: a bounded answer, as the native API's 128, not the rest of a long context
# (2,048 tokens of a row for one forgotten field); capped by the context still free after the prompt.
CHAT_DEFAULT_MAX_TOKENS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")


class ContextLengthExceeded(InvalidParams):
    code = "context_length_exceeded"


def final_message(
    data: dict[str, Any], messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], str, bool]:
    """vLLM's `add_generation_prompt` and `continue_final_message`, read together: the messages, the
    prefill the answer goes on from ("" for none) and whether the generation prompt follows them. With
    `continue_final_message` (and `add_generation_prompt: false`, as vLLM asks) the last message, an
    assistant's text, is that prefill: the messages before it, the generation prompt, then its text."""
    continues = read_bool(data, "continue_final_message", False)
    generation_prompt = read_bool(data, "add_generation_prompt", True)
    if continues and generation_prompt:
        raise InvalidParams(
            "add_generation_prompt",
            "continue_final_message goes on from the last message: set add_generation_prompt to false",
        )
    if not continues:
        return messages, "", generation_prompt
    last = messages[-1]
    if last["role"] != "assistant" or "tool_calls" in last or not last["content"]:
        raise InvalidParams(
            f"messages[{len(messages) - 1}]",
            "continue_final_message goes on from the last message, which must be an assistant's text",
        )
    return messages[:-1], last["content"], True


def chat_text(
    messages: list[dict[str, Any]],
    serving: Serving,
    param: str,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """{role, content} messages (roles system, user, assistant, tool) through the model's chat template,
    as text; `template_kwargs`: the request's own variables for the template (vLLM's
    chat_template_kwargs). A template that refuses them is a 400 naming `param`."""
    if isinstance(serving.chat_template, UnusableChatTemplate):  # nothing the request could change
        raise InvalidParams(param, f"the model has no usable chat template: {serving.chat_template.problem}")
    try:
        return serving.chat_template.render(messages, add_generation_prompt, tools, extra=template_kwargs)
    except ChatTemplateError as error:
        raise InvalidParams(param, f"the model's chat template refused the {param}: {error}") from None


def chat_ids(
    messages: list[dict[str, Any]],
    serving: Serving,
    param: str,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    continuation: str = "",
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`chat_text` as token ids; `continuation` follows the generation prompt: text the answer goes on
    from (a prefill; in the final message that it opens, for a model that writes harmony)."""
    text = chat_text(messages, serving, param, add_generation_prompt, tools, template_kwargs)
    if continuation and serving.reasoning_format == HARMONY:
        continuation = prefilled_answer(continuation)
    # The rendered template already holds its special tokens (apply_chat_template does the same).
    return serving.tokenizer.encode(text + continuation, add_special_tokens=add_special_tokens)


def tool_chat_ids(
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    serving: Serving,
    param: str,
    continuation: str = "",
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """A conversation with tools (assistant turns' calls, tool turns' results) and the tools offered, in
    OpenAI chat's shapes, through the chat template as `chat_ids` (`with_tools`)."""
    messages, offered = with_tools(messages, tools, serving)
    return chat_ids(
        messages,
        serving,
        param,
        add_generation_prompt,
        add_special_tokens,
        continuation=continuation,
        tools=offered,
        template_kwargs=template_kwargs,
    )


def with_tools(
    messages: list[dict[str, Any]], tools: ToolRequest | None, serving: Serving
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages in OpenAI chat's shapes as the chat template takes them, and the tools it is given; a
    template that takes them in the system message's `tools` field (Phi-4-mini's) gets them there, one that
    takes no tools in the system message's text, in the format the answer is read in (tool_calls.py)."""
    messages = template_messages(messages, serving.chat_template.source, serving.tool_parser)
    if tools is not None and takes_system_tools(serving.chat_template.source):  # Phi-4-mini's
        return with_system_tools(messages, tools.tools), None
    if tools is not None and serving.chat_template.takes_tools:
        return messages, tools.tools
    if tools is not None:
        messages = with_system_text(messages, tools_system_prompt(tools.tools, tools.parser))
    return messages, None


def template_kwargs(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: the request's own variables for the chat template (Qwen3's and
    SmolLM3's `enable_thinking`, say). A variable the server sets itself (the messages, the tools...) is
    a 400: the server's would win, and the request would not get what it asked for."""
    kwargs = data.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidParams("chat_template_kwargs", "chat_template_kwargs must be an object")
    for name in kwargs:
        if name in SERVER_SET_VARIABLES:
            message = f"chat_template_kwargs may not set {name!r}: the server passes it itself"
            raise InvalidParams("chat_template_kwargs", message)
    return dict(kwargs)


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The messages with this text at the end of their system message (one is added if none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def model_sampling_defaults(serving: Serving) -> dict[str, float]:
    """The model's recommended top_k, min_p and repetition_penalty (--generation-config) as SamplingParams
    fields, for the APIs with no request fields of their own for them (the Responses and Anthropic APIs)."""
    defaults = serving.backend.sampling_defaults
    fields = {name: defaults[name] for name in ("top_k", "min_p", "repetition_penalty") if name in defaults}
    if "top_k" in fields:
        fields["top_k"] = max(int(fields["top_k"]), 0)  # -1 (vLLM's) or 0: no cut
    return fields


def completion_budget(
    serving: Serving, prompt_tokens: int, max_tokens: int | None, default: int, prompt_param: str
) -> int:
    """max_tokens, or by default `default` as far as the context leaves room after the prompt;
    ContextLengthExceeded (a 400) when prompt and answer do not fit in a row, or when a prompt only
    scored (max_tokens 0) is not shorter than the context: a row's last position holds no token's keys,
    since the decode graphs' padding writes there (engine.Engine.submit, decode_graphs.padding_position)."""
    context = serving.backend.max_seq_len
    if max_tokens is None:
        max_tokens = max(1, min(default, context - prompt_tokens))
    if max_tokens == 0 and prompt_tokens >= context:
        raise ContextLengthExceeded(
            prompt_param,
            f"This model's maximum context length is {context} tokens, and a prompt must be shorter. "
            f"However, the {prompt_param} has {prompt_tokens} tokens. Please reduce its length.",
        )
    if prompt_tokens + max_tokens > context:
        raise ContextLengthExceeded(
            prompt_param,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_param}, {max_tokens} in "
            f"the completion). Please reduce the length of the {prompt_param} or completion.",
        )
    return max_tokens


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
    add_special_tokens: bool = True,
) -> list[int]:
    """One prompt (`item` of the `param` field) as token ids: a string tokenized (with the tokens the
    tokenizer adds around a text, such as a BOS, unless `add_special_tokens` is false), or ids checked; by
    the served model's tokenizer and vocabulary unless given others (a separate embedding model's)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParams(param, f"{param} must not be empty")
        ids = (tokenizer or serving.tokenizer).encode(prompt, add_special_tokens=add_special_tokens)
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
    one text (`text_content`), developer read as system; an assistant's calls and thoughts
    (`reasoning_content`), a tool message's call id and function name. Other fields of a message are
    ignored."""
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
    if role == "tool" and isinstance(message.get("name"), str) and message["name"]:  # the function's name
        shaped["name"] = message["name"]
    # A reasoning model's thoughts in an earlier turn: its template decides whether they go in the prompt.
    if role == "assistant":
        shaped |= {name: message[name] for name in REASONING_FIELDS if isinstance(message.get(name), str)}
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

"""Request fields this server does not implement: a 400 that names them, never a silent default.

A client that sends `tools` expects a tool call; answering with free text as
if the field were honoured would let it believe it got what it asked for
(SPEC §4.2). A field with a value that asks for nothing (`tools: []`, `best_of`
equal to `n`, checked where `n` is read) is accepted. Fields that are accepted and
have no effect here (`user`, `metadata`, `store`, `service_tier`) are listed in docs/frontend.md.

Each API has its own table: the same name is served in one API and refused in
another (`tools` and `logprobs`, served by chat, not by Llama Stack's inference),
and a field of one API is an unknown field, ignored, in another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend.messages import InvalidParams


@dataclass(frozen=True)
class Unsupported:
    asks_for_more: Callable[[Any], bool]  # whether a (non-null) value asks for what is not built
    message: str = "{name} is not supported by this server; leave it out or null"


def _always(value: Any) -> bool:
    return True


# What the Responses API's `include` may ask for here: the thoughts as encrypted_content (responses/items.py)
SEALED_THOUGHTS = "reasoning.encrypted_content"
STATELESS = "this server keeps no responses (it is stateless): send the whole conversation as input"

# vLLM's fields of both OpenAI endpoints that ask for what is not built here: a vLLM client sending one
# would otherwise get sampling for its beam search, or the server's own template for its request's.
VLLM_UNBUILT = {
    "use_beam_search": Unsupported(lambda value: value is not False),
    "logits_processors": Unsupported(lambda value: value != []),
    "guided_whitespace_pattern": Unsupported(_always),
    "priority": Unsupported(
        lambda value: value != 0, "{name} other than 0 is not supported: requests are served in turn"
    ),
}

UNSUPPORTED: dict[str, dict[str, Unsupported]] = {
    # The legacy completions API (and best_of other than n, in openai_request.py).
    "completions": VLLM_UNBUILT,
    "chat": {
        **VLLM_UNBUILT,
        "chat_template": Unsupported(
            _always,
            "{name} in a request is not supported: the template is the server's (--chat-template), as "
            "on vLLM without --trust-request-chat-template",
        ),
        "documents": Unsupported(lambda value: value != []),
        "echo": Unsupported(lambda value: value is not False),  # vLLM's chat echo
        "functions": Unsupported(lambda value: value != []),
        "function_call": Unsupported(lambda value: value != "none"),
        "audio": Unsupported(_always),
        "modalities": Unsupported(lambda value: value != ["text"]),
        "web_search_options": Unsupported(_always),
    },
    # Anthropic's Messages API.
    "messages": {
        "mcp_servers": Unsupported(lambda value: value != []),
        "container": Unsupported(_always),
        "context_management": Unsupported(_always),
        "output_config": Unsupported(lambda value: value != {}),
    },
    # OpenAI's Responses API, served stateless.
    "responses": {
        "store": Unsupported(lambda value: value is not False, "{name}: true is not supported: " + STATELESS),
        "previous_response_id": Unsupported(_always, "{name} is not supported: " + STATELESS),
        "conversation": Unsupported(_always, "{name} is not supported: " + STATELESS),
        "background": Unsupported(lambda value: value is not False),
        "prompt": Unsupported(_always),
        "include": Unsupported(
            lambda value: not isinstance(value, list) or any(v != SEALED_THOUGHTS for v in value),
            '{name}: only "reasoning.encrypted_content" is supported (no logprobs nor hosted tools here)',
        ),
        "top_logprobs": Unsupported(lambda value: value != 0),
        "truncation": Unsupported(
            lambda value: value != "disabled", '{name}: "auto" is not supported: a prompt too long is a 400'
        ),
    },
    # Llama Stack's inference API.
    "llama_stack": {
        "response_format": Unsupported(_always),
        "logprobs": Unsupported(_always),
        "tools": Unsupported(lambda value: value != []),
    },
}


def reject_unsupported(data: dict[str, Any], api: str) -> None:
    """InvalidParams (a 400) for the first field of `api` that asks for what is not built."""
    for name, unsupported in sorted(UNSUPPORTED[api].items()):
        value = data.get(name)
        if value is not None and unsupported.asks_for_more(value):
            raise InvalidParams(name, unsupported.message.format(name=name))

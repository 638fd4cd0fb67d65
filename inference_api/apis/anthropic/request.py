"""Anthropic's Messages request (POST /v1/messages), parsed and checked, with Anthropic's names and ranges.

`system` and `messages` go through the model's chat template as
/v1/chat/completions renders them; a last assistant message is a prefill, the
text the answer goes on from (Anthropic's clients send it to steer the start
of an answer). Content is text: a string or text blocks; an image, document
or tool block is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import InvalidParams, SamplingParams
from inference_api.fields import read_bool, read_integer, read_number, read_stop
from inference_api.prompts import MAX_TOP_K, chat_ids, completion_budget, read_messages, text_content
from inference_api.router import Serving
from inference_api.tokenizer import stop_token_ids_of
from inference_api.unsupported_fields import reject_unsupported

ROLES = ("user", "assistant")
# Anthropic documents no limit; each stop sequence costs a scan of the held-back text per piece.
MAX_STOP_SEQUENCES = 16


@dataclass(frozen=True)
class MessagesRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool


def parse_messages_request(data: dict[str, Any], serving: Serving) -> MessagesRequest:
    reject_unsupported(data, "messages")
    messages = _system(data.get("system")) + read_messages(data.get("messages"), roles=ROLES)
    prefill = messages.pop()["content"] if messages[-1]["role"] == "assistant" else ""
    prompt_ids = chat_ids(messages, serving, "messages", continuation=prefill)
    max_tokens = read_integer(data, "max_tokens", None, 1, serving.backend.max_seq_len)
    if max_tokens is None:
        raise InvalidParams("max_tokens", "max_tokens is required: the most tokens the answer may have")
    completion_budget(serving, len(prompt_ids), max_tokens, max_tokens, "messages")
    stop = read_stop(data, "stop_sequences", MAX_STOP_SEQUENCES)
    params = SamplingParams(
        temperature=read_number(data, "temperature", 1.0, 0.0, 1.0),
        top_p=read_number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=read_integer(data, "top_k", 0, 0, MAX_TOP_K),  # 0: no top-k cut
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids_of(stop, serving.tokenizer),
    )
    return MessagesRequest(prompt_ids, params, read_bool(data, "stream", False))


def _system(system: Any) -> list[dict[str, str]]:
    """The system prompt, a string or text blocks, as the conversation's first message (if any)."""
    text = text_content(system, "system")
    return [{"role": "system", "content": text}] if text else []

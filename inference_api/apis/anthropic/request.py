"""Anthropic's Messages request (POST /v1/messages, and /v1/messages/count_tokens), parsed and checked,
with Anthropic's names and ranges.

`system` and `messages` (conversation.py: text, tool_use and tool_result blocks) go through the model's
chat template as /v1/chat/completions renders them, with the `tools` offered; `tools` and `tool_choice`
(tools.py) are served as chat's are, the calls decoded under the tools' grammar. count_tokens builds the
same prompt as create, without the sampling fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import InvalidParams, SamplingParams
from inference_api.apis.anthropic.conversation import read_conversation
from inference_api.apis.anthropic.tools import read_tools
from inference_api.fields import read_bool, read_integer, read_number, read_stop
from inference_api.prompts import (
    MAX_TOP_K,
    ContextLengthExceeded,
    completion_budget,
    model_sampling_defaults,
    tool_chat_ids,
)
from inference_api.reasoning import HARMONY_PREFILLED, Thinking, thoughts_first
from inference_api.router import Serving
from inference_api.tokenizer import stop_token_ids_of
from inference_api.tool_calls import ToolRequest, with_tool_grammar
from inference_api.unsupported_fields import reject_unsupported

# Anthropic documents no limit; each stop sequence costs a scan of the held-back text per piece.
MAX_STOP_SEQUENCES = 16
MIN_BUDGET = 1024  # thinking's budget_tokens, as Anthropic's API takes it
MAX_INT32 = 2**31 - 1  # the most max_tokens read: past the context, the refusal says what fits


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    tools: ToolRequest | None  # the tools offered, and how the answer becomes calls
    thinking: Thinking | None = None  # where the prompt leaves a reasoning model's thoughts (None: not read)


@dataclass(frozen=True)
class MessagesRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    tools: ToolRequest | None = None  # the tools offered, and how the answer becomes calls
    thinking: Thinking | None = None  # as Prompt's


def read_prompt(data: dict[str, Any], serving: Serving) -> Prompt:
    """The conversation and its tools through the chat template, as token ids."""
    reject_unsupported(data, "messages")
    tools = read_tools(data, serving.tool_parser, serving.call_tags)
    messages, prefill = read_conversation(data.get("system"), data.get("messages"))
    kwargs = _thinking(data.get("thinking"), serving)
    ids = tool_chat_ids(messages, tools, serving, "messages", continuation=prefill, template_kwargs=kwargs)
    return Prompt(ids, tools, serving.prompt_thinking(ids, prefilled=bool(prefill)))


def _thinking(value: Any, serving: Serving) -> dict[str, Any]:
    """`thinking` as the chat template's `enable_thinking` (Qwen3's and SmolLM3's variable): disabled
    turns thoughts off; enabled (with a budget_tokens of at least 1,024, as Anthropic's API takes) or
    adaptive turns them on, and needs a model whose thoughts this server reads (a 400 elsewhere, where
    no thinking block could come). The budget is not enforced: thoughts end where the model ends them,
    or at max_tokens."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind not in ("enabled", "adaptive"):
        raise InvalidParams(
            "thinking", 'thinking must be {"type": "enabled", "budget_tokens": N}, adaptive or disabled'
        )
    budget = value.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_BUDGET):
        message = f"thinking.budget_tokens must be an integer of at least {MIN_BUDGET} with enabled"
        raise InvalidParams("thinking.budget_tokens", message)
    if not serving.reads_reasoning:
        raise InvalidParams(
            "thinking",
            "thinking asks for thoughts, but the served model writes none that this server reads as thinking "
            "blocks (a reasoning model's <think> block, --reasoning-parser); leave it out or disable it",
        )
    return {"enable_thinking": True}


def parse_messages_request(data: dict[str, Any], serving: Serving) -> MessagesRequest:
    prompt = read_prompt(data, serving)
    max_tokens = read_integer(data, "max_tokens", None, 1, MAX_INT32)  # past the context: said below
    if max_tokens is None:
        raise InvalidParams("max_tokens", "max_tokens is required: the most tokens the answer may have")
    context, prompt_tokens = serving.backend.max_seq_len, len(prompt.ids)
    left = context - prompt_tokens
    if 0 < left < max_tokens:  # (a prompt the context cannot hold at all: completion_budget's 400)
        raise ContextLengthExceeded(
            "max_tokens" if max_tokens > context else "messages",  # what could never fit, or the two
            f"This model's maximum context length is {context} tokens and the messages take "
            f"{prompt_tokens}, so max_tokens may be at most {left}; the request asks for {max_tokens}. "
            f"(Claude Code asks for 32000 unless CLAUDE_CODE_MAX_OUTPUT_TOKENS says fewer: set it to "
            f"{left} or less, or serve a longer context with --max-seq-len.)",
        )
    completion_budget(serving, len(prompt.ids), max_tokens, max_tokens, "messages")
    stop = read_stop(data, "stop_sequences", MAX_STOP_SEQUENCES)
    defaults = model_sampling_defaults(serving)  # the model's top_k, min_p and repetition penalty
    params = SamplingParams(
        temperature=read_number(data, "temperature", serving.sampling_default("temperature", 1.0), 0.0, 1.0),
        top_p=read_number(data, "top_p", serving.sampling_default("top_p", 1.0), 0.0, 1.0, low_open=True),
        top_k=read_integer(data, "top_k", defaults.pop("top_k", 0), 0, MAX_TOP_K),  # 0: no top-k cut
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids_of(stop, serving.tokenizer),
        **defaults,
    )
    # No output format here (output_config is refused): the only grammar is the tools'.
    params = with_tool_grammar(params, prompt.tools, "output_config")
    forced = prompt.tools is not None and prompt.tools.choice in ("function", "required")
    if forced and prompt.thinking == HARMONY_PREFILLED:
        raise InvalidParams(
            "tool_choice",
            "tool_choice any or tool forces a tool_use, but the last assistant message is a prefill, which "
            "puts the answer in the model's final message (harmony), where no tool_use can come",
        )
    params = thoughts_first(params, prompt.thinking, forced, serving.tokenizer)
    stream = read_bool(data, "stream", False)
    return MessagesRequest(prompt.ids, params, stream, prompt.tools, prompt.thinking)

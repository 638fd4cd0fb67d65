"""OpenAI's Responses request (POST /v1/responses), served stateless: parsed and checked.

`instructions` and `input` (a string, or items: messages, function calls and their outputs, items.py) go
through the model's chat template as /v1/chat/completions renders messages, and `tools` and
`tool_choice` (tools.py) as chat's are: the calls are decoded under the tools' grammar, and
`text.format` (text_format.py) as chat's `response_format`; `reasoning` as a reasoning model's template
variables (`_reasoning`). Nothing is stored, so `store: true`,
`previous_response_id` and `conversation` are 400s that say so (unsupported_fields.py), rather than
answers that could not be looked up later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import InvalidParams, SamplingParams
from inference_api.apis.responses.items import input_messages
from inference_api.apis.responses.text_format import read_text_format
from inference_api.apis.responses.tools import read_tools
from inference_api.fields import read_bool, read_integer, read_number, read_string
from inference_api.generation import ApiFields
from inference_api.prompts import (
    CHAT_DEFAULT_MAX_TOKENS,
    completion_budget,
    model_sampling_defaults,
    tool_chat_ids,
)
from inference_api.reasoning import Thinking, thoughts_first
from inference_api.router import Serving
from inference_api.tool_calls import ToolRequest, with_tool_grammar
from inference_api.unsupported_fields import SEALED_THOUGHTS, reject_unsupported

# Grammars of JSON the answer is (a format, a forced call): a reasoning model thinks first (reasoning.py).
ANSWER_GRAMMARS = ("text.format", "text.format.schema", "tool_choice")


@dataclass(frozen=True)
class ResponsesRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echoed: dict[str, Any]  # what the response object repeats of the request
    tools: ToolRequest | None = None  # the tools offered, and how the answer becomes calls
    grammar_param: str | None = None  # where params.grammar came from (None: no grammar)
    thinking: Thinking | None = None  # where the prompt leaves a reasoning model's thoughts (None: not read)
    sealed_thoughts: bool = False  # include: ["reasoning.encrypted_content"] (items.sealed_thoughts)

    @property
    def fields(self) -> ApiFields:
        """The request's names for what the backend may refuse (a 400 naming them)."""
        return ApiFields(prompt_ids="input", grammar=self.grammar_param)


def parse_responses_request(data: dict[str, Any], serving: Serving) -> ResponsesRequest:
    reject_unsupported(data, "responses")
    parallel = read_bool(data, "parallel_tool_calls", True)
    tools = read_tools(data, serving.tool_parser, parallel, serving.call_tags)
    text_format = read_text_format(data.get("text"))
    instructions = read_string(data, "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    reasoning, kwargs = _reasoning(data.get("reasoning"), serving)
    messages = system + input_messages(data.get("input"))
    prompt_ids = tool_chat_ids(messages, tools.request, serving, "input", template_kwargs=kwargs)
    max_output_tokens = read_integer(data, "max_output_tokens", None, 1, serving.backend.max_seq_len)
    default_max_tokens = int(serving.sampling_default("max_tokens", CHAT_DEFAULT_MAX_TOKENS))
    max_tokens = completion_budget(serving, len(prompt_ids), max_output_tokens, default_max_tokens, "input")
    params = SamplingParams(
        temperature=read_number(data, "temperature", serving.sampling_default("temperature", 1.0), 0.0, 2.0),
        top_p=read_number(data, "top_p", serving.sampling_default("top_p", 1.0), 0.0, 1.0, low_open=True),
        max_tokens=max_tokens,
        grammar=text_format.grammar,
        **model_sampling_defaults(serving),
    )
    with_tools = with_tool_grammar(params, tools.request, "text.format")
    metadata, user = data.get("metadata"), data.get("user")
    echoed = {
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "parallel_tool_calls": parallel,
        "metadata": metadata if isinstance(metadata, dict) else {},
        "user": user if isinstance(user, str) else None,
        **tools.echoed,
        "text": text_format.echoed,
        "reasoning": reasoning,
    }
    grammar_param = _grammar_param(tools.request) if with_tools is not params else text_format.param
    stream = read_bool(data, "stream", False)
    thinking = serving.prompt_thinking(prompt_ids)
    params = thoughts_first(with_tools, thinking, grammar_param in ANSWER_GRAMMARS, serving.tokenizer)
    return ResponsesRequest(
        prompt_ids,
        params,
        stream,
        echoed,
        tools.request,
        grammar_param,
        thinking,
        sealed_thoughts=SEALED_THOUGHTS in (data.get("include") or ()),  # (checked: only it, if anything)
    )


def _reasoning(value: Any, serving: Serving) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`reasoning` as the response echoes it, and as the chat template's variables: an effort of "none"
    is `enable_thinking: false` (Qwen3's and SmolLM3's variable: no thoughts); another effort is passed
    as `reasoning_effort` (gpt-oss's) with thinking on, and needs a model whose thoughts this server
    reads (a 400 elsewhere, where no reasoning item could come). No summaries: the thoughts come whole, so
    a `summary` of "auto" (the best the model has: Codex sends it) asks for nothing more, and "concise" or
    "detailed" are a 400."""
    if value is None:
        return None, {}
    if not isinstance(value, dict):
        raise InvalidParams("reasoning", 'reasoning must be an object such as {"effort": "low"}')
    for name in ("summary", "generate_summary"):
        if value.get(name) not in (None, "auto"):
            message = f"reasoning.{name}: no summaries here; a reasoning model's thoughts come whole"
            raise InvalidParams(f"reasoning.{name}", message)
    effort = read_string(value, "effort")
    echoed = {"effort": effort, "summary": None}
    if effort is None:
        return echoed, {}
    if effort == "none":
        return echoed, {"enable_thinking": False}
    if not serving.reads_reasoning:
        message = (
            "reasoning asks for thoughts, but the served model writes none that this server reads (a "
            'reasoning model\'s <think> block, --reasoning-parser); leave it out or give an effort of "none"'
        )
        raise InvalidParams("reasoning", message)
    return echoed, {"reasoning_effort": effort, "enable_thinking": True}


def _grammar_param(tools: ToolRequest) -> str:
    """The field a grammar of the tools is named by: the choice that forced a call, else the tools."""
    return "tool_choice" if tools.choice in ("function", "required") else "tools"

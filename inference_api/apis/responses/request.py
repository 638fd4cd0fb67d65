"""OpenAI's Responses request (POST /v1/responses), served stateless: parsed and checked.

`instructions` and `input` (a string, or items: messages, function calls and their outputs, items.py) go
through the model's chat template as /v1/chat/completions renders messages, and `tools` and
`tool_choice` (tools.py) as chat's are: the calls are decoded under the tools' grammar, and
`text.format` (text_format.py) as chat's `response_format`. Nothing is stored, so `store: true`,
`previous_response_id` and `conversation` are 400s that say so (unsupported_fields.py), rather than
answers that could not be looked up later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import SamplingParams
from inference_api.apis.responses.items import input_messages
from inference_api.apis.responses.text_format import read_text_format
from inference_api.apis.responses.tools import read_tools
from inference_api.fields import read_bool, read_integer, read_number, read_string
from inference_api.generation import ApiFields
from inference_api.prompts import CHAT_DEFAULT_MAX_TOKENS, completion_budget, tool_chat_ids
from inference_api.router import Serving
from inference_api.tool_calls import ToolRequest, with_tool_grammar
from inference_api.unsupported_fields import reject_unsupported


@dataclass(frozen=True)
class ResponsesRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echoed: dict[str, Any]  # what the response object repeats of the request
    tools: ToolRequest | None = None  # the tools offered, and how the answer becomes calls
    grammar_param: str | None = None  # where params.grammar came from (None: no grammar)

    @property
    def fields(self) -> ApiFields:
        """The request's names for what the backend may refuse (a 400 naming them)."""
        return ApiFields(prompt_ids="input", grammar=self.grammar_param)


def parse_responses_request(data: dict[str, Any], serving: Serving) -> ResponsesRequest:
    reject_unsupported(data, "responses")
    parallel = read_bool(data, "parallel_tool_calls", True)
    tools = read_tools(data, serving.chat_template.source, parallel)
    text_format = read_text_format(data.get("text"))
    instructions = read_string(data, "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    prompt_ids = tool_chat_ids(system + input_messages(data.get("input")), tools.request, serving, "input")
    max_output_tokens = read_integer(data, "max_output_tokens", None, 1, serving.backend.max_seq_len)
    params = SamplingParams(
        temperature=read_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=read_number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=completion_budget(
            serving, len(prompt_ids), max_output_tokens, CHAT_DEFAULT_MAX_TOKENS, "input"
        ),
        grammar=text_format.grammar,
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
    }
    grammar_param = _grammar_param(tools.request) if with_tools is not params else text_format.param
    return ResponsesRequest(
        prompt_ids, with_tools, read_bool(data, "stream", False), echoed, tools.request, grammar_param
    )


def _grammar_param(tools: ToolRequest) -> str:
    """The field a grammar of the tools is named by: the choice that forced a call, else the tools."""
    return "tool_choice" if tools.choice in ("function", "required") else "tools"

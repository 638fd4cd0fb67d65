"""Tools on the Responses API: `tools` and `tool_choice` read in the Responses API's own shapes and terms
(a 400 names `tools[i].name`, not chat's `tools[i].function.name`), then put in OpenAI chat's shapes for
tool_calls.read_tool_request, so that calls are prompted, decoded and read exactly as chat's are.

Only function tools: a hosted tool (web_search, file_search, mcp, code_interpreter...) is a 400 naming
`tools[i].type`, since nothing here could run it. `tool_choice` {"type": "allowed_tools", "mode",
"tools"} is honoured by offering only the allowed tools, in the prompt and in the calls' grammar: the
model cannot call what it is not shown, and a tool shown yet forbidden would only invite a call the
grammar then refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.messages import InvalidParams
from inference_api.structured_output import json_schema_grammar
from inference_api.tool_calls import (
    FormatTags,
    ToolRequest,
    name_and_description,
    read_tool_list,
    read_tool_request,
)

MODES = ("none", "auto", "required")
SHAPE = '{"type": "function", "name", "parameters"}'
CHOICE_SHAPES = (
    'tool_choice must be "none", "auto", "required", {"type": "function", "name": ...} or '
    '{"type": "allowed_tools", "mode": "auto" or "required", "tools": [{"type": "function", "name": ...}]}'
)


@dataclass(frozen=True)
class ResponsesTools:
    request: ToolRequest | None  # in chat's shapes, for the prompt, the grammar and reading the calls
    echoed: dict[str, Any]  # what the response object repeats: tools (normalized) and tool_choice


def read_tools(
    data: dict[str, Any],
    parser: str,
    parallel: bool,
    call_tags: FormatTags | None = None,
) -> ResponsesTools:
    """The request's `tools` and `tool_choice`, checked (a 400 naming the Responses field), as chat's
    ToolRequest (None without tools). `parallel`: more than one call allowed (parallel_tool_calls);
    `parser` and `call_tags` as read_tool_request takes them."""
    tools = _tools(data.get("tools"))
    choice = data.get("tool_choice")
    offered, chat_choice = _offered(choice, tools)
    chat = {"tools": [_chat_tool(tool) for tool in offered], "tool_choice": chat_choice}
    request = read_tool_request(chat, parser, parallel, call_tags)
    echoed_choice = choice if choice is not None else ("auto" if tools else "none")
    return ResponsesTools(request, {"tools": tools, "tool_choice": echoed_choice})


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    return read_tool_list(value, _tool, lambda tool: tool["name"], SHAPE)


def _tool(tool: Any, param: str) -> dict[str, Any]:
    """One function tool, normalized to the fields the response repeats."""
    if not isinstance(tool, dict):
        raise InvalidParams(param, f"{param} must be {SHAPE}")
    kind = tool.get("type")
    if kind != "function":
        raise InvalidParams(
            f"{param}.type",
            f"{param} is a {kind!r} tool: this server runs no hosted tools; only function tools "
            '(type "function") are supported',
        )
    name, description = name_and_description(tool, param)
    schema = tool.get("parameters")
    if schema is not None:
        if not isinstance(schema, dict):
            raise InvalidParams(f"{param}.parameters", f"{param}.parameters must be a JSON schema")
        json_schema_grammar(schema, f"{param}.parameters")  # a 400 if it cannot be enforced
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParams(f"{param}.strict", f"{param}.strict must be a boolean")
    # strict is repeated as sent (OpenAI's default, true, if not): the arguments follow the schema either
    # way, since every call is decoded under it.
    strict = True if strict is None else strict
    return {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": schema,
        "strict": strict,
    }


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool in chat's shape, as the chat template and the tools' grammar take it."""
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool[key] is not None}
    return {"type": "function", "function": function}


def _offered(choice: Any, tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
    """The tools the model is offered, and chat's tool_choice for them."""
    if choice is None or choice in MODES:
        return tools, choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return tools, {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools":
        return _allowed(choice, tools)
    raise InvalidParams("tool_choice", CHOICE_SHAPES)


def _allowed(choice: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    mode = choice.get("mode")
    if mode not in ("auto", "required"):
        raise InvalidParams("tool_choice.mode", 'tool_choice.mode must be "auto" or "required"')
    allowed = choice.get("tools")
    if not isinstance(allowed, list) or not allowed:
        raise InvalidParams("tool_choice.tools", "tool_choice.tools must be a non-empty list of tools")
    names = [tool["name"] for tool in tools]
    for i, tool in enumerate(allowed):
        param = f"tool_choice.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidParams(param, f'{param} must be {{"type": "function", "name": ...}}')
        if tool.get("name") not in names:
            raise InvalidParams(f"{param}.name", f"{param}.name must name one of the tools")
    chosen = {tool["name"] for tool in allowed}
    return [tool for tool in tools if tool["name"] in chosen], mode
